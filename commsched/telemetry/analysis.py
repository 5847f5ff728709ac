"""Per-iteration analysis of a run: the table, the summary, and the blame for slow iterations.

Definitions (also printed by ``commsched report --json`` under "definitions"):

iteration
    With ``commsched.step()`` markers: from one marker to the next (iteration 0 starts when
    the recorder opened). Without markers: lane iteration k, timed from the flush of
    iteration k-1 to the flush of k of the lane with the most iterations.
comm (communication busy time)
    Time at least one chunk step of the iteration was on the device: the union of the
    ``[t_start, t_end]`` intervals (chunks overlap under the credit window).
exposed comm
    Communication busy time after the end of backward: the union of the iteration's
    chunk-step intervals, each lane iteration's clipped to start at its flush (its last
    gradient was submitted, i.e. backward ended), at most the iteration's length. Compute
    is not recorded; the device computes backward until the flush, so a collective that
    ran before it ran beside backward, and one that runs after it is what the step waits
    for before its optimizer step. In commsched's data-parallel mode the next forward may
    run during that time, so there it is an upper bound. On CUDA the flush is when the
    device got there (a timed event recorded at the flush): where the host runs ahead of
    a busy GPU, the host ends backward long before the device does.
compute
    iteration time - exposed comm.
efficiency
    floor / iteration time, where the run directory (or the directory above it) holds a
    ``floor.json``: a ``commsched floor`` result or the benchmark harness's compute only
    and comm only of the same workload; floor = max(compute only, comm only).
overlap %
    ``100 * (1 - exposed / comm)``: the share of the communication hidden behind compute.
link idle
    Time in the iteration when no collective of any lane or iteration was on the device:
    where a communication-bound run loses time. The widest such gap is named by the
    collectives around it (``lane/request#chunk``): the one that ended last before it and
    the one that started after it, either possibly outside the iteration.
bus bandwidth
    Sum over chunk steps of ``bytes * factor(op, n)`` divided by comm time, with
    factor ``2(n-1)/n`` for all_reduce and ``(n-1)/n`` for reduce_scatter / all_gather.
NVLink bytes
    The NVLink DATA bytes the iteration's collectives put on the rank's links: each
    increase of the counters between two samples goes to the collectives that ran on the
    device in that interval, in proportion to what each should move in it (its expected
    bytes, spread evenly over its device time); an increase while none ran goes to the
    collectives that ended within 10 ms before (the counters lag the traffic), up to what
    they are still short of, and otherwise to no iteration (the summary's "outside
    collectives"). Samples are taken at host events and, where the host runs ahead, fall
    anywhere in the device's timeline; an iteration is located by its collectives' device
    intervals, never by a window between samples, so no byte is counted twice. Exact
    where a sample falls between two iterations' collectives; where one falls inside a
    collective, neighbours share that interval by their expected bytes.
expected NVLink bytes
    What the iteration's collectives should put on each rank's links in each direction,
    run as rings: ``bytes * 2(n-1)/n`` per all-reduce, ``bytes * (n-1)/n`` per
    reduce-scatter or all-gather (the bus bytes). Within one node; a ring across nodes
    carries part of it over the network.
NVLink GB/s
    NVLink bytes of the iteration divided by comm time: the link throughput achieved
    while communicating; utilization divides it by the sum of the active links' speeds
    (per direction).
outlier
    iteration time > median + 3 * max(MAD, 1% of median) over the selected iterations.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..floor import floor_efficiency
from .metrics import (KIB, attribute_increases, median, merge_intervals, outlier_threshold,
                      ring_link_bytes, union_ns)
from .sampler import ALL_LINKS
from .store import RunData

__all__ = ["DEFINITIONS", "RankData", "iteration_rows", "summarize", "find_outliers",
           "analyze"]

DEFINITIONS = {
    "iteration": "between consecutive commsched.step() markers; without markers, between "
                 "consecutive flushes of the lane with most iterations",
    "comm_ms": "communication busy time: union of the iteration's chunk-step device "
               "intervals",
    "exposed_comm_ms": "communication busy time after the end of backward: union of the "
                       "chunk-step intervals clipped to start at their lane's flush (on CUDA "
                       "when the device got there); at most iteration_ms (upper bound in the "
                       "data-parallel mode)",
    "compute_ms": "iteration_ms - exposed_comm_ms",
    "efficiency": "floor / iteration_ms, floor = max(compute only, comm only) from the run "
                  "directory's floor.json (commsched floor --save, or the harness)",
    "overlap_pct": "100 * (1 - exposed_comm_ms / comm_ms)",
    "link_idle_ms": "time in the iteration with no collective of any lane on the device",
    "widest_gap_ms": "the longest such stretch; widest_gap_at_ms: its start after the "
                     "iteration's; widest_gap_after / _before: the collectives around it",
    "idle_unsubmitted_ms": "link idle time split by where the collective that ended each "
                           "stretch was: not yet submitted (the application had not handed "
                           "its gradients over; also a stretch no collective ended); "
                           "idle_queued_ms: submitted, not yet issued (priority order, credit "
                           "window, dispatch latency); idle_issued_ms: issued, not yet "
                           "started on the device (its stream waiting for the compute that "
                           "produces its input, where the host runs ahead of the GPU, or "
                           "behind other collectives)",
    "busbw_gbps": "sum(bytes * factor) / comm time; factor 2(n-1)/n all_reduce, (n-1)/n "
                  "reduce_scatter and all_gather",
    "nvlink_tx_bytes": "NVLink DATA TX bytes the iteration's collectives put on the links: "
                       "each counter increase split among the collectives on the device in "
                       "its sample interval by their expected bytes",
    "nvlink_expected_bytes": "what the iteration's collectives should put on each rank's "
                             "links per direction as rings: bytes * 2(n-1)/n all_reduce, "
                             "(n-1)/n reduce_scatter and all_gather",
    "nvlink_tx_ratio": "nvlink_tx_bytes / nvlink_expected_bytes",
    "nvlink_tx_gbps": "nvlink_tx_bytes / comm time",
    "nvlink_tx_bytes_outside_collectives": "(summary, whole run) counter increases while no "
                                           "recorded collective ran",
    "outlier": "iteration_ms > median + 3 * max(MAD, 1% of median)",
}

# Attribution thresholds (heuristics; see find_outliers).
BYTES_TOLERANCE = 0.05        # communicated bytes differing by more than this: the app changed
LINK_SHARE_DROP = 0.5         # a link carrying < half its usual share of traffic: hardware


@dataclass
class RankData:
    """One rank's rows, indexed for the analysis."""

    rank: int
    run: dict
    steps: List[dict]
    lane_iterations: List[dict]
    chunks_by_lane_iter: Dict[Tuple[str, int], List[dict]]
    sample_times: Dict[int, List[int]] = field(default_factory=dict)    # per link
    sample_tx: Dict[int, List[float]] = field(default_factory=dict)     # KiB
    sample_rx: Dict[int, List[float]] = field(default_factory=dict)
    health: Dict[int, List[dict]] = field(default_factory=dict)          # per link, by time
    health_times: Dict[int, List[int]] = field(default_factory=dict)
    speed_gbps: Optional[float] = None     # sum of active link speeds
    # union of every collective's device interval: [start, end, first, last] (the
    # comm_ops rows of the collectives that opened it and that ended it last), in time order
    busy: List[list] = field(default_factory=list)
    busy_starts: List[int] = field(default_factory=list)
    # NVLink DATA bytes each lane iteration's collectives put on the links, per (link,
    # direction) (see ``_attribute_links``): None where unknown; per link, TX only
    link_shares: Dict[Tuple[int, str], Dict[Tuple[str, int], Optional[float]]] = \
        field(default_factory=dict)
    link_outside: Dict[Tuple[int, str], float] = field(default_factory=dict)
    chunk_tx: Dict[int, Optional[float]] = field(default_factory=dict)   # id(row) -> bytes

    @classmethod
    def build(cls, run: RunData, rank: int) -> "RankData":
        info = next((r for r in run.rows("runs", rank)), {"rank": rank})
        chunks: Dict[Tuple[str, int], List[dict]] = {}
        for c in run.rows("comm_ops", rank):
            chunks.setdefault((c["lane"], c["iteration"]), []).append(c)
        data = cls(rank, info, sorted(run.rows("app_steps", rank), key=lambda s: s["step"]),
                   sorted(run.rows("iterations", rank),
                          key=lambda r: (r["lane"], r["iteration"])), chunks)
        per_link: Dict[int, List[Tuple[int, Optional[int], Optional[int]]]] = {}
        for s in run.rows("nvlink_metrics", rank):
            per_link.setdefault(s["link"], []).append(
                (s["t_ns"], s["data_tx_kib"], s["data_rx_kib"]))
        for link, samples in per_link.items():
            samples.sort(key=lambda x: x[0])
            data.sample_times[link] = [t for t, _, _ in samples]
            data.sample_tx[link] = [tx for _, tx, _ in samples]
            data.sample_rx[link] = [rx for _, _, rx in samples]
        for h in sorted(run.rows("nvlink_health", rank), key=lambda h: h["t_ns"]):
            data.health.setdefault(h["link"], []).append(h)
            data.health_times.setdefault(h["link"], []).append(h["t_ns"])
        speeds = [t["speed_mbps"] for t in run.rows("intra_node_topo", rank)
                  if t["state"] == 1 and t["speed_mbps"]]
        data.speed_gbps = sum(speeds) / 1000.0 if speeds else None
        data.busy = merge_intervals(
            (c["t_start_ns"], c["t_end_ns"], c) for c in run.rows("comm_ops", rank)
            if c["ok"] and c["t_start_ns"] is not None and c["t_end_ns"] is not None)
        data.busy_starts = [b[0] for b in data.busy]
        data._attribute_links(run.rows("comm_ops", rank))
        return data

    def _attribute_links(self, comm_ops: List[dict]) -> None:
        """Give each collective its share of every NVLink counter's increases
        (:func:`metrics.attribute_increases`, weighted by the bytes a ring puts on the links),
        and sum the shares per lane iteration. An iteration's traffic is located by its
        collectives' device intervals, never by a window between samples: where the host
        runs ahead of the GPU, the samples it asks for at its own iteration boundaries fall
        inside another iteration's communication on the device, so windows around one
        iteration's communication overlap the next one's."""
        ops = [c for c in comm_ops if c["ok"] and c["t_start_ns"] is not None
               and c["t_end_ns"] is not None]
        spans = [(c["t_start_ns"], c["t_end_ns"], expected_link_bytes(c) / KIB) for c in ops]
        for link, times in self.sample_times.items():
            for direction, series in (("tx", self.sample_tx), ("rx", self.sample_rx)):
                if link != ALL_LINKS and direction == "rx":
                    continue
                # A link's share of a collective's bytes is not known beforehand: its
                # lagging tail is found in the sums only.
                shares, outside = attribute_increases(
                    times, series[link], spans,
                    **({} if link == ALL_LINKS else {"lag_ns": None}))
                per: Dict[Tuple[str, int], Optional[float]] = {}
                for c, share in zip(ops, shares):
                    key = (c["lane"], c["iteration"])
                    if key in per and per[key] is None:
                        continue
                    per[key] = None if share is None else per.get(key, 0.0) + share * KIB
                    if link == ALL_LINKS and direction == "tx":
                        self.chunk_tx[id(c)] = None if share is None else share * KIB
                self.link_shares[(link, direction)] = per
                self.link_outside[(link, direction)] = outside * KIB

    def nvlink_bytes(self, link: int, direction: str,
                     lane_iterations: List[Tuple[str, int]]) -> Optional[int]:
        """NVLink DATA bytes the collectives of ``lane_iterations`` put on ``link`` (-1:
        all) in ``direction``; None where not sampled, or no collective ran."""
        per = self.link_shares.get((link, direction))
        if per is None:
            return None
        shares = [per[key] for key in lane_iterations if key in per]
        if not shares or any(v is None for v in shares):
            return None
        return int(round(sum(shares)))

    def link_gaps(self, t0: int, t1: int) -> Tuple[int, Optional[tuple], List[int]]:
        """Link idle time in [t0, t1] (no collective on the device); its widest gap, as
        (start, end, collective that ended last before it, collective that started after
        it), comm_ops rows or None where there is none; and the idle time split by where
        the collective that ended each gap was meanwhile: [not yet submitted, queued,
        issued] (see ``_split_gap``)."""
        busy, idle, widest, split = self.busy, 0, None, [0, 0, 0]
        cursor, after = t0, None
        j = bisect.bisect_right(self.busy_starts, t0) - 1
        if j >= 0:
            cursor, after = min(max(busy[j][1], t0), t1), busy[j][3]
        j += 1
        while cursor < t1:
            nxt = busy[j] if j < len(busy) else None
            gap_end = t1 if nxt is None else min(nxt[0], t1)
            if gap_end > cursor:
                idle += gap_end - cursor
                _split_gap(cursor, gap_end, None if nxt is None else nxt[2], split)
                if widest is None or gap_end - cursor > widest[1] - widest[0]:
                    widest = (cursor, gap_end, after, None if nxt is None else nxt[2])
            if nxt is None or nxt[0] >= t1:
                break
            cursor, after = min(nxt[1], t1), nxt[3]
            j += 1
        return idle, widest, split

    def health_changes(self, t0: int, t1: int) -> List[str]:
        """Link state, speed or error-counter changes between the health samples enclosing
        [t0, t1] (health is sampled about once a second, so the blame is that coarse)."""
        out = []
        for link in sorted(self.health):
            times, rows = self.health_times[link], self.health[link]
            i = bisect.bisect_right(times, t0) - 1
            j = bisect.bisect_left(times, t1)
            if i < 0 or j >= len(times) or i >= j:
                continue
            b, a = rows[i], rows[j]
            if b["state"] != a["state"]:
                out.append(f"link {link}: state {b['state']} -> {a['state']}")
            if b["speed_mbps"] and a["speed_mbps"] is not None \
                    and a["speed_mbps"] < b["speed_mbps"]:
                out.append(f"link {link}: speed {b['speed_mbps']} -> {a['speed_mbps']} MB/s")
            for counter in ("crc_flit", "crc_data", "replay", "recovery"):
                if b[counter] is not None and a[counter] is not None and a[counter] > b[counter]:
                    out.append(f"link {link}: {counter} errors +{a[counter] - b[counter]}")
        return out


