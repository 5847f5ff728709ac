"""Bus factors of topology steps, and the ranks telemetry records for them."""

import torch

from commsched import Config, Scheduler
from commsched.observer import Observer
from commsched.telemetry.metrics import bus_factor
from distributed import run_workers


def test_topology_steps_count_as_their_op_over_their_sub_group():
    assert bus_factor("reduce_scatter:intra", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("all_reduce:inter", 2) == bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("broadcast:intra", 2) == 1.0
    for op in ("all_reduce", "reduce_scatter:intra", "reduce:intra", "broadcast:intra"):
        assert bus_factor(op, 1) == 0.0          # a one-rank group moves nothing


class _Records(Observer):
    def __init__(self):
        self.records = []

    def on_chunk(self, record):
        self.records.append(record)

    def on_iteration(self, record):
        pass


def _records_name_the_sub_group(rank, world, local_size, decompose):
    observer = _Records()
    sched = Scheduler(Config(decompose=decompose, local_size=local_size, partition_bytes=0),
                      observer)
    sched.submit(torch.ones(64), key="g").wait()
    sched.end_iteration()
    sched.drain(timeout=60)
    sched.close()
    node, local = divmod(rank, local_size)
    expected = {
        "intra": tuple(range(node * local_size, (node + 1) * local_size)),
        "inter": tuple(range(local, world, local_size)),
        "leaders": tuple(range(0, world, local_size)),
    }
    steps = {r.step: r.group_ranks for r in observer.records}
    assert steps, "no chunk records"
    for step, ranks in steps.items():
        assert ranks == expected[step.split(":")[1]], (rank, step, ranks)


def _both(rank, world, local_size):
    for decompose in ("hier", "leader"):
        _records_name_the_sub_group(rank, world, local_size, decompose)


def test_topology_step_records_carry_the_sub_group_ranks():
    run_workers(_both, 4, 2, timeout=120)
