"""``commsched floor``: how close a DDP training script's step is to the overlap floor.

    commsched floor [--iters N] [--warmup W] [--profile-iters P] [--trace-dir DIR]
        [--save RUN_DIR] [--json] --nproc-per-node 2 train.py --lr 3e-4

Everything after commsched's own options is torchrun's command line. Four launches under
torchrun, three of them the script, each timed over N iterations (optimizer steps) after
W, and stopped there (``floor_worker.py``):

    compute only    every DistributedDataParallel forward runs inside ``no_sync()``: no
                    gradient collective (the first warm-up iteration excepted, so that DDP
                    settles its buckets); the compute floor
    comm only       the first launch's bucket layout (sizes, dtypes, DDP's bucket order),
                    all-reduced by itself, no script: the communication floor
    both at once    compute only, with comm only's all-reduces issued at the start of each
                    iteration beside it (nothing orders them after the backward), waited
                    for before the optimizer step: what the two cost each other here. Not
                    a floor for a mode that runs communication beside the next forward
    hook            the script with the commsched DDP hook

The floor is max(compute only, comm only): a step cannot be shorter than its compute nor
than its communication, however well one hides the other. Efficiency is floor / step time
(``floor_efficiency``, the arithmetic the report and the benchmark harness use too).

On CUDA each launch then records P more iterations (``--profile-iters``, default 3; 0:
none) with torch.profiler, and the hook's step above compute only is split by cause, per
iteration (``commsched.telemetry.step_split``). The split is of the timed step: the parts
add up to the timed hook step less the timed compute only (the two figures printed above
it). The device parts (exposed, tail, slowed, own work: kernel times) are read from the
profiled windows; host is read there too, under the profiler, which slows the host, and
rest is the remainder. A part is negative where the hook's step runs less of it than
compute only does:

    exposed         communication with no compute running beside it; lowered by hiding
                    it: a better order, smaller first buckets, bfloat16 all-reduces
      tail          of it, what runs after the backward's last kernel: no order within
                    the iteration hides it; fewer bytes, faster links, or a mode that
                    runs it beside the next forward (the data-parallel mode) lower it
    slowed          compute kernels beside communication, each against its own duration
                    in compute only: the two share SMs and memory; fewer bytes, or NCCL
                    with fewer channels, lower it
    own work        kernel time beyond compute only's by name and count (bucket copies,
                    casts, extra launches): what the hook adds on the device
    host            the device idle waiting for the host beyond compute only's, read
                    under the profiler; a larger batch, fewer launches (fused optimizers,
                    CUDA graphs) lower it
    rest            the remainder: idle waiting for a dependency, what the trace cannot
                    attribute, and the timed steps' host time less the windows'

The both-at-once launch's compute kernels and collectives are set against compute only's
and comm only's the same way. A part that cannot be measured (a CPU run, a script that
runs its own profiler) is printed as not measured, never as 0. ``--trace-dir DIR`` keeps
each launch's trace (``DIR/<launch>-rank<r>.json.gz``, for ui.perfetto.dev).

The launches are measurements: no telemetry is recorded and nothing is saved from them
(``--save RUN_DIR`` keeps the result, as ``RUN_DIR/floor.json``, for ``commsched report``).
The script runs in the working directory it is given, with its arguments, as a normal
run would: it reads its inputs and writes its outputs as a run of it stopped inside its
optimizer step number W+N (W+N+P on CUDA) does, three times over (files it rewrites hold
the hook launch's last write; files it appends to, three runs' worth).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .config import ConfigError
from .errors import CommschedError

__all__ = ["FLOOR_FILE", "FloorError", "floor_efficiency", "verdict", "load_floor",
           "save_floor", "main"]

PROG = "commsched floor"
FLOOR_FILE = "floor.json"
SCHEMA = "commsched.floor/1"
# launch order: comm and both replay compute's layout
MODES = ("compute", "comm", "both", "hook")
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
DEFAULT_PROFILE_ITERS = 3
# Efficiency at or above this: the step is at its floor, within timing noise.
AT_FLOOR = 0.97


class FloorError(CommschedError, RuntimeError):
    """One of the floor's launches failed; the message holds the end of its output."""