def _split_gap(g0: int, g1: int, nxt: Optional[dict], split: List[int]) -> None:
    """Add the link gap [g0, g1) to ``split`` by what ``nxt``, the collective that started
    after it (None: none did), was doing: [not yet submitted, submitted but not yet issued,
    issued but not yet started on the device]."""
    if nxt is None:
        split[0] += g1 - g0
        return
    submitted = min(max(nxt["t_submit_ns"], g0), g1)
    issued = min(max(nxt["t_dispatch_ns"], submitted), g1)
    split[0] += submitted - g0
    split[1] += issued - submitted
    split[2] += g1 - issued


def _label(c: Optional[dict]) -> Optional[str]:
    return None if c is None else f"{c['lane']}/{c['request_key']}#{c['chunk_index']}"


def _windows(data: RankData) -> List[Tuple[int, int, Optional[int], List[dict]]]:
    """(iteration, begin_ns, end_ns or None, lane iterations) per application iteration."""
    its = data.lane_iterations
    if data.steps:
        bounds = [data.run.get("start_ns") or min(
            [s["t_ns"] for s in data.steps] + [i["t_first_submit_ns"] or 0 for i in its])]
        bounds += [s["t_ns"] for s in data.steps]
        by_flush = sorted(its, key=_flush_time)
        flushes = [_flush_time(i) for i in by_flush]
        out = []
        for k in range(len(data.steps)):
            t0, t1 = bounds[k], bounds[k + 1]
            lo, hi = bisect.bisect_right(flushes, t0), bisect.bisect_right(flushes, t1)
            out.append((data.steps[k]["step"], t0, t1, by_flush[lo:hi]))
        return out
    lanes: Dict[str, List[dict]] = {}
    for i in its:
        lanes.setdefault(i["lane"], []).append(i)
    if not lanes:
        return []
    primary = sorted(lanes, key=lambda name: (-len(lanes[name]), name))[0]
    flush = {i["iteration"]: _flush_time(i) for i in lanes[primary]}
    by_index: Dict[int, List[dict]] = {}
    for i in its:
        by_index.setdefault(i["iteration"], []).append(i)
    out = []
    for k in sorted(by_index):
        t1 = flush.get(k)
        t0 = flush.get(k - 1)
        out.append((k, t0 if t0 is not None else _first_time(by_index[k]),
                    t1 if t0 is not None else None, by_index[k]))
    return out


