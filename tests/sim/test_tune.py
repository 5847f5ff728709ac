"""The tuner ranks candidate settings by predicted iteration time."""

from commsched.sim import IterationProfile, SimConfig, SimRequest, default_candidates, tune

MIB = 1 << 20


class LatencyOnly:
    """1 s per collective step, whatever its size."""

    def cost_s(self, step, decompose, nbytes, world_size):
        return 1.0


def one_request():
    return IterationProfile((SimRequest("g", 64 * MIB, 0.0),), compute_end_s=0.0)


def test_default_grid():
    grid = default_candidates(one_request(), world_size=2)
    # partition 1..64 MiB (7) x credit {1,2,4,8 x partition, unbounded} + partition off x
    # {1,2,4,8 x the largest request, unbounded} = 40, for each of 2 decompositions.
    assert len(grid) == 80
    assert SimConfig(4 * MIB, 16 * MIB, "priority", "rs_ag", 2) in grid
    assert SimConfig(0, 0, "priority", "none", 2) in grid
    assert SimConfig(0, 128 * MIB, "priority", "none", 2) in grid


def test_latency_bound_link_prefers_few_chunks_and_no_decomposition():
    # 64 MiB at 1 s a step: one chunk, one step -> 1000 ms (partition off or 64 MiB);
    # 1 MiB chunks decomposed -> 64 chunks x 2 steps = 128 s.
    ranked = tune(one_request(), LatencyOnly(), world_size=2)
    best, best_ms = ranked[0]
    assert best_ms == 1000.0
    assert best.decompose == "none" and best.partition_bytes in (0, 64 * MIB)
    worst, worst_ms = ranked[-1]
    assert worst_ms == 128000.0
    assert (worst.partition_bytes, worst.decompose) == (MIB, "rs_ag")
    times = [ms for _, ms in ranked]
    assert times == sorted(times)


def test_given_candidates_are_ranked_as_given_on_ties():
    a = SimConfig(32 * MIB, 0, "fifo", "none", 2)     # 2 chunks -> 2000 ms
    b = SimConfig(0, 0, "fifo", "none", 2)             # 1 chunk -> 1000 ms
    c = SimConfig(64 * MIB, 0, "fifo", "none", 2)      # 1 chunk -> 1000 ms
    assert tune(one_request(), LatencyOnly(), [a, b, c]) == [(b, 1000.0), (c, 1000.0),
                                                              (a, 2000.0)]
