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
    "bus_factor", "ring_link_bytes", "algbw_gbps", "busbw_gbps", "union_ns", "merge_intervals",
    "attribute_increases", "boundary_indices", "median", "mad", "outlier_threshold", "KIB",
    "COUNTER_LAG_NS",
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


def ring_link_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes a collective of ``nbytes`` puts on each rank's links in each direction when it
    runs as a ring: ``nbytes * bus_factor(op, n)`` (an all-reduce 2(n-1)/n of its bytes,
    reduce-scatter and all-gather (n-1)/n). What a rank's NVLink DATA counters should
    show for it inside one node; a ring that leaves the node carries part of it over the
    network instead."""
    return nbytes * bus_factor(op, group_size)


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

# NVML's NVLink counters lag the traffic by about a millisecond (read right after a
# synchronize, they may miss the tail of an all-reduce): an increase between two samples
# that no collective overlaps, starting this soon after collectives ended, may hold their
# tail.
COUNTER_LAG_NS = 10 * 10**6


def attribute_increases(times: Sequence[int], values: Sequence[Optional[float]],
                        spans: Sequence[Tuple[int, int, float]],
                        lag_ns: Optional[int] = COUNTER_LAG_NS
                        ) -> Tuple[List[Optional[float]], float]:
    """Split a cumulative counter's increases among the ``spans`` that caused them.

    ``spans`` are ``(start, end, weight)``: an operation on the device and what it is
    expected to add to the counter (a collective's link bytes, in the counter's unit),
    taken to be added evenly over ``[start, end]``. The increase between two consecutive
    samples goes to the spans that overlap that interval, each in proportion to the part of
    its weight inside it. An increase that no span overlaps goes to none, except that the
    spans that ended within ``lag_ns`` before the interval began take from it what they
    are still short of their weight (the counters' lagging tail; ``lag_ns`` None: none
    do, for weights that are not in the counter's unit). So every increase is
    counted once: the shares of all spans plus what went to none is the counter's increase
    over the sampled range, however the samples fall relative to the operations. Where a
    sample falls between neighbouring operations the split there is exact; where it falls
    inside one, the operations on either side share the interval by their weights.

    Returns the share of each span (None where part of it lies outside the sampled range,
    or in an interval whose increase is unknown: a None value, or the counter went back)
    and the increase that went to none.

    Example::

        shares, other = attribute_increases([0, 10, 20], [0, 30, 30], [(0, 10, 5.0)])
        # shares == [30.0], other == 0.0
    """
    n = len(times)
    shares: List[Optional[float]] = [0.0] * len(spans)
    if n < 2:
        return [None] * len(spans), 0.0
    weight_in = [0.0] * (n - 1)                 # per interval: weights falling inside it
    parts: List[List[Tuple[int, float]]] = [[] for _ in range(n - 1)]
    for s, (start, end, weight) in enumerate(spans):
        if start < times[0] or end > times[-1] or end < start:
            shares[s] = None
            continue
        first = min(bisect.bisect_right(times, start) - 1, n - 2)
        last = max(bisect.bisect_left(times, end) - 1, first)
        for k in range(first, last + 1):
            if end > start:
                inside = min(end, times[k + 1]) - max(start, times[k])
                w = weight * max(inside, 0) / (end - start)
            else:
                w = float(weight)
            parts[k].append((s, w))
            weight_in[k] += w
    ends = sorted((end, s) for s, (_, end, _) in enumerate(spans) if shares[s] is not None)
    end_times = [e for e, _ in ends]
    unattributed = 0.0
    for k in range(n - 1):
        a, b = values[k], values[k + 1]
        delta = None if a is None or b is None or b < a else float(b - a)
        if delta is None:
            for s, _ in parts[k]:
                shares[s] = None
            continue
        if weight_in[k] > 0:
            for s, w in parts[k]:
                if shares[s] is not None:
                    shares[s] += delta * w / weight_in[k]
            continue
        if delta == 0 or lag_ns is None:
            unattributed += delta
            continue
        # (every interval of a span that ended by times[k] has been split already)
        lo = bisect.bisect_left(end_times, times[k] - lag_ns)
        hi = bisect.bisect_right(end_times, times[k])
        short = {s: spans[s][2] - shares[s] for _, s in ends[lo:hi]
                 if shares[s] is not None and spans[s][2] > shares[s]}
        missing = sum(short.values())
        given = min(delta, missing)
        for s, gap in short.items():
            shares[s] += given * gap / missing
        unattributed += delta - given
    return shares, unattributed


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