def _flush_time(i: dict) -> int:
    return i["t_flush_ns"] if i["t_flush_ns"] is not None else (i["t_first_submit_ns"] or 0)


def _first_time(members: List[dict]) -> int:
    return min((m["t_first_submit_ns"] or 0) for m in members)


def iteration_rows(data: RankData, floor: Optional[dict] = None) -> List[dict]:
    """One row per application iteration of one rank (see the module's definitions);
    ``floor``: a ``commsched floor`` result (``load_floor``) for the efficiency column."""
    rows = []
    for k, t0, t1, members in _windows(data):
        chunks = [c for m in members for c in data.chunks_by_lane_iter.get(
            (m["lane"], m["iteration"]), [])]
        intervals = [(c["t_start_ns"], c["t_end_ns"]) for c in chunks if c["ok"]]
        comm_ns = union_ns(intervals)
        exposed_ns = _exposed_ns(data, members)
        iter_ns = (t1 - t0) if t1 is not None else None
        if exposed_ns is not None and iter_ns is not None:
            # Communication that runs on past the next iteration's start is exposed in
            # that iteration, not beyond this one's length (compute would go negative).
            exposed_ns = min(exposed_ns, iter_ns)
        # What the iteration's collectives should put on each rank's links, and what the
        # counters credit them with (their share of every increase, by device interval).
        expected = sum(expected_link_bytes(c) for c in chunks if c["ok"])
        keys = [(m["lane"], m["iteration"]) for m in members]
        tx = data.nvlink_bytes(ALL_LINKS, "tx", keys)
        rx = data.nvlink_bytes(ALL_LINKS, "rx", keys)
        links = {link: data.nvlink_bytes(link, "tx", keys)
                 for link, direction in data.link_shares if link >= 0 and direction == "tx"}
        tx_gbps = tx / comm_ns if tx is not None and comm_ns else None
        # Link health: over the application iteration, or (without markers) its
        # communication.
        if data.steps:
            w0, w1 = t0, t1
        elif intervals:
            w0, w1 = min(a for a, _ in intervals), max(b for _, b in intervals)
        else:
            w0 = w1 = None
        idle_ns, gap, split = (data.link_gaps(t0, t1) if t1 is not None
                               else (None, None, [None] * 3))
        rows.append({
            "rank": data.rank, "iteration": k, "t_begin_ns": t0, "t_end_ns": t1,
            "iteration_ms": _ms(iter_ns),
            "compute_ms": (_ms(iter_ns - exposed_ns)
                           if iter_ns is not None and exposed_ns is not None else None),
            "comm_ms": _ms(comm_ns), "exposed_comm_ms": _ms(exposed_ns),
            "overlap_pct": (max(0.0, min(100.0, 100.0 * (1 - exposed_ns / comm_ns)))
                            if comm_ns and exposed_ns is not None else None),
            "efficiency": (floor_efficiency(floor["compute_only_ms"], floor["comm_only_ms"],
                                            _ms(iter_ns))["efficiency"]
                           if floor and iter_ns else None),
            "link_idle_ms": _ms(idle_ns),
            "widest_gap_ms": _ms(gap[1] - gap[0]) if gap else None,
            "widest_gap_at_ms": _ms(gap[0] - t0) if gap else None,
            "widest_gap_after": _label(gap[2]) if gap else None,
            "widest_gap_before": _label(gap[3]) if gap else None,
            "idle_unsubmitted_ms": _ms(split[0]), "idle_queued_ms": _ms(split[1]),
            "idle_issued_ms": _ms(split[2]),
            "bytes": sum(m["nbytes"] or 0 for m in members),
            "chunk_steps": len(chunks),
            "lane_iterations": [f"{m['lane']}:{m['iteration']}" for m in members],
            "complete": all(m["complete"] for m in members),
            "busbw_gbps": expected / comm_ns if comm_ns else None,
            "nvlink_expected_bytes": expected if chunks else None,
            "nvlink_tx_bytes": tx, "nvlink_rx_bytes": rx,
            "nvlink_tx_ratio": tx / expected if tx is not None and expected else None,
            "nvlink_tx_gbps": tx_gbps,
            "nvlink_rx_gbps": rx / comm_ns if rx is not None and comm_ns else None,
            "nvlink_util": tx_gbps / data.speed_gbps if tx_gbps and data.speed_gbps else None,
            "link_tx_bytes": links,
            "health": data.health_changes(w0, w1) if w0 is not None else [],
        })
    return rows


