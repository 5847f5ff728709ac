"""Topology-aware decompositions on CPU processes acting as nodes (Config.local_size).

Each rank's input is a known function of (rank, iteration, request), so the expected sum
is computed locally; with 4 or 8 ranks the summation order differs between decompositions,
so values are compared within float32 rounding.
"""

import random
import time
import warnings

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
    # local_size=1: the intra-node steps run on one-rank groups.
    run_workers(_decompositions_equal_plain_sum, 2, 1, ["hier", "leader"], True, timeout=240)


def _bad_local_size(rank, world):
    sched = Scheduler(Config(decompose="hier", local_size=3))
    with pytest.raises(ValueError, match="do not divide into nodes of 3"):
        sched.submit(torch.ones(8), key=0)
    sched.close()


def test_local_size_must_divide_the_world():
    run_workers(_bad_local_size, 4, timeout=60)


# --- decompose=auto: measured choice (calibrate.py) ---------------------------------------

def _auto_calibrates_at_the_first_request(rank, world, local_size):
    from commsched.calibrate import CALIBRATION_SIZES
    sched = Scheduler(Config(decompose="auto", local_size=local_size, partition_bytes=0,
                             profile_iters=1), trace_dispatch=True)
    sizes = (100, 70_000, 1_500_000)       # floats: 400 B, 280 KB, 6 MB chunks
    for it in range(2):
        reqs = [sched.submit(rank_input(rank, it, i, n), key=i, priority=i)
                for i, n in enumerate(sizes)]
        sched.end_iteration()
        for i, r in enumerate(reqs):
            ref = sum(rank_input(q, it, i, sizes[i]) for q in range(world))
            torch.testing.assert_close(r.wait(), ref, rtol=1e-5, atol=1e-5)
    sched.drain(timeout=60)
    lane = next(iter(sched._lanes.values()))
    table = lane.topology.auto_table
    assert table is not None and table.sizes == CALIBRATION_SIZES
    assert table.candidates == ("none", "hier", "leader")
    # Every rank holds the same measurements, hence makes the same choices.
    tables = [None] * world
    dist.all_gather_object(tables, table.rows())
    assert all(t == tables[0] for t in tables)
    # Each request ran the decomposition the table names for its size.
    chosen = {key: req.decompose for key, req in
              ((r.key, r) for r in reqs)}
    for i, n in enumerate(sizes):
        assert chosen[i] == table.choose(4 * n), (i, chosen[i], table.rows())
    sched.close()


def _auto_cases(rank, world, local_size):
    # One spawn of 4 ranks for the three multi-rank auto cases (spawning costs seconds).
    # Calibration and the decompositions call no deprecated torch API: torch's
    # FutureWarnings fail the worker (pytest's filters do not reach it).
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _auto_calibrates_at_the_first_request(rank, world, local_size)
        _auto_agrees_on_the_slowest_rank(rank, world, local_size)
        _auto_override_later_keeps_the_static_rule(rank, world, local_size)


def test_auto_calibrates_agrees_on_the_slowest_rank_and_falls_back_when_late():
    """At the first request every rank calibrates and holds the same table (the MAX over
    ranks, checked with a fake clock); an auto override after the first request keeps
    the static rule."""
    run_workers(_auto_cases, 4, 2, timeout=240)


def _auto_agrees_on_the_slowest_rank(rank, world, local_size):
    from commsched.calibrate import calibrate
    from commsched.topology import Topology
    topology = Topology(dist.group.WORLD, local_size)
    ticks = iter(range(10**6))

    def clock():  # measurement j of rank r lasts (j + 1) * (r + 1) seconds / repeats
        k = next(ticks)
        j, end = divmod(k, 2)
        return 0.0 if not end else (j + 1) * (rank + 1) * 1.0

    sizes = (4096, 65536)
    table = calibrate(topology, torch.device("cpu"), torch.float32, sizes=sizes, repeats=2,
                      clock=clock)
    expected = [[(i * 3 + c + 1) * world * 1e6 / 2 for c in range(3)] for i in range(2)]
    assert [list(row) for row in table.times_us] == expected
    assert table.winners == ("none", "none")