def floor_efficiency(compute_ms: float, comm_ms: float,
                     step_ms: Optional[float] = None) -> Dict[str, object]:
    """The overlap floor of a step and how close ``step_ms`` comes to it.

    ``floor_ms = max(compute_ms, comm_ms)``: a step takes at least its compute and at
    least its communication, however well one hides the other. ``limited_by`` names the
    larger ("compute_only" or "comm_only"); ``efficiency = floor_ms / step_ms`` (None
    without a step time): 1.0 is a step at its floor, 0.8 one that could be 20% shorter.

    Example::

        floor_efficiency(133.1, 126.3, 162.7)
        # {'floor_ms': 133.1, 'limited_by': 'compute_only', 'efficiency': 0.818...}
    """
    floor_ms = max(compute_ms, comm_ms)
    return {"floor_ms": floor_ms,
            "limited_by": "compute_only" if compute_ms >= comm_ms else "comm_only",
            "efficiency": floor_ms / step_ms if step_ms else None}


def verdict(compute_ms: float, comm_ms: float, step_ms: float) -> str:
    """One line: how much any scheduler could win on this step."""
    f = floor_efficiency(compute_ms, comm_ms, step_ms)
    room = step_ms - f["floor_ms"]
    bound = ("compute" if f["limited_by"] == "compute_only" else "communication")
    if f["efficiency"] >= AT_FLOOR:
        return (f"at the floor ({100 * f['efficiency']:.0f}% efficient): no communication "
                f"scheduler can make this step much shorter; it is {bound}-bound")
    text = (f"{100 * f['efficiency']:.0f}% efficient: any communication scheduler could win "
            f"at most {room:.2f} ms per iteration ({100 * room / step_ms:.0f}% of the step)")
    if f["limited_by"] == "comm_only":
        text += ("; the floor is the communication itself: only fewer bytes (bfloat16 "
                 "gradients) or faster links lower it")
    return text


# --- the result file -----------------------------------------------------------------------

def save_floor(run_dir: str, result: Dict[str, object]) -> str:
    """Write ``result`` (compute_only_ms, comm_only_ms, source, ...) to
    ``run_dir/floor.json``, completed with the floor; returns the path."""
    doc = {"schema": SCHEMA, **result}
    doc.update({k: v for k, v in floor_efficiency(
        float(doc["compute_only_ms"]), float(doc["comm_only_ms"])).items()
        if k != "efficiency"})
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, FLOOR_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_floor(run_dir: str) -> Tuple[Optional[Dict[str, object]], str]:
    """The floor result kept with a telemetry run: ``floor.json`` in ``run_dir``, else in
    its parent (a launch's own subdirectory of a run directory). Returns (result or None,
    a note saying where it came from or why it was not used)."""
    for directory in (run_dir, os.path.dirname(os.path.abspath(run_dir))):
        path = os.path.join(directory, FLOOR_FILE)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            return None, f"{path} not used: {type(exc).__name__}: {exc}"
        problem = _floor_problem(doc)
        if problem:
            return None, f"{path} not used: {problem}"
        compute, comm = float(doc["compute_only_ms"]), float(doc["comm_only_ms"])
        doc.update(floor_efficiency(compute, comm))
        doc.pop("efficiency", None)
        return doc, f"{path} ({doc.get('source', 'unknown source')})"
    return None, "no floor.json (commsched floor --save RUN_DIR, or the harness's " \
                 "--telemetry-root, writes one)"


def _floor_problem(doc) -> Optional[str]:
    """Why ``doc`` is not a usable floor result (None where it is): a JSON object of this
    schema whose compute time is a finite number > 0 and comm time a finite number >= 0."""
    if not isinstance(doc, dict):
        return f"holds a JSON {type(doc).__name__}, not a {SCHEMA} object"
    if doc.get("schema") != SCHEMA:
        return f"schema {doc.get('schema')!r}, not {SCHEMA}"
    for key, low in (("compute_only_ms", "> 0"), ("comm_only_ms", ">= 0")):
        value = doc.get(key)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0 or (value == 0 and low == "> 0")):
            return f"{key}={value!r}: expected a finite number {low} (ms)"
    return None


def check_save_dir(run_dir: str) -> None:
    """Refuse, before any launch, a ``--save`` directory that could not be written: one
    that is a file, or whose nearest existing ancestor is not a writable directory."""
    path = os.path.abspath(run_dir)
    target = os.path.join(path, FLOOR_FILE)
    if os.path.isdir(target):
        raise ConfigError(f"--save {run_dir!r}: {target} is a directory")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"--save {run_dir!r}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {run_dir!r}: {probe} is not writable")