def _exposed_ns(data: RankData, members: List[dict]) -> Optional[int]:
    """Communication busy time after the end of backward: the union over the iteration's
    lane iterations of their collectives' device intervals clipped to start at that lane
    iteration's flush (on CUDA where the device got there). None when no lane iteration
    has a flush; 0 when none flushed in the window."""
    clipped = []
    flushed = False
    for m in members:
        if m["t_flush_ns"] is None:
            continue
        flushed = True
        for c in data.chunks_by_lane_iter.get((m["lane"], m["iteration"]), []):
            if c["ok"] and c["t_end_ns"] is not None and c["t_end_ns"] > m["t_flush_ns"]:
                clipped.append((max(c["t_start_ns"], m["t_flush_ns"]), c["t_end_ns"]))
    if not flushed:
        return None if members else 0
    return union_ns(clipped)


def expected_link_bytes(c: dict) -> float:
    """What a collective step (a ``comm_ops`` row) should put on each rank's links, in
    each direction, run as a ring (:func:`metrics.ring_link_bytes`)."""
    return ring_link_bytes(c["step"], c["nbytes"], c["group_size"])


def _ms(ns: Optional[float]) -> Optional[float]:
    return None if ns is None else ns / 1e6


def summarize(rows: List[dict]) -> dict:
    """Medians (robust to the warm-up iteration) and totals of a rank's rows."""
    def med(key):
        return median([r[key] for r in rows if r[key] is not None])
    return {
        "iterations": len(rows),
        "iteration_ms_median": med("iteration_ms"), "compute_ms_median": med("compute_ms"),
        "comm_ms_median": med("comm_ms"), "exposed_comm_ms_median": med("exposed_comm_ms"),
        "overlap_pct_median": med("overlap_pct"), "busbw_gbps_median": med("busbw_gbps"),
        "link_idle_ms_median": med("link_idle_ms"), "widest_gap_ms_median": med("widest_gap_ms"),
        "idle_unsubmitted_ms_median": med("idle_unsubmitted_ms"),
        "idle_queued_ms_median": med("idle_queued_ms"),
        "idle_issued_ms_median": med("idle_issued_ms"),
        "widest_gap_usual": _usual_gap(rows),
        "nvlink_tx_gbps_median": med("nvlink_tx_gbps"),
        "bytes_total": sum(r["bytes"] for r in rows),
        "nvlink_tx_bytes_total": (None if all(r["nvlink_tx_bytes"] is None for r in rows)
                                  else sum(r["nvlink_tx_bytes"] or 0 for r in rows)),
        "nvlink_expected_bytes_total": sum(r["nvlink_expected_bytes"] or 0 for r in rows),
        "nvlink_tx_ratio_median": med("nvlink_tx_ratio"),
        "nvlink_tx_ratio_total": _total_ratio(rows),
        "incomplete_iterations": sum(1 for r in rows if not r["complete"]),
    }


