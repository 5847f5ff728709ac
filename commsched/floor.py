"""``commsched floor``: how close a DDP training script's step is to the overlap floor.

    commsched floor [--iters N] [--warmup W] [--save RUN_DIR] [--json] \\
        --nproc-per-node 2 train.py --lr 3e-4

Everything after commsched's own options is torchrun's command line. The script runs
three times under torchrun, each launch timed over N iterations (optimizer steps) after W,
and stopped there (``floor_worker.py``):

    compute only    every DistributedDataParallel forward runs inside ``no_sync()``: no
                    gradient collective (the first warm-up iteration excepted, so that DDP
                    settles its buckets); the compute floor
    comm only       the first launch's bucket layout (sizes, dtypes, DDP's bucket order),
                    all-reduced by itself, no script: the communication floor
    hook            the script with the commsched DDP hook

The floor is max(compute only, comm only): a step cannot be shorter than its compute nor
than its communication, however well one hides the other. Efficiency is floor / step time
(``floor_efficiency``, the arithmetic the report and the benchmark harness use too).

The launches are measurements: no telemetry is recorded and nothing is saved from them
(``--save RUN_DIR`` keeps the result, as ``RUN_DIR/floor.json``, for ``commsched report``).
The script runs in the working directory it is given, with its arguments, as a normal
run would: it reads its inputs and writes its outputs as a run of it stopped inside its
optimizer step number W+N does, three times over (files it rewrites hold the hook launch's
last write; files it appends to, three runs' worth).
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
MODES = ("compute", "comm", "hook")          # launch order: comm replays compute's layout
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
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

USAGE = (f"usage: {PROG} [--iters N] [--warmup W] [--save RUN_DIR] [--json] "
         "[--timeout S] TORCHRUN_ARGS... SCRIPT [ARGS...]")

_OWN = {"--iters": int, "--warmup": int, "--save": str, "--timeout": float}


def _split(argv: List[str]) -> Tuple[Dict[str, object], List[str]]:
    """commsched floor's own options (leading), and torchrun's command line (the rest)."""
    own: Dict[str, object] = {"iters": DEFAULT_ITERS, "warmup": DEFAULT_WARMUP,
                              "save": None, "timeout": 900.0, "json": False}
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
                own[name[2:]] = _OWN[name](value)
            except ValueError:
                raise ConfigError(f"{name} {value!r}: expected a number") from None
        else:
            break
        i += 1
    if own["iters"] < 1 or own["warmup"] < 1:
        raise ConfigError("--iters and --warmup must be at least 1 (the first warm-up "
                          "iteration is where DDP settles its buckets)")
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
           "--warmup", str(own["warmup"]), "--results", scratch, "--", *target]
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
    result.update(floor_efficiency(times["compute"], times["comm"], times["hook"]))
    result["verdict"] = verdict(times["compute"], times["comm"], times["hook"])
    return result


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
        f"verdict: {r['verdict']}",
    ]
    return "\n".join(lines)


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
