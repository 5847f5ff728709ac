"""Where a step's time above compute only goes, from two profiled windows of device time.

A window is a few training steps recorded with torch.profiler (CUDA activity only;
``window.ProfiledWindow`` records one) with a marker kernel on the training stream at the
end of each backward (after its last kernel) and at the end of each optimizer step.
``window_figures()`` reads one per iteration; ``split()`` sets a step's window against the
compute-only window of the same script and splits the step's time above compute only,
``above_ms``, into parts that add up to it exactly. ``above_ms`` is the **timed** step less
the timed compute only wherever the caller timed them (``timed_above_ms``: what a user
reads as the step's cost); only a caller with windows alone gets the difference of the
windows' device spans, which is kept as ``window_above_ms`` in any case. The windows run
under the profiler, whose per-launch work slows the host: their idle waiting for the host
differs from the timed steps' by milliseconds, and from one window to the next by noise,
so their span difference is not the timed one. The parts:

exposed_ms
    communication exposed: an NCCL kernel runs and no compute activity does.
    **tail_ms**, of it: the exposed communication between the backward's last kernel and
    the end of the optimizer step, which no order of the collectives within the iteration
    hides (only fewer or faster bytes, or a mode that runs it beside the next forward).
slowed_ms
    compute slowed beside communication: the instances of each compute activity (name and
    launch shape) that the compute-only window also runs (the fewer of the two counts per
    iteration), their time against their mean duration there. Kernels share the device
    with NCCL's.
own_ms
    own device work: kernel time beyond compute only's by name, launch shape and count
    (copies into and out of buckets, casts, extra launches); negative where the step runs
    fewer.
host_ms
    the device idle waiting for the host, beyond compute only's: a stretch where nothing
    ran and the launch call of the next activity had not returned. Read in the windows,
    **under the profiler**: the host is slower there than in the timed steps.
rest_ms
    the remainder, ``above - exposed - slowed - own - host``: idle waiting for a
    dependency (a stream waiting for an event), idle the trace cannot attribute, compute
    activities overlapping each other (on several streams) differently from compute only,
    and, where ``above_ms`` is timed, the timed steps' host time less the windows'.

The device parts (exposed, tail, slowed, own) are kernel times, which the profiler's host
overhead does not change: they hold for the timed steps too. A part is negative where
the step runs less of it than compute only does.

A part that cannot be measured (no CUDA timing, a script that runs its own profiler, a
window without its markers) is ``None`` with the reason in ``not_measured``: never 0.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .errors import TelemetryError
from .timeline import (busiest_device, covered, device_events, idle_causes, is_comm, length,
                       union)

__all__ = ["MARKER", "PARTS", "window_figures", "split", "not_measured", "both_at_once",
           "from_telemetry", "verdict_line", "format_split"]

# The marker kernel: torch.cuda._sleep(0), a kernel no training step launches otherwise.
MARKER = "spin_kernel"
PARTS = ("exposed_ms", "tail_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms")
LABELS = {"exposed_ms": ("exposed", "communication with no compute running beside it"),
          "tail_ms": ("  tail", "of it, after the backward's last kernel"),
          "slowed_ms": ("slowed", "compute kernels beside communication, against compute only"),
          "own_ms": ("own work", "kernel time beyond compute only's: copies, casts, launches"),
          "host_ms": ("host", "device idle waiting for the host, beyond compute only's, "
                              "read under the profiler"),
          "rest_ms": ("rest", "the remainder: idle waiting for a dependency, streams "
                              "overlapping, the timed steps' host less the windows'")}
# A negative part: the step ran less of it than compute only did.
BELOW = {"slowed_ms": "faster than in compute only", "own_ms": "less than compute only",
         "host_ms": "less than compute only", "rest_ms": "less than compute only"}

Interval = Tuple[float, float]


def _subtract(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """The parts of the disjoint sorted intervals ``a`` outside the disjoint sorted ``b``."""
    out: List[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _key(event: dict) -> str:
    """An activity's kind: its name, and its launch shape where the trace has it (grid and
    block of a kernel, bytes of a copy or memset). One templated kernel name runs on
    tensors of every size (an element-wise copy); by shape, the instances of one kind do
    about the same work, so a step's extra instances are not costed at the name's mean."""
    args = event.get("args") or {}
    shape = [f"{k} {args[k]}" for k in ("grid", "block", "bytes") if k in args]
    name = event["name"]
    return f"{name} [{', '.join(shape)}]" if shape else name


def _short(key: str, width: int = 120) -> str:
    if len(key) <= width:
        return key
    name, bracket, shape = key.partition(" [")
    tail = bracket + shape
    return name[:max(20, width - len(tail) - 3)] + "..." + tail


def _by_name(events: List[dict], iters: int) -> Dict[str, List[float]]:
    """Activity kind (``_key``) -> [instances per iteration, ms per iteration]."""
    totals: Dict[str, List[float]] = {}
    for e in events:
        entry = totals.setdefault(_key(e), [0, 0.0])
        entry[0] += 1
        entry[1] += float(e["dur"])
    # (counts summed whole, then divided: equal counts compare equal)
    return {key: [n / iters, us / 1e3 / iters] for key, (n, us) in totals.items()}


def window_figures(events: List[dict], calls: List[dict], iters: int,
                   device: Optional[int] = None) -> Dict[str, object]:
    """Per-iteration figures of a window of ``iters`` steps: its GPU activities and the host
    calls that launched them (``timeline.split_trace``), on ``device`` (default: the busiest).
    Times in ms per iteration; ``tail_ms`` is None (``tail_note`` says why) unless the window
    holds the markers, a backward end and a step end for each iteration."""
    if iters < 1:
        raise TelemetryError(f"window_figures: iters must be at least 1, not {iters}")
    device = busiest_device(events) if device is None else device
    events = device_events(events, device)
    marks = sorted(float(e["ts"]) for e in events if MARKER in e["name"])
    acts = [e for e in events if MARKER not in e["name"]]
    if not acts:
        raise TelemetryError(f"window_figures: no GPU activity for device {device} besides "
                             f"the markers")
    iv = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    comm = [e for e in acts if is_comm(e)]
    compute = [e for e in acts if not is_comm(e)]
    comm_u, compute_u = union([iv(e) for e in comm]), union([iv(e) for e in compute])
    all_u = union([iv(e) for e in acts])
    exposed_u = _subtract(comm_u, compute_u)
    span = all_u[-1][1] - all_u[0][0]
    causes = idle_causes(acts, calls, device, top=0)
    tail, note = None, None
    if len(marks) == 2 * iters:
        starts = [s for s, _ in exposed_u]
        tail = sum(covered(marks[2 * i], marks[2 * i + 1], exposed_u, starts)
                   for i in range(iters)) / 1e3 / iters
    else:
        note = (f"not measured: the window holds {len(marks)} markers, not {2 * iters} "
                f"(a backward end and a step end per iteration; several backwards per "
                f"optimizer step, as gradient accumulation runs, give more)")
    per = 1e3 * iters
    return {
        "iters": iters, "device": device,
        "span_ms": span / per, "compute_ms": length(compute_u) / per,
        "compute_sum_ms": sum(float(e["dur"]) for e in compute) / per,
        "comm_ms": length(comm_u) / per, "exposed_ms": length(exposed_u) / per,
        "tail_ms": tail, "tail_note": note,
        "idle_ms": (span - length(all_u)) / per,
        "host_late_ms": causes["host_late_ms"] / iters,
        "dependency_ms": causes["dependency_ms"] / iters,
        "unknown_ms": causes["unknown_ms"] / iters,
        "kernels": _by_name(compute, iters), "collectives": _by_name(comm, iters),
    }


def _change(step: Dict[str, List[float]], base: Dict[str, List[float]]
            ) -> Tuple[float, float, float, List[Tuple[str, float]]]:
    """Kernel time of ``step`` against ``base`` by name and count (per iteration): (the
    matched instances' change, their time in ``base``, the time of the instances beyond
    ``base``'s count less those short of it, the largest of the latter by name)."""
    matched = matched_base = extra = 0.0
    by_name = []
    for name in set(step) | set(base):
        n_s, ms_s = step.get(name, (0.0, 0.0))
        n_b, ms_b = base.get(name, (0.0, 0.0))
        mean_s = ms_s / n_s if n_s else 0.0
        mean_b = ms_b / n_b if n_b else 0.0
        m = min(n_s, n_b)
        matched += m * (mean_s - mean_b)
        matched_base += m * mean_b
        own = (n_s - m) * mean_s - (n_b - m) * mean_b
        extra += own
        if own:
            by_name.append((name, own))
    by_name.sort(key=lambda kv: -abs(kv[1]))
    return matched, matched_base, extra, by_name


def not_measured(reason: str, above_ms: Optional[float] = None) -> Dict[str, object]:
    """A split none of whose parts could be measured, and why (``above_ms``: the step
    above compute only where it was timed)."""
    return {"above_ms": above_ms, "window_above_ms": None, **{p: None for p in PARTS},
            "not_measured": {p: reason for p in PARTS}}


def split(step: Dict[str, object], compute: Dict[str, object], top: int = 6,
          timed_above_ms: Optional[float] = None) -> Dict[str, object]:
    """The step's window (``window_figures``) against compute only's, ms per iteration.

    ``above_ms`` is ``timed_above_ms`` (the timed step less the timed compute only) where
    given, else the difference of the windows' device spans; ``window_above_ms`` is that
    difference either way, and ``above_from`` says which one ``above_ms`` is ("timed" or
    "windows"). The parts (module docstring) add up to ``above_ms`` exactly,
    ``exposed + slowed + own + host + rest``, the tail within exposed; rest is the
    remainder, so a timed above changes rest and nothing else."""
    window_above = float(step["span_ms"]) - float(compute["span_ms"])
    if timed_above_ms is None:
        above = window_above
    else:
        above = timed_above_ms
        if isinstance(above, bool) or not isinstance(above, (int, float)) \
                or not math.isfinite(above):
            raise TelemetryError(f"split: timed_above_ms must be a finite number of ms (the "
                                 f"timed step less the timed compute only), not {above!r}")
        above = float(above)
    slowed, _, own, own_by_name = _change(step["kernels"], compute["kernels"])
    exposed = float(step["exposed_ms"])
    host = float(step["host_late_ms"]) - float(compute["host_late_ms"])
    result: Dict[str, object] = {
        "step_window_ms": step["span_ms"], "compute_window_ms": compute["span_ms"],
        "above_ms": above, "window_above_ms": window_above,
        "above_from": "windows" if timed_above_ms is None else "timed",
        "exposed_ms": exposed, "tail_ms": step["tail_ms"],
        "slowed_ms": slowed, "own_ms": own, "host_ms": host,
        "rest_ms": above - exposed - slowed - own - host,
        "own_by_name": [{"name": _short(n), "ms": ms} for n, ms in own_by_name[:top]],
        "not_measured": {},
    }
    if step["tail_ms"] is None:
        result["not_measured"]["tail_ms"] = step["tail_note"]
    return result


TELEMETRY_REASON = ("not measured: telemetry times the collectives, not the compute "
                    "kernels (commsched floor --save RUN_DIR splits the step)")


def from_telemetry(iteration_ms: Optional[float], tail_ms: Optional[float],
                   compute_only_ms: Optional[float]) -> Dict[str, object]:
    """The parts a telemetry run's device timestamps give: the tail (communication after
    the device ended the backward: the report's ``exposed``) and, with a compute-only time
    (``floor.json``), the step above it; every other part needs the compute kernels'
    timing, which telemetry does not record."""
    above = (iteration_ms - compute_only_ms
             if iteration_ms is not None and compute_only_ms is not None else None)
    out = not_measured(TELEMETRY_REASON, above)
    if tail_ms is not None:
        out["tail_ms"] = tail_ms
        del out["not_measured"]["tail_ms"]
    return out


def both_at_once(both: Dict[str, object], compute: Dict[str, object],
                 comm: Optional[Dict[str, object]], comm_reason: Optional[str] = None
                 ) -> Dict[str, object]:
    """What compute and communication cost each other: the compute kernels of the
    both-at-once window against compute only's (matched by name and count), its NCCL
    kernels against comm only's; ms per iteration and the fraction of the time alone.
    Without comm only's window the collectives are not measured, ``not_measured`` saying
    why: ``comm_reason``, the cause the caller met (its window's own reason)."""
    slowed, base, _, _ = _change(both["kernels"], compute["kernels"])
    out: Dict[str, object] = {"compute_slowed_ms": slowed,
                              "compute_slowed": slowed / base if base else None,
                              "comm_slowed_ms": None, "comm_slowed": None,
                              "not_measured": None}
    if comm is not None:
        c_slowed, c_base, _, _ = _change(both["collectives"], comm["collectives"])
        out.update(comm_slowed_ms=c_slowed, comm_slowed=c_slowed / c_base if c_base else None)
    else:
        out["not_measured"] = ("the comm only window: "
                               + (comm_reason or "not measured: none was given"))
    return out


def _num(value: float, spec: str = ".1f") -> str:
    text = format(value, spec)
    if float(text) == 0:        # no "-0.0"
        text = text.replace("-", " " if text.startswith(" ") else "", 1)
    return text


def _part(split_: Dict[str, object], key: str, label: str) -> str:
    value = split_.get(key)
    if value is None:
        return f"{label} not measured"
    text = f"{_num(value)} {label}"
    return f"{text} ({BELOW[key]})" if _num(value).startswith("-") else text


def verdict_line(split_: Dict[str, object]) -> str:
    """One line: the parts of the step above compute only (host named as read under the
    profiler; a negative part noted as less than compute only's), and what a better order
    of the collectives could win at most (the exposed communication outside the tail)."""
    above = split_.get("above_ms")
    head = "of the step above compute" if above is None else f"of {_num(above)} ms above compute"
    exposed, tail = split_.get("exposed_ms"), split_.get("tail_ms")
    if exposed is None and tail is not None:
        first = f"{_num(tail)} the tail (the exposed communication before it not measured)"
    elif exposed is None:
        first = "exposed communication not measured"
    elif tail is None:
        first = f"{_num(exposed)} exposed (the tail not measured)"
    else:
        first = f"{_num(exposed)} exposed ({_num(tail)} of them the tail)"
    parts = [first, _part(split_, "slowed_ms", "compute slowed beside communication"),
             _part(split_, "own_ms", "own device work"),
             _part(split_, "host_ms", "host under the profiler"),
             _part(split_, "rest_ms", "rest")]
    if exposed is None or tail is None:
        win = "what a better order can win is not measured"
    else:
        win = (f"a better order can win at most the {_num(max(0.0, exposed - tail))} ms of "
               "exposed communication outside the tail")
    return f"{head}: {', '.join(parts)}; {win}"


def format_split(split_: Dict[str, object], indent: str = "  ") -> List[str]:
    """The split as table lines (label, ms per iteration, what it is); a part that was not
    measured says so, with the reason."""
    lines = []
    reasons = split_.get("not_measured") or {}
    for key in PARTS:
        label, text = LABELS[key]
        value = split_.get(key)
        if value is None:
            lines.append(f"{indent}{label:<15}{'n/m':>9}   "
                         f"{reasons.get(key) or 'not measured'}")
        else:
            lines.append(f"{indent}{label:<15}{_num(value, '9.2f')}   {text}")
    return lines