def _total_ratio(rows: List[dict]) -> Optional[float]:
    """Counted over expected NVLink TX bytes, summed over the iterations where both are
    known."""
    known = [r for r in rows if r["nvlink_tx_bytes"] is not None and r["nvlink_expected_bytes"]]
    expected = sum(r["nvlink_expected_bytes"] for r in known)
    return sum(r["nvlink_tx_bytes"] for r in known) / expected if expected else None


def _usual_gap(rows: List[dict]) -> Optional[dict]:
    """The collectives most often around the iterations' widest link gap, and how often."""
    pairs: Dict[Tuple[Optional[str], Optional[str]], int] = {}
    for r in rows:
        if r["widest_gap_ms"] is not None:
            key = (r["widest_gap_after"], r["widest_gap_before"])
            pairs[key] = pairs.get(key, 0) + 1
    if not pairs:
        return None
    (after, before), count = max(pairs.items(), key=lambda kv: kv[1])
    return {"after": after, "before": before, "iterations": count,
            "of": sum(pairs.values())}


def find_outliers(rows: List[dict]) -> List[dict]:
    """Slow iterations and their most likely cause.

    Against the medians of the other iterations:

    1. compute grew at least as much as exposed comm: **application** (compute is slower,
       communication normal);
    2. else, a link changed (state, speed, error counters) or carried much less than its
       usual share of the traffic: **hardware**;
    3. else, the iteration communicated a different number of bytes: **application**;
    4. else: **communication library** (same bytes, slower collectives: lower bus bandwidth,
       links less used than in other iterations).
    """
    timed = [r for r in rows if r["iteration_ms"] is not None]
    threshold = outlier_threshold([r["iteration_ms"] for r in timed])
    if threshold is None:
        return []
    slow = [r for r in timed if r["iteration_ms"] > threshold]
    normal = [r for r in timed if r["iteration_ms"] <= threshold] or timed
    base = {k: median([r[k] for r in normal if r[k] is not None])
            for k in ("iteration_ms", "compute_ms", "exposed_comm_ms", "comm_ms", "bytes",
                      "busbw_gbps", "nvlink_tx_gbps")}
    base_shares = _median_shares(normal)
    return [_attribute(r, threshold, base, base_shares) for r in slow]


