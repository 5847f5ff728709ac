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


def test_value_at_interpolates_and_never_extrapolates():
    times, values = [100, 200, 400], [0, 1000, 1400]
    assert m.value_at(times, values, 150) == pytest.approx(500)
    assert m.value_at(times, values, 300) == pytest.approx(1200)
    assert m.value_at(times, values, 200) == 1000
    assert m.value_at(times, values, 99) is None
    assert m.value_at(times, values, 401) is None


def test_inam_correlation_credits_an_op_with_the_bytes_of_its_interval():
    # Samples every 100 ns; 1000 KiB moved in [0,100], 3000 KiB in [100,200].
    times, values = [0, 100, 200], [0, 1000, 4000]
    # An op running [50, 150]: half of the first interval (500) + half of the second (1500).
    assert m.delta_interpolated(times, values, 50, 150) == pytest.approx(2000)
    # Exact when the op's ends coincide with samples.
    assert m.delta_interpolated(times, values, 100, 200) == pytest.approx(3000)
    assert m.delta_interpolated(times, values, 150, 250) is None


def test_bracket_finds_the_samples_enclosing_a_window():
    times = [0, 100, 200, 300]
    assert m.bracket(times, 120, 180) == (1, 2)
    assert m.bracket(times, 100, 200) == (1, 2)      # samples exactly at the window's ends
    assert m.bracket(times, -50, 50) == (0, 1)       # nothing before: the first sample
    assert m.bracket(times, 250, 350) is None        # nothing after yet
    assert m.bracket([], 0, 1) is None


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
