"""Topology-aware decompositions on CPU processes acting as nodes (COMMSCHED_LOCAL_SIZE).

Each rank's input is a known function of (rank, iteration, request), so the expected sum
is computed locally; with 4 or 8 ranks the summation order differs between decompositions,
so values are compared within float32 rounding.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist

from commsched import Config, Scheduler
from distributed import run_workers

SIZES = (1, 5, 333, 4099)


def rank_input(rank, iteration, request, numel):
    gen = torch.Generator().manual_seed(1000 * iteration + 10 * request + rank)
    return torch.randn(numel, generator=gen)


def _decompositions_equal_plain_sum(rank, world, local_size, decompositions, sleepy):
    rng = random.Random(rank)
    for decompose in decompositions:
        sched = Scheduler(Config(decompose=decompose, local_size=local_size,
                                 partition_bytes=2048, credit_bytes=4096, profile_iters=1),
                          trace_dispatch=True)
        for it in range(3):
            reqs = []
            for i, n in enumerate(SIZES):
                if sleepy:
                    time.sleep(rng.random() * 0.003)
                reqs.append(sched.submit(rank_input(rank, it, i, n), key=i, priority=-i))
            sched.end_iteration()
            for i, r in enumerate(reqs):
                ref = sum(rank_input(q, it, i, SIZES[i]) for q in range(world))
                torch.testing.assert_close(r.wait(), ref, rtol=1e-5, atol=1e-5)
        sched.drain(timeout=60)
        # Ranks with the same role (node leader or not) issue identical sequences.
        topo = next(iter(sched._lanes.values())).topology
        logs = [None] * world
        dist.all_gather_object(logs, (topo.is_leader, sched.dispatch_log()))
        for leader in (True, False):
            same = [log for is_leader, log in logs if is_leader == leader]
            assert all(log == same[0] for log in same), (decompose, leader)
        sched.close()


@pytest.mark.parametrize("decompose", ["hier", "leader", "auto"])
def test_two_nodes_of_two(decompose):
    run_workers(_decompositions_equal_plain_sum, 4, 2, [decompose], False, timeout=240)


def test_two_nodes_of_four_adversarial_timing():
    run_workers(_decompositions_equal_plain_sum, 8, 4, ["hier", "leader"], True, timeout=400)


def test_each_gpu_a_node():
    # COMMSCHED_LOCAL_SIZE=1: the intra-node steps run on one-rank groups.
    run_workers(_decompositions_equal_plain_sum, 2, 1, ["hier", "leader"], True, timeout=240)


def _bad_local_size(rank, world):
    sched = Scheduler(Config(decompose="hier", local_size=3))
    with pytest.raises(ValueError, match="do not divide into nodes of 3"):
        sched.submit(torch.ones(8), key=0)
    sched.close()


def test_local_size_must_divide_the_world():
    run_workers(_bad_local_size, 4, timeout=60)
