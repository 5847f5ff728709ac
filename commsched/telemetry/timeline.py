"""Where a window of GPU time recorded by torch.profiler goes: the device's activities and
the host calls that launched them, read from a Chrome trace (``export_chrome_trace``).

Every figure is in milliseconds over the whole window unless a name says otherwise. The
activities of one device split its span three ways, instant by instant: **compute** (any
activity that is not an NCCL kernel: kernels, copies, memsets, on any stream), **exposed
communication** (an NCCL kernel runs and nothing else does) and **idle** (nothing runs);
``overlap()`` gives each, with the communication hidden under compute, the kernels slowed
beside communication and the longest gaps in compute. ``idle_causes()`` splits idle time
by the launch call of the activity that ends it: until that call returned the device waited
for the host ("host late"), after it for work already queued ("dependency").
``step_split`` builds the per-step split on these; ``examples/bench/trace_overlap.py``
prints them.

Standard library only: it runs where the traces were taken.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

from .errors import TelemetryError

__all__ = ["Interval", "load_complete", "split_trace", "load_trace", "load_events",
           "host_calls", "python_self_time", "comm_timeline", "launch_calls", "idle_causes",
           "is_comm", "union", "length", "covered", "overlap", "device_events",
           "busiest_device"]

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_SAMPLES = 3     # instances of a kernel name, alone and beside comm, for the slowdown

Interval = Tuple[float, float]


HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load_complete(path: str) -> List[dict]:
    """Every complete event ("ph": "X") of a Chrome trace, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise TelemetryError(f"trace {path}: not a readable Chrome trace "
                             f"({type(exc).__name__}: {exc})") from None
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def split_trace(complete: List[dict]) -> Tuple[List[dict], List[dict]]:
    """A trace's GPU activities and its host-side CUDA runtime/driver calls."""
    return ([e for e in complete if e.get("cat") in GPU_CATEGORIES and e.get("dur", 0) > 0],
            [e for e in complete if e.get("cat") in HOST_CATEGORIES])


def load_trace(path: str) -> Tuple[List[dict], List[dict]]:
    """The trace's GPU activities and its host-side CUDA runtime/driver calls."""
    return split_trace(load_complete(path))


def load_events(path: str) -> List[dict]:
    """The trace's GPU activities."""
    return load_trace(path)[0]


