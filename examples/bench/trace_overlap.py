"""Where a profiled window's GPU time goes: compute, communication, their overlap, idle.

    python examples/bench/trace_overlap.py TRACE.json.gz [...] [--iters 4] [--gaps 8] [--host 8]
        [--comm] [--idle] [--python 20]

Reads Chrome traces written by torch.profiler (the harness writes them with
``BENCH_PROFILE=DIR``, megatron_e2e.py with ``--profile-dir``) and prints, per trace, per
profiled iteration (``--iters``: the harness's ``BENCH_WINDOW``, 3 for megatron_e2e.py):

* span: first to last GPU activity of the window;
* compute: union of the intervals of every GPU activity that is not an NCCL kernel
  (kernels, copies, memsets), on any stream;
* comm: union of the NCCL kernels' intervals; hidden: the part of it under compute;
  exposed: the part that runs while no compute does;
* idle: span minus both;
* kernel sum: the compute kernels' durations added up, so two traces of the same model
  can be compared (a larger sum with the same kernels is kernels slowed down, by
  communication running beside them, for instance);
* slowdown: for each compute kernel name seen at least 3 times with and 3 times without
  an NCCL kernel running beside it, the mean duration of the overlapped instances against
  the others, weighted by time: how much communication slows the compute it overlaps;
* idle by tenth: the time the GPU ran nothing in each tenth of the window's span (where in
  the iteration the device waits: the forward's launches, the backward's, its end);
* the longest compute gaps (no compute on the GPU), with the kernels around them and how
  much of each gap communication filled;
* with ``--idle``: each stretch where the GPU ran nothing, split by the launch call of the
  activity that ends it: up to the end of that call the device waited for the host (host
  late), after it for something already queued (a stream waiting for an event: a
  dependency); per iteration, with the longest stretches of each kind and the host thread
  that was late;
* with ``--host N``: per host thread, the CUDA runtime and driver calls it made per
  iteration (count and time) and its N most frequent ones: what a mode adds to the
  threads that launch the work (a profile recorded with CUDA activity has these calls
  even without CPU operators).
* with ``--python N`` (a trace recorded with Python stacks, ``BENCH_PROFILE_STACKS=1``): per
  host thread, the N Python functions with the most self time per iteration (a call's
  duration less its Python callees'): where a thread's host time goes, by function;
* with ``--comm``: every NCCL kernel in device order, when its launch call was made on the
  host and by which thread, when it started on the device and for how long, and how long
  the link had been idle since the previous one ended: the order the collectives were
  issued in, and what each one waited for.

Standard library only: it runs where the traces were taken.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_SAMPLES = 3     # instances of a kernel name, alone and beside comm, for the slowdown

Interval = Tuple[float, float]


HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load_complete(path: str) -> List[dict]:
    """Every complete event ("ph": "X") of a Chrome trace, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X"]


def split_trace(complete: List[dict]) -> Tuple[List[dict], List[dict]]:
    """A trace's GPU activities and its host-side CUDA runtime/driver calls."""
    return ([e for e in complete if e.get("cat") in GPU_CATEGORIES and e.get("dur", 0) > 0],
            [e for e in complete if e.get("cat") in HOST_CATEGORIES])


def load_trace(path: str) -> Tuple[List[dict], List[dict]]:
    """The trace's GPU activities and its host-side CUDA runtime/driver calls."""
    return split_trace(load_complete(path))


def load_events(path: str) -> List[dict]:
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


def analyse(events: List[dict], device: int, gaps: int) -> Dict[str, object]:
    events = [e for e in events if e.get("args", {}).get("device", device) == device]
    if not events:
        raise ValueError(f"no GPU activity for device {device}")
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


def python_lines(threads: List[Dict[str, object]]) -> List[str]:
    lines = []
    for t in threads:
        lines.append(f"  python on thread {t['tid']}: {t['ms']:.2f} ms at its outermost frames;"
                     " most self time:")
        for name, ms, n in t["top"]:
            lines.append(f"    {ms:.3f} ms in {n:g} calls: {name[:90]}")
    return lines


