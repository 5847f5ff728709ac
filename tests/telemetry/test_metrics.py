"""Bandwidth, interval and counter arithmetic, checked against hand-computed values."""

import pytest

from commsched.telemetry import metrics as m


def test_bus_factor_follows_nccl_tests():
    # n = 4: all_reduce 2*3/4 = 1.5, reduce_scatter / all_gather 3/4 = 0.75
    assert m.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert m.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert m.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert m.bus_factor("all_reduce", 1) == 0.0
    assert m.bus_factor("broadcast", 8) == 1.0


def test_busbw_is_bytes_over_time_times_factor():
    # 256 MiB in 2 ms over 8 ranks: algbw = 268435456 / 2e6 ns = 134.217728 GB/s,
    # all_reduce busbw = 134.217728 * 14/8 = 234.881024 GB/s
    assert m.algbw_gbps(256 << 20, 2_000_000) == pytest.approx(134.217728)
    assert m.busbw_gbps("all_reduce", 256 << 20, 2_000_000, 8) == pytest.approx(234.881024)
    assert m.busbw_gbps("all_gather", 256 << 20, 2_000_000, 8) == pytest.approx(117.440512)
    assert m.busbw_gbps("all_reduce", 10, 0, 2) is None


def test_union_counts_overlapping_chunks_once():
    # [0,10] u [5,15] u [20,30] u [30,31] -> 15 + 11 = 26
    assert m.union_ns([(20, 30), (0, 10), (5, 15), (30, 31)]) == 26
    assert m.union_ns([]) == 0
    assert m.union_ns([(0, 100), (10, 20)]) == 100


def test_ring_link_bytes_is_the_ring_share_of_the_payload():
    assert m.ring_link_bytes("all_reduce", 1000, 2) == 1000
    assert m.ring_link_bytes("all_reduce", 1000, 4) == 1500
    assert m.ring_link_bytes("reduce_scatter:intra", 1000, 4) == 750


def test_an_interval_shared_by_two_collectives_is_split_by_their_weights():
    # One increase of 600 over [0, 200] while A (weight 400) and B (200) ran in turn.
    shares, other = m.attribute_increases([0, 200], [0, 600], [(0, 100, 400), (100, 200, 200)])
    assert shares == pytest.approx([400, 200]) and other == 0


def test_a_collective_gathers_its_shares_from_every_interval_it_spans():
    # A runs [0, 100], half its weight in each interval; alone, it takes both increases.
    shares, other = m.attribute_increases([0, 50, 100], [0, 100, 400], [(0, 100, 10)])
    assert shares == pytest.approx([400]) and other == 0
    # Beside B in the second interval: A's half weight (5) against B's 15.
    shares, _ = m.attribute_increases([0, 50, 100], [0, 100, 400],
                                      [(0, 100, 10), (50, 100, 15)])
    assert shares == pytest.approx([100 + 300 * 5 / 20, 300 * 15 / 20])


def test_samples_inside_collectives_never_count_an_increase_twice():
    # Samples in the middle of each collective (the host asks for them at its own
    # boundaries): each increase goes to the two collectives it covers, once.
    spans = [(10, 30, 20), (50, 70, 20), (90, 110, 20)]
    times = [0, 20, 60, 100, 120]
    values = [0, 10, 30, 50, 60]        # 1 per ns while a collective runs
    shares, other = m.attribute_increases(times, values, spans)
    assert shares == pytest.approx([20, 20, 20]) and other == 0


def test_an_increase_just_after_collectives_fills_what_they_are_short_of():
    lag = m.COUNTER_LAG_NS
    times = [0, 100, 100 + lag // 2, 2 * lag, 3 * lag]
    # 90 of A's 100 while it ran; the 15 that follow as it ends hold its last 10 (the
    # counters lag) and 5 of traffic of no collective; 30 much later is nobody's
    shares, other = m.attribute_increases(times, [0, 90, 105, 105, 135], [(0, 100, 100)])
    assert shares == pytest.approx([100]) and other == 35
    # a collective that got all it moved takes nothing more
    shares, other = m.attribute_increases(times, [0, 100, 110, 110, 110], [(0, 100, 100)])
    assert shares == pytest.approx([100]) and other == 10


def test_unknown_intervals_and_spans_outside_the_samples_give_none():
    spans = [(10, 20, 5), (30, 40, 5), (60, 80, 5)]
    # the counter went back between 25 and 50 (reset): the second span is unknown
    shares, _ = m.attribute_increases([0, 25, 50, 70], [0, 5, 1, 9], spans)
    assert shares[0] == pytest.approx(5) and shares[1] is None and shares[2] is None
    shares, other = m.attribute_increases([0], [0], spans)
    assert shares == [None, None, None] and other == 0


def test_shares_and_the_rest_add_up_to_the_counters_increase():
    import random
    rng = random.Random(7)
    times = sorted(rng.sample(range(1, 10_000), 40)) + [10_000]
    times = [0] + times
    values = [0]
    for _ in times[1:]:
        values.append(values[-1] + rng.randrange(0, 50))
    spans = []
    for _ in range(60):
        a = rng.randrange(0, 9_900)
        spans.append((a, a + rng.randrange(0, 100), rng.randrange(0, 10)))
    shares, other = m.attribute_increases(times, values, spans)
    assert sum(shares) + other == pytest.approx(values[-1] - values[0])


def test_boundary_indices_take_the_first_sample_after_each_boundary():
    times = [0, 105, 150, 201, 260]
    # boundaries at 100 and 200: samples 105 (index 1) and 201 (index 3)
    assert m.boundary_indices(times, 100, 200) == (1, 3)
    assert m.boundary_indices(times, 100, 300) is None


def test_outlier_threshold_median_plus_three_mad_with_floor():
    # values 10,11,12,13,100: median 12, |dev| = 2,1,0,1,88 -> MAD 1 -> 12 + 3*1 = 15
    assert m.outlier_threshold([10, 11, 12, 13, 100]) == pytest.approx(15)
    # MAD 0: the floor 1% of the median (100 -> 1) gives 100 + 3 = 103
    assert m.outlier_threshold([100, 100, 100, 150]) == pytest.approx(103)
    assert m.outlier_threshold([]) is None