# --- the command ---------------------------------------------------------------------------

USAGE = (f"usage: {PROG} [--iters N] [--warmup W] [--profile-iters P] [--trace-dir DIR] "
         "[--save RUN_DIR] [--json] [--timeout S] TORCHRUN_ARGS... SCRIPT [ARGS...]")

_OWN = {"--iters": int, "--warmup": int, "--save": str, "--timeout": float,
        "--profile-iters": int, "--trace-dir": str}


def _split(argv: List[str]) -> Tuple[Dict[str, object], List[str]]:
    """commsched floor's own options (leading), and torchrun's command line (the rest)."""
    own: Dict[str, object] = {"iters": DEFAULT_ITERS, "warmup": DEFAULT_WARMUP,
                              "save": None, "timeout": 900.0, "json": False,
                              "profile_iters": DEFAULT_PROFILE_ITERS, "trace_dir": None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if arg == "--json":
            own["json"] = True
        elif name in _OWN:
            if inline:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ConfigError(f"{name} needs a value")
            try:
                own[name[2:].replace("-", "_")] = _OWN[name](value)
            except ValueError:
                raise ConfigError(f"{name} {value!r}: expected a number") from None
        else:
            break
        i += 1
    if own["iters"] < 1 or own["warmup"] < 1:
        raise ConfigError("--iters and --warmup must be at least 1 (the first warm-up "
                          "iteration is where DDP settles its buckets)")
    if own["profile_iters"] < 0:
        raise ConfigError(f"--profile-iters {own['profile_iters']}: must be 0 (no profiled "
                          "window) or more")
    return own, argv[i:]


def _torchrun_parts(launch: List[str]) -> Tuple[List[str], List[str]]:
    """torchrun's own options, and the target (``SCRIPT ARGS`` or ``-m MODULE ARGS``), read
    with torchrun's parser."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    try:
        args = parser.parse_args(launch)
    except SystemExit:
        raise ConfigError(f"not a torchrun command line: {' '.join(launch)!r}") from None
    if args.no_python:
        raise ConfigError("--no-python is not supported: the script must be Python")
    tail = [args.training_script, *args.training_script_args]
    options = launch[:len(launch) - len(tail)]
    options = [o for o in options if o not in ("-m", "--module")]
    if args.module:
        return options, ["-m", *tail]
    if not os.path.isfile(args.training_script):
        raise ConfigError(f"SCRIPT {args.training_script!r} is not a file")
    return options, tail


def _launch(mode: str, options: List[str], target: List[str], own: Dict[str, object],
            scratch: str) -> Tuple[int, str]:
    """One torchrun launch of the script in ``mode``; (exit status, its output)."""
    env = {k: v for k, v in os.environ.items() if k != "COMMSCHED_TELEMETRY_DIR"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *options,
           "-m", "commsched.floor_worker", "--mode", mode, "--iters", str(own["iters"]),
           "--warmup", str(own["warmup"]), "--results", scratch,
           "--profile-iters", str(own["profile_iters"]),
           *(["--trace-dir", os.path.abspath(str(own["trace_dir"]))] if own["trace_dir"]
             else []), "--", *target]
    log = os.path.join(scratch, f"{mode}.log")
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=float(own["timeout"]))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    with open(log) as f:
        return code, f.read()


def _read_results(scratch: str, mode: str) -> List[dict]:
    out = []
    for name in sorted(os.listdir(scratch)):
        if name.startswith(f"{mode}-rank") and name.endswith(".json"):
            with open(os.path.join(scratch, name)) as f:
                out.append(json.load(f))
    return out


def measure(own: Dict[str, object], options: List[str], target: List[str]) -> Dict[str, object]:
    """Run the three launches; the result (raises ``FloorError`` naming a failed one)."""
    scratch = tempfile.mkdtemp(prefix="commsched-floor-")
    if own.get("trace_dir"):
        os.makedirs(str(own["trace_dir"]), exist_ok=True)
    try:
        per_mode: Dict[str, List[dict]] = {}
        for mode in MODES:
            code, output = _launch(mode, options, target, own, scratch)
            results = _read_results(scratch, mode)
            errors = [r["error"] for r in results if r.get("error")]
            if code != 0 or errors or not results:
                why = errors[0] if errors else (
                    f"timed out after {own['timeout']:.0f} s" if code == 124
                    else f"no rank reported a result (exit status {code})")
                tail = "\n".join(output.strip().splitlines()[-30:])
                raise FloorError(f"the {mode} launch failed: {why}\n--- its output "
                                 f"(last lines) ---\n{tail}")
            per_mode[mode] = results
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summarize(per_mode, own, target)


def summarize(per_mode: Dict[str, List[dict]], own: Dict[str, object],
              target: Sequence[str]) -> Dict[str, object]:
    """The command's result from each launch's per-rank results: per launch the slowest
    rank's mean time per iteration (the ranks of a data-parallel step wait for the
    slowest), then the floor and the efficiency."""
    times = {mode: max(r["ms_per_iteration"] for r in rs) for mode, rs in per_mode.items()}
    first = per_mode["compute"][0]
    result: Dict[str, object] = {
        "source": "commsched floor", "target": list(target), "iters": own["iters"],
        "warmup": own["warmup"], "ranks": len(per_mode["compute"]),
        "backend": first.get("backend"), "device": first.get("device_name"),
        "compute_only_ms": times["compute"], "comm_only_ms": times["comm"],
        "hook_ms": times["hook"],
        "buckets": first.get("layout", []),
        "collectives": {m: max(r["collectives"] for r in rs) if all(
            r["collectives"] is not None for r in rs) else None
            for m, rs in per_mode.items()},
        "backwards": {m: max(r["backwards"] for r in rs) for m, rs in per_mode.items()},
        "per_rank_ms": {m: [r["ms_per_iteration"] for r in rs] for m, rs in per_mode.items()},
    }
    if "both" in times:
        result["both_ms"] = times["both"]
    result.update(floor_efficiency(times["compute"], times["comm"], times["hook"]))
    result["verdict"] = verdict(times["compute"], times["comm"], times["hook"])
    result.update(step_parts(per_mode))
    if result["split"].get("exposed_ms") is not None:
        # the split bounds what an order can win more tightly than the floor does
        result["verdict"] += f"; {result['split_verdict']}"
    return result


def step_parts(per_mode: Dict[str, List[dict]]) -> Dict[str, object]:
    """The hook step's split by cause (``telemetry.step_split``) and what compute and
    communication cost each other in the both-at-once launch, from the profiled windows
    of the rank whose hook step was slowest; parts without a window are not measured."""
    from .telemetry.step_split import both_at_once, not_measured, split, verdict_line

    hook = per_mode["hook"]
    rank = max(hook, key=lambda r: r["ms_per_iteration"]).get("rank", 0)

    def window(mode: str) -> Tuple[Optional[dict], Optional[str]]:
        if mode not in per_mode:
            return None, f"not measured: no {mode} launch"
        rs = [r for r in per_mode[mode] if r.get("rank", 0) == rank]
        if not rs:
            return None, f"not measured: the {mode} launch has no result of rank {rank}"
        if rs[0].get("window"):
            return rs[0]["window"], None
        return None, rs[0].get("window_not_measured") or (
            f"not measured: the {mode} launch's result holds no window and no reason")

    (w_hook, why_hook), (w_compute, why_compute) = window("hook"), window("compute")
    (w_both, why_both), (w_comm, why_comm) = window("both"), window("comm")
    # the split is of the step the command timed and prints: the hook's time less compute
    # only's (each the slowest rank's); the windows give its device parts
    timed_above = (max(r["ms_per_iteration"] for r in hook)
                   - max(r["ms_per_iteration"] for r in per_mode["compute"]))
    if w_hook is not None and w_compute is not None:
        parts = split(w_hook, w_compute, timed_above_ms=timed_above)
    else:
        parts = not_measured(_missing(("hook", w_hook, why_hook),
                                      ("compute only", w_compute, why_compute)), timed_above)
    if w_both is not None and w_compute is not None:
        both = both_at_once(w_both, w_compute, w_comm, why_comm)
    else:
        both = {"compute_slowed_ms": None, "compute_slowed": None, "comm_slowed_ms": None,
                "comm_slowed": None,
                "not_measured": _missing(("both at once", w_both, why_both),
                                         ("compute only", w_compute, why_compute))}
    return {"split": parts, "split_rank": rank, "both_at_once": both,
            "split_verdict": verdict_line(parts)}


def _missing(*launches: Tuple[str, Optional[dict], Optional[str]]) -> str:
    """Why a figure that needs every one of ``launches`` (name, window, reason) was not
    measured: the one reason where every window is missing for it (a CPU run), else each
    missing window's reason, named by its launch."""
    missing = [(name, why) for name, w, why in launches if w is None]
    if len(missing) == len(launches) and len({why for _, why in missing}) == 1:
        return str(missing[0][1])
    return "; ".join(f"the {name} window: {why}" for name, why in missing)