def test_auto_table_picks_per_size_and_describes_the_spans():
    from commsched.calibrate import AutoTable
    table = AutoTable((4096, 65536, 1 << 20), ("none", "hier", "leader"),
                      [(30.0, 40.0, 20.0), (50.0, 50.0, 60.0), (900.0, 500.0, 700.0)])
    assert table.winners == ("leader", "none", "hier")       # a tie goes to none
    assert [table.choose(n) for n in (1, 4096, 4097, 65536, 1 << 20, 1 << 30)] == [
        "leader", "leader", "none", "none", "hier", "hier"]
    assert table.rows()[2] == {"bytes": 1 << 20, "none_us": 900.0, "hier_us": 500.0,
                               "leader_us": 700.0, "chosen": "hier"}
    assert table.describe() == ("by chunk size: up to 4 KiB leader, up to 64 KiB none, "
                                "above: hier")
    same = AutoTable((4096, 65536), ("none",), [(1.0,), (2.0,)])
    assert same.describe() == "by chunk size: every size: none"


# The margin rule: starting from none, hier and then leader take over only where they
# measured under 0.8 x the time of the one chosen so far. Expected values by hand.
@pytest.mark.parametrize("times, chosen", [
    ((100.0, 80.0, 90.0), "none"),      # hier exactly 20% faster: not more, none stays
    ((100.0, 79.9, 90.0), "hier"),      # hier more than 20% faster
    ((100.0, 85.0, 81.0), "none"),      # both faster, neither by the margin
    ((100.0, 70.0, 60.0), "hier"),      # leader beats hier by less than 20% of hier's time
    ((100.0, 70.0, 55.9), "leader"),    # leader beats hier by more than 20% (70 * 0.8 = 56)
    ((100.0, 85.0, 70.0), "leader"),    # hier not 20% ahead of none; leader is
    ((50.0, 100.0, 39.9), "leader"),    # hier slower: leader must still beat none by 20%
    ((50.0, 100.0, 40.0), "none"),
])
def test_auto_leaves_none_only_for_a_candidate_faster_by_the_margin(times, chosen):
    from commsched.calibrate import AUTO_MARGIN, AutoTable
    assert AUTO_MARGIN == 0.2
    table = AutoTable((1 << 20,), ("none", "hier", "leader"), [times])
    assert table.winners == (chosen,)


def test_auto_choice_is_stable_under_noise_within_the_margin():
    """Launches whose times differ by up to +-9% per candidate (so two candidates within 2%
    of each other may swap places) make the same choice where the faster one is not 20%
    ahead."""
    import itertools
    from commsched.calibrate import AutoTable
    base = (100.0, 98.0, 99.0)                     # hier measured fastest, by 2%
    choices = set()
    for noise in itertools.product((0.91, 1.0, 1.09), repeat=3):
        times = [t * f for t, f in zip(base, noise)]
        choices.add(AutoTable((4096,), ("none", "hier", "leader"), [times]).winners)
    assert choices == {("none",)}


def _auto_override_later_keeps_the_static_rule(rank, world, local_size):
    from commsched.calibrate import static_choice
    sched = Scheduler(Config(decompose="none", local_size=local_size, partition_bytes=0))
    sched.submit(torch.ones(10), key="first").wait()
    sched.end_iteration()
    req = sched.submit(torch.ones(300_000), key="auto", decompose="auto")
    sched.end_iteration()
    torch.testing.assert_close(req.wait(), torch.full((300_000,), float(world)))
    lane = next(iter(sched._lanes.values()))
    assert lane.topology.auto_table is None          # not calibrated with work in flight
    assert req.decompose == static_choice(lane.topology.nodes, 1_200_000) == "hier"
    sched.close()