def _shares(row: dict) -> Dict[int, float]:
    links = {l: b for l, b in row["link_tx_bytes"].items() if b is not None}
    total = sum(links.values())
    return {l: b / total for l, b in links.items()} if total > 0 else {}


def _median_shares(rows: List[dict]) -> Dict[int, float]:
    per_link: Dict[int, List[float]] = {}
    for r in rows:
        for l, s in _shares(r).items():
            per_link.setdefault(l, []).append(s)
    return {l: median(v) for l, v in per_link.items()}


def _attribute(row: dict, threshold: float, base: dict, base_shares: Dict[int, float]) -> dict:
    def delta(key):
        if row[key] is None or base[key] is None:
            return 0.0
        return row[key] - base[key]

    def fmt(key, unit):
        return (f"{key} {row[key]:.3g} {unit} vs median {base[key]:.3g} {unit}"
                if row[key] is not None and base[key] is not None else f"{key} unknown")

    d_compute, d_exposed = delta("compute_ms"), delta("exposed_comm_ms")
    evidence = [fmt("compute_ms", "ms"), fmt("exposed_comm_ms", "ms")]
    hardware = list(row["health"])
    for link, share in _shares(row).items():
        usual = base_shares.get(link)
        if usual and share < LINK_SHARE_DROP * usual:
            hardware.append(f"link {link} carried {100 * share:.1f}% of the NVLink traffic "
                            f"vs {100 * usual:.1f}% usually")
    bytes_changed = (base["bytes"] and
                     abs(row["bytes"] - base["bytes"]) > BYTES_TOLERANCE * base["bytes"])
    if d_compute >= d_exposed:
        cause = "application"
        evidence.insert(0, f"compute slower by {d_compute:.3g} ms while exposed comm changed "
                           f"by {d_exposed:+.3g} ms")
    elif hardware:
        cause = "hardware"
        evidence = hardware + evidence + [fmt("nvlink_tx_gbps", "GB/s")]
    elif bytes_changed:
        cause = "application"
        evidence.insert(0, f"communicated {row['bytes']} bytes vs {base['bytes']:.0f} usually")
    else:
        cause = "communication library"
        evidence += [fmt("busbw_gbps", "GB/s"), fmt("nvlink_tx_gbps", "GB/s")]
        if row["nvlink_tx_gbps"] is None:
            evidence.append("no NVLink data: hardware cannot be ruled out")
    return {"rank": row["rank"], "iteration": row["iteration"],
            "iteration_ms": row["iteration_ms"], "threshold_ms": threshold,
            "median_ms": base["iteration_ms"], "cause": cause, "evidence": evidence}