def format_result(r: Dict[str, object]) -> str:
    buckets = r["buckets"]
    total = sum(b["bytes"] for b in buckets)
    dtypes = ", ".join(sorted({b["dtype"] for b in buckets}))
    lines = [
        f"{PROG}: {' '.join(r['target'])}: {r['ranks']} ranks ({r['backend']}"
        + (f", {r['device']}" if r["device"] else "") + f"), {r['iters']} iterations after "
        f"{r['warmup']}, ms per iteration (slowest rank)",
        f"  compute only   {r['compute_only_ms']:9.2f}   DDP forward and backward in no_sync: "
        f"no gradient collective",
        f"  comm only      {r['comm_only_ms']:9.2f}   {len(buckets)} buckets, "
        f"{total / 2**20:.2f} MiB {dtypes}, all-reduced alone",
        f"  floor          {r['floor_ms']:9.2f}   max of the two "
        f"({r['limited_by'].replace('_', ' ')})",
        f"  commsched hook {r['hook_ms']:9.2f}   the script with the commsched DDP hook",
        f"  efficiency     {100 * r['efficiency']:8.1f}%   floor / hook",
    ]
    if "both_ms" in r:
        lines[4:4] = [f"  both at once   {r['both_ms']:9.2f}   compute only, comm only's "
                      f"all-reduces beside it"]
        lines += _both_lines(r.get("both_at_once") or {})
    if r.get("split"):
        lines += _split_lines(r)
    lines.append(f"verdict: {r['verdict']}")
    return "\n".join(lines)


