"""Pure arithmetic shared by the recorder, the report and the trace export.

Units: times are ``time.time_ns()`` nanoseconds; one byte per nanosecond is one GB/s
(10^9 bytes per second), which is why bandwidths below are simply ``bytes / ns``.
NVML NVLink throughput counters are cumulative KiB.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "bus_factor", "algbw_gbps", "busbw_gbps", "union_ns", "merge_intervals", "value_at",
    "delta_interpolated", "bracket", "boundary_indices", "median", "mad", "outlier_threshold", "KIB",
]

KIB = 1024


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests bus-bandwidth factor of a collective over ``group_size`` ranks.

    all_reduce moves ``2(n-1)/n`` of the tensor over each rank's busiest link (ring:
    reduce-scatter then all-gather); reduce_scatter and all_gather move ``(n-1)/n``, with the
    byte count taken as the full (unsplit) tensor. Anything else (broadcast, ...) counts 1,
    except on a one-rank group, which moves nothing. A topology step ``"op:role"`` (e.g.
    ``reduce_scatter:intra``) counts as its op over its sub-group.
    """
    n = max(int(group_size), 1)
    op = op.split(":", 1)[0]
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def algbw_gbps(nbytes: int, duration_ns: int) -> Optional[float]:
    """Algorithm bandwidth, GB/s: tensor bytes over elapsed time (None for a zero duration)."""
    if duration_ns <= 0:
        return None
    return nbytes / duration_ns


def busbw_gbps(op: str, nbytes: int, duration_ns: int, group_size: int) -> Optional[float]:
    """Bus bandwidth, GB/s: ``algbw * bus_factor(op, n)`` (comparable with link speed)."""
    alg = algbw_gbps(nbytes, duration_ns)
    return None if alg is None else alg * bus_factor(op, group_size)


def union_ns(intervals: Iterable[Tuple[int, int]]) -> int:
    """Total length of the union of ``[start, end]`` intervals.

    Chunks of one iteration overlap in time (the credit window keeps several in flight), so
    their durations must not be summed: the union is the time the lane was communicating.
    """
    return sum(end - start for start, end, _, _ in
               merge_intervals((start, end, None) for start, end in intervals))


def merge_intervals(spans: Iterable[Tuple[int, int, object]]) -> List[list]:
    """The union of ``(start, end, label)`` intervals as disjoint ``[start, end, first,
    last]`` in time order: ``first`` labels the interval that opened it, ``last`` the one
    that ended it. Intervals with ``end < start`` are ignored."""
    merged: List[list] = []
    for start, end, label in sorted(spans, key=lambda s: (s[0], s[1])):
        if end < start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, label
        else:
            merged.append([start, end, label, label])
    return merged


# --- cumulative counters -------------------------------------------------------------------
# ``times`` is sorted ascending and ``values`` holds the counter read at each time.

def value_at(times: Sequence[int], values: Sequence[float], t: int) -> Optional[float]:
    """The counter at time ``t``, linearly interpolated between the samples around it.

    None outside the sampled range: a counter is never extrapolated.
    """
    if not times or t < times[0] or t > times[-1]:
        return None
    i = bisect.bisect_left(times, t)
    if times[i] == t:
        return float(values[i])
    t0, t1 = times[i - 1], times[i]
    v0, v1 = values[i - 1], values[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def delta_interpolated(times: Sequence[int], values: Sequence[float],
                       t0: int, t1: int) -> Optional[float]:
    """Counter increase while an operation ran in ``[t0, t1]``, interpolating between samples.

    This is OSU INAM's correlation of an operation with its links: traffic between two samples
    is assumed uniform in time, so an operation is credited with the share of each sample
    interval it overlaps. Exact when samples were taken at ``t0`` and ``t1``.
    """
    a, b = value_at(times, values, t0), value_at(times, values, t1)
    if a is None or b is None:
        return None
    return max(b - a, 0.0)


def bracket(times: Sequence[int], t0: int, t1: int) -> Optional[Tuple[int, int]]:
    """Indices ``(i, j)`` of the last sample at or before ``t0`` and the first at or after
    ``t1``: the samples enclosing the window.

    Unlike :func:`delta_interpolated`, a counter difference between enclosing samples never
    undercounts the window: every byte that moved in ``[t0, t1]`` is included, plus whatever
    else moved between the enclosing samples. The recorder asks for a sample when an
    iteration's communication ends so that the enclosing samples are close to the window.
    When nothing was sampled before ``t0`` the first sample is used (the window then starts
    late); None when no sample at or after ``t1`` exists yet.
    """
    if not times:
        return None
    j = bisect.bisect_left(times, t1)
    if j >= len(times):
        return None
    i = max(bisect.bisect_right(times, t0) - 1, 0)
    if i > j:
        return None
    return i, j


def boundary_indices(times: Sequence[int], t0: int, t1: int) -> Optional[Tuple[int, int]]:
    """Indices of the first samples at or after ``t0`` and at or after ``t1``.

    For windows between two boundaries at which a sample was *requested* (``step()``): the
    requested sample is taken just after the boundary, so "the counter at boundary t" is the
    first sample at or after t. None when the sample for ``t1`` does not exist.
    """
    i = bisect.bisect_left(times, t0)
    j = bisect.bisect_left(times, t1)
    if j >= len(times) or i > j:
        return None
    return i, j


# --- robust statistics ---------------------------------------------------------------------

def median(values: Sequence[float]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def mad(values: Sequence[float]) -> Optional[float]:
    """Median absolute deviation (unscaled)."""
    med = median(values)
    if med is None:
        return None
    return statistics.median([abs(v - med) for v in values if v is not None])


def outlier_threshold(values: Sequence[float], k: float = 3.0,
                      floor_fraction: float = 0.01) -> Optional[float]:
    """``median + k * max(MAD, floor_fraction * median)``.

    The floor keeps perfectly regular runs (MAD == 0, common in synthetic or very stable
    jobs) from flagging sub-percent jitter as outliers.
    """
    med = median(values)
    if med is None:
        return None
    spread = max(mad(values) or 0.0, floor_fraction * abs(med))
    return med + k * spread