def report(path: str, result: Dict[str, object], iters: int) -> str:
    per = lambda k: result[k] / iters  # noqa: E731
    lines = [f"{path}: per iteration (window of {iters})",
             f"  span {per('span_ms'):.2f} ms = compute {per('compute_ms'):.2f}"
             f" + comm exposed {per('exposed_ms'):.2f} + idle {per('idle_ms'):.2f}",
             f"  comm {per('comm_ms'):.2f} ms ({result['comm_kernels'] // iters} NCCL kernels),"
             f" hidden under compute {per('hidden_ms'):.2f}",
             f"  compute kernel sum {per('kernel_sum_ms'):.2f} ms; kernels beside comm run "
             + (f"{100 * result['slowdown']:+.1f}% ({per('slowdown_ms'):+.2f} ms)"
                if result["slowdown"] is not None else "n/a")]
    lines.append("  idle by tenth of the span (ms): "
                 + " ".join(f"{t / iters:.2f}" for t in result["idle_by_tenth_ms"]))
    for g in result["gaps"]:
        lines.append(f"  gap {g['gap_ms']:.3f} ms at {g['at_ms']:.2f} (comm {g['comm_ms']:.3f}):"
                     f" {g['after']} -> {g['before']}")
    for c in result.get("comm", []):
        launch = ("launch call not in the trace" if c["launch_ms"] is None else
                  f"launched at {c['launch_ms']:.2f} by thread {c['tid']}")
        lines.append(f"  {c['name']}: {launch}, ran {c['start_ms']:.2f} + {c['dur_ms']:.2f} ms,"
                     f" link idle {c['idle_before_ms']:.2f} ms before")
    idle = result.get("idle")
    if idle is not None:
        lines.append(f"  idle: host late {idle['host_late_ms'] / iters:.2f} ms, dependency "
                     f"{idle['dependency_ms'] / iters:.2f} ms, unknown "
                     f"{idle['unknown_ms'] / iters:.2f} ms per iteration")
        for kind in ("host_late", "dependency"):
            for s in idle[kind]:
                by = f" (thread {s['tid']})" if s["tid"] is not None else ""
                lines.append(f"    {kind.replace('_', ' ')} {s['ms']:.3f} ms at "
                             f"{s['at_ms']:.2f}{by} -> {s['next']}")
    lines += python_lines(result.get("python", []))
    for t in result.get("host", []):
        lines.append(f"  host thread {t['tid']}: {t['calls']:.0f} CUDA calls ({t['ms']:.2f} ms): "
                     + ", ".join(f"{name} {n:.0f}" for name, n in t["top"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--iters", type=int, default=4,
                        help="iterations in each trace's window (BENCH_WINDOW)")
    parser.add_argument("--device", type=int, default=None,
                        help="GPU index in the trace (default: the one with most activity)")
    parser.add_argument("--gaps", type=int, default=6, help="longest compute gaps to list")
    parser.add_argument("--host", type=int, default=0, metavar="N",
                        help="per host thread, its CUDA calls per iteration and its N most "
                             "frequent ones (0: off)")
    parser.add_argument("--comm", action="store_true",
                        help="every NCCL kernel: launched when and by which host thread, "
                             "started when, and the link's idle time before it")
    parser.add_argument("--idle", action="store_true",
                        help="split the GPU's idle time into waiting for the host and "
                             "waiting for a dependency, with the longest stretches of each")
    parser.add_argument("--python", type=int, default=0, metavar="N",
                        help="per host thread, its N Python functions with the most self time "
                             "per iteration (a trace with Python stacks: BENCH_PROFILE_STACKS=1; "
                             "0: off)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if args.host < 0:
        parser.error("--host must be >= 0")
    if args.python < 0:
        parser.error("--python must be >= 0")
    results = {}
    for path in args.traces:
        complete = load_complete(path)
        events, calls = split_trace(complete)
        if not events:
            print(f"{path}: no GPU activity in the trace", file=sys.stderr)
            if args.python:     # a CPU run's trace: its Python time alone
                results[path] = {"python": python_self_time(complete, args.iters,
                                                            args.python)}
                print("\n".join([f"{path}: per iteration (window of {args.iters})"]
                                + python_lines(results[path]["python"])))
            continue
        device = args.device
        if device is None:
            count: Dict[int, int] = defaultdict(int)
            for e in events:
                count[e.get("args", {}).get("device", 0)] += 1
            device = max(count, key=count.get)
        results[path] = analyse(events, device, args.gaps)
        if args.host:
            results[path]["host"] = host_calls(calls, args.iters, args.host)
        if args.comm:
            results[path]["comm"] = comm_timeline(events, calls, device)
        if args.idle:
            results[path]["idle"] = idle_causes(events, calls, device, args.gaps)
        if args.python:
            results[path]["python"] = python_self_time(complete, args.iters, args.python)
        print(report(path, results[path], args.iters))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