def analyze(run: RunData, iterations: Optional[Tuple[Optional[int], Optional[int]]] = None,
            ranks: Optional[List[int]] = None, floor: Optional[dict] = None) -> dict:
    """Rows, summaries and outliers of every rank (``iterations``: ``[a, b)`` filter);
    ``floor``: a ``commsched floor`` result for the efficiency columns."""
    out = {"rows": [], "summary": {}, "outliers": [], "runs": run.runs, "floor": floor,
           "definitions": DEFINITIONS}
    for rank in run.ranks:
        if ranks is not None and rank not in ranks:
            continue
        data = RankData.build(run, rank)
        rows = iteration_rows(data, floor)
        if iterations is not None:
            a, b = iterations
            rows = [r for r in rows if (a is None or r["iteration"] >= a)
                    and (b is None or r["iteration"] < b)]
        out["rows"] += rows
        summary = out["summary"][rank] = summarize(rows)
        # (over the whole run, whatever the --iterations selection)
        summary["nvlink_tx_bytes_outside_collectives"] = (
            int(data.link_outside[(ALL_LINKS, "tx")])
            if (ALL_LINKS, "tx") in data.link_outside else None)
        summary["efficiency_median"] = (
            floor_efficiency(floor["compute_only_ms"], floor["comm_only_ms"],
                             summary["iteration_ms_median"])["efficiency"]
            if floor and summary["iteration_ms_median"] else None)
        out["outliers"] += find_outliers(rows)
    return out