def _both_lines(b: Dict[str, object]) -> List[str]:
    def part(key: str, what: str) -> str:
        if b.get(key + "_ms") is None:
            return f"{what} not measured"
        pct = (f" ({100 * b[key]:+.1f}%)" if b.get(key) is not None else "")
        return f"{what} {b[key + '_ms']:+.2f} ms{pct}"
    line = ("both at once, against running alone: "
            + part("compute_slowed", "compute kernels") + ", "
            + part("comm_slowed", "collectives"))
    if b.get("not_measured"):
        line += f" ({b['not_measured']})"
    return [line]


def _split_lines(r: Dict[str, object]) -> List[str]:
    from .telemetry.step_split import PARTS, format_split

    s = r["split"]
    head = (f"the hook's step above compute only, by cause: {s['above_ms']:.2f} ms per "
            f"iteration (timed)")
    if s.get("step_window_ms") is not None:
        head += (f"; device parts from the profiled windows (rank {r.get('split_rank', 0)}: "
                 f"{s['step_window_ms']:.2f} - {s['compute_window_ms']:.2f} = "
                 f"{s['window_above_ms']:.2f} there), host read under the profiler, rest "
                 f"the remainder")
    reasons = set((s.get("not_measured") or {}).values())
    if all(s.get(k) is None for k in PARTS) and len(reasons) == 1:
        return [f"{head}; its parts {reasons.pop()}"]
    lines = [head, *format_split(s)]
    if s.get("own_by_name"):
        lines.append("  own work, largest: " + "; ".join(
            f"{o['ms']:+.2f} {o['name']}" for o in s["own_by_name"][:3]))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        print(__doc__.split("\n\n", 2)[2] if argv else "", file=sys.stdout)
        return 0 if argv else 2
    try:
        own, launch = _split(argv)
        if not launch:
            raise ConfigError("no torchrun command line (e.g. --nproc-per-node 2 train.py)")
        options, target = _torchrun_parts(launch)
        if own["save"]:
            check_save_dir(str(own["save"]))
    except ValueError as exc:
        print(f"{PROG}: error: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        result = measure(own, options, target)
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    save_error = None
    if own["save"]:
        try:
            result["saved_to"] = save_floor(str(own["save"]), result)
        except OSError as exc:      # (the measurement is printed all the same)
            save_error = f"--save {own['save']!r}: not saved: {exc}"
    if own["json"]:
        json.dump(result, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(format_result(result))
        if result.get("saved_to"):
            print(f"saved to {result['saved_to']} (commsched report reads it)")
    if save_error:
        print(f"{PROG}: error: {save_error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