def host_calls(calls: List[dict], iters: int, top: int) -> List[Dict[str, object]]:
    """Per host thread (most calls first): CUDA calls per iteration, their time (ms) per
    iteration, and the ``top`` most frequent names with their counts per iteration."""
    by_thread: Dict[object, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for e in calls:
        by_thread[e.get("tid")][e["name"]].append(float(e.get("dur", 0)))
    threads = []
    for tid, names in by_thread.items():
        count = sum(len(d) for d in names.values())
        threads.append({
            "tid": tid, "calls": count / iters,
            "ms": sum(sum(d) for d in names.values()) / 1e3 / iters,
            "top": [(name, len(d) / iters) for name, d in
                    sorted(names.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:top]]})
    threads.sort(key=lambda t: -t["calls"])
    return threads


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def python_self_time(complete: List[dict], iters: int, top: int) -> List[Dict[str, object]]:
    """Per host thread (most Python time first), from a trace recorded with Python stacks
    (``with_stack=True``; the harness's ``BENCH_PROFILE_STACKS=1``): its Python functions'
    self time per iteration, i.e. each call's duration less its Python callees' (what the
    function spent in its own frame and in the C++ it called directly), the ``top`` largest
    with their calls per iteration, and the thread's Python time at its outermost frames."""
    calls = [e for e in complete if e.get("cat") == "python_function"]
    children: Dict[object, float] = defaultdict(float)
    for e in calls:
        parent = e.get("args", {}).get("Python parent id")
        if parent is not None:
            children[(e.get("tid"), parent)] += float(e.get("dur", 0))
    by_thread: Dict[object, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    outer: Dict[object, float] = defaultdict(float)
    for e in calls:
        args = e.get("args", {})
        dur = float(e.get("dur", 0))
        own = dur - children.get((e.get("tid"), args.get("Python id")), 0.0)
        name = _ADDRESS.sub("", e["name"])          # one entry per bound method, not object
        by_thread[e.get("tid")][name].append(max(0.0, own))
        if args.get("Python parent id") is None:
            outer[e.get("tid")] += dur
    threads = []
    for tid, names in by_thread.items():
        ranked = sorted(names.items(), key=lambda kv: -sum(kv[1]))
        threads.append({
            "tid": tid, "ms": outer[tid] / 1e3 / iters,
            "top": [(name, sum(d) / 1e3 / iters, len(d) / iters) for name, d in ranked[:top]]})
    threads.sort(key=lambda t: -t["ms"])
    return threads


def comm_timeline(events: List[dict], calls: List[dict], device: int) -> List[Dict[str, object]]:
    """The NCCL kernels of ``device`` in start order, ms from its first GPU activity: each
    with the host call that launched it (matched by correlation id; None where the trace
    lacks it), the launching thread, its start and duration, and the time since the
    previous NCCL kernel ended (0 where they overlap)."""
    events = [e for e in events if e.get("args", {}).get("device", device) == device]
    if not events:
        return []
    origin = min(float(e["ts"]) for e in events)
    launches = launch_calls(calls)
    rows, last_end = [], None
    for e in sorted((e for e in events if is_comm(e)), key=lambda e: float(e["ts"])):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        call = launches.get(e.get("args", {}).get("correlation"))
        rows.append({
            "name": e["name"][:40],
            "launch_ms": None if call is None else (float(call["ts"]) - origin) / 1e3,
            "tid": None if call is None else call.get("tid"),
            "start_ms": (start - origin) / 1e3, "dur_ms": (end - start) / 1e3,
            "idle_before_ms": 0.0 if last_end is None else max(0.0, start - last_end) / 1e3})
        last_end = end if last_end is None else max(last_end, end)
    return rows


def launch_calls(calls: List[dict]) -> Dict[object, dict]:
    """The host calls by correlation id: the call that launched a GPU activity is the one
    with the activity's ``args.correlation``."""
    return {e["args"]["correlation"]: e for e in calls if "correlation" in e.get("args", {})}


def idle_causes(events: List[dict], calls: List[dict], device: int,
                top: int) -> Dict[str, object]:
    """Every stretch where ``device`` ran nothing, split by the launch call of the activity
    that ends it: until that call returned the device waited for the host ("host late"),
    after it for work already queued ("dependency": a stream wait, an event). A stretch
    whose next activity has no launch call in the trace counts as unknown. Totals in ms,
    and the ``top`` longest stretches of each kind (ms from the first activity, the late
    host thread)."""
    events = sorted((e for e in events if e.get("args", {}).get("device", device) == device),
                    key=lambda e: float(e["ts"]))
    launches = launch_calls(calls)
    origin = float(events[0]["ts"]) if events else 0.0
    totals = {"host_late_ms": 0.0, "dependency_ms": 0.0, "unknown_ms": 0.0}
    stretches: Dict[str, List[Tuple[float, float, object, str]]] = defaultdict(list)
    busy_until = None
    for e in events:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            call = launches.get(e.get("args", {}).get("correlation"))
            if call is None:
                totals["unknown_ms"] += gap / 1e3
            else:
                returned = float(call["ts"]) + float(call.get("dur", 0))
                late = min(gap, max(0.0, returned - busy_until))
                totals["host_late_ms"] += late / 1e3
                totals["dependency_ms"] += (gap - late) / 1e3
                if late > 0:
                    stretches["host_late"].append((late / 1e3, (busy_until - origin) / 1e3,
                                                   call.get("tid"), e["name"][:40]))
                if gap > late:
                    stretches["dependency"].append(((gap - late) / 1e3,
                                                    (busy_until - origin) / 1e3, None,
                                                    e["name"][:40]))
        busy_until = end if busy_until is None else max(busy_until, end)
    result: Dict[str, object] = dict(totals)
    for kind in ("host_late", "dependency"):
        result[kind] = [{"ms": ms, "at_ms": at, "tid": tid, "next": name}
                        for ms, at, tid, name in sorted(stretches[kind], reverse=True)[:top]]
    return result


def is_comm(event: dict) -> bool:
    return event.get("cat") == "kernel" and event["name"].startswith("nccl")


def union(intervals: Sequence[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Sequence[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def covered(start: float, end: float, merged: Sequence[Interval],
            starts: Sequence[float]) -> float:
    """Length of [start, end) inside the disjoint sorted ``merged`` intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(merged) and merged[i][0] < end:
        lo, hi = max(start, merged[i][0]), min(end, merged[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def overlap(events: List[dict], device: int, gaps: int) -> Dict[str, object]:
    """The split of ``device``'s span into compute, exposed communication and idle, the
    communication hidden under compute, the compute kernels' sum and their slowdown beside
    communication, idle time per tenth of the span, and the ``gaps`` longest stretches
    without compute (module docstring)."""
    events = [e for e in events if e.get("args", {}).get("device", device) == device]
    if not events:
        raise TelemetryError(f"trace: no GPU activity for device {device}")
    comm = [e for e in events if is_comm(e)]
    compute = [e for e in events if not is_comm(e)]
    iv = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    comm_u, compute_u = union([iv(e) for e in comm]), union([iv(e) for e in compute])
    all_u = union([iv(e) for e in events])
    span = all_u[-1][1] - all_u[0][0]
    tenths = [0.0] * 10
    origin = all_u[0][0]
    for (_, idle_start), (idle_end, _) in zip(all_u, all_u[1:]):
        for k in range(10):
            lo = max(idle_start, origin + span * k / 10)
            hi = min(idle_end, origin + span * (k + 1) / 10)
            if hi > lo:
                tenths[k] += hi - lo
    comm_starts = [s for s, _ in comm_u]
    hidden = sum(covered(s, e, comm_u, comm_starts) for s, e in compute_u)

    # Kernel slowdown beside communication, per kernel name.
    by_name: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for e in compute:
        if e["cat"] != "kernel":
            continue
        s, t = iv(e)
        by_name[e["name"]].append((t - s, covered(s, t, comm_u, comm_starts) / (t - s)))
    extra = base = 0.0
    for samples in by_name.values():
        alone = [d for d, f in samples if f < 0.05]
        beside = [d for d, f in samples if f > 0.5]
        if len(alone) >= MIN_SAMPLES and len(beside) >= MIN_SAMPLES:
            mean_alone = sum(alone) / len(alone)
            base += mean_alone * len(beside)
            extra += sum(beside) - mean_alone * len(beside)

    # Longest gaps in compute, and what filled them.
    compute_sorted = sorted(compute, key=lambda e: e["ts"])
    holes = []
    last_end, last_name = None, None
    for e in compute_sorted:
        s, t = iv(e)
        if last_end is not None and s > last_end:
            holes.append((s - last_end, last_end, s, last_name, e["name"]))
        if last_end is None or t > last_end:
            last_end, last_name = t, e["name"]
    holes.sort(reverse=True)
    # "after": the kernel the gap follows; "before": the one it precedes.
    top = [{"gap_ms": g / 1e3, "at_ms": (a - all_u[0][0]) / 1e3,
            "comm_ms": covered(a, b, comm_u, comm_starts) / 1e3,
            "after": prev_name[:60], "before": next_name[:60]}
           for g, a, b, prev_name, next_name in holes[:gaps]]
    return {
        "span_ms": span / 1e3,
        "compute_ms": length(compute_u) / 1e3,
        "comm_ms": length(comm_u) / 1e3,
        "hidden_ms": hidden / 1e3,
        "exposed_ms": (length(comm_u) - hidden) / 1e3,
        "idle_ms": (span - length(all_u)) / 1e3,
        "idle_by_tenth_ms": [t / 1e3 for t in tenths],
        "kernel_sum_ms": sum(float(e["dur"]) for e in compute if e["cat"] == "kernel") / 1e3,
        "comm_kernels": len(comm),
        "slowdown": (extra / base) if base else None,
        "slowdown_ms": extra / 1e3,
        "gaps": top,
    }




def device_events(events: List[dict], device: int) -> List[dict]:
    """The activities of ``device`` (an activity without a device index counts as its)."""
    return [e for e in events if e.get("args", {}).get("device", device) == device]


def busiest_device(events: List[dict]) -> int:
    """The device index with the most activities in the trace (0 when it has none)."""
    count: Dict[int, int] = defaultdict(int)
    for e in events:
        count[e.get("args", {}).get("device", 0)] += 1
    return max(count, key=count.get) if count else 0
