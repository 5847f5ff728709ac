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

The figures are computed by ``commsched.telemetry.timeline`` (standard library only: it
runs where the traces were taken); this script reads the traces and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

try:
    from commsched.telemetry import timeline
except ImportError:     # a checkout without the package installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from commsched.telemetry import timeline

# One implementation: the figures come from the package (commsched.telemetry.timeline).
load_complete, split_trace, load_trace = (timeline.load_complete, timeline.split_trace,
                                          timeline.load_trace)
load_events, host_calls, python_self_time = (timeline.load_events, timeline.host_calls,
                                             timeline.python_self_time)
comm_timeline, idle_causes, analyse = (timeline.comm_timeline, timeline.idle_causes,
                                       timeline.overlap)


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
        device = timeline.busiest_device(events) if args.device is None else args.device
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
