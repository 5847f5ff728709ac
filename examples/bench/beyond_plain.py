"""What each mode of a harness run costs beyond the plain loop (no DDP, no commsched): step
time, memory and, from the profiled windows, device time per kernel.

    BENCH_PROFILE=prof BENCH_LOSSES=1 python examples/bench/harness.py --world-size 1 \\
        --modes plain,ddp_default,commsched_dp --out run.json
    python examples/bench/beyond_plain.py run.json --profile-dir prof --iters 1

Per model and mode: median ms/step and its ratio to ``plain``; the peak of allocated
memory and its ratio to plain's, the peak of reserved memory and the allocator's retries
(``num_alloc_retries``: allocations that freed the cache and tried again); and, with
``BENCH_LOSSES=1``, the largest difference between the mode's per-step losses and DDP's
(``ddp_default``; for ``commsched_dp_bf16``, DDP with ``bf16_compress_hook`` where it ran)
over the same steps. With ``--profile-dir``, per mode the kernels whose
device time per step differs from plain's by at least ``--min-ms``, by kernel name (the
traces' names shortened), NCCL kernels included: the profile table of a report. Each
trace holds one profiled window of ``--iters`` steps (the harness's ``BENCH_WINDOW``);
several rounds' traces of a mode are averaged. The short summary table comes last. The
traces of one harness launch must be in their own directory (their names do not carry the
model), one model per launch.

Standard library only: it runs where the traces were taken.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from trace_overlap import load_events

BASELINE = "plain"
LOSS_REFERENCE = "ddp_default"
# A mode whose gradients are all-reduced in bfloat16 is held against DDP doing the same.
LOSS_REFERENCES = {"commsched_dp_bf16": "ddp_bf16_hook"}


def short_name(name: str, width: int = 96) -> str:
    """A kernel's name without ``void``, namespaces and argument lists, cut to ``width``."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"\b(at::native::|at::|c10::|cutlass::|std::)", "", name)
    name = re.sub(r"\([^()]*\)$", "", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def kernel_ms(path: Path, iters: int) -> Dict[str, List[float]]:
    """Per kernel name in the trace: [ms per step, launches per step]."""
    out: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in load_events(str(path)):
        entry = out[e["name"] if e.get("cat") == "kernel" else e["cat"]]
        entry[0] += float(e["dur"]) / 1e3 / iters
        entry[1] += 1.0 / iters
    return dict(out)


def mode_traces(directory: Path) -> Dict[str, List[Path]]:
    """Rank 0's traces by mode: ``<regime>_<mode>_rank0[_rN].json.gz``."""
    by_mode: Dict[str, List[Path]] = defaultdict(list)
    for path in sorted(directory.glob("*_rank0*.json*")):
        m = re.match(r"^[^_]+_(.+)_rank0(?:_r\d+)?\.json(?:\.gz)?$", path.name)
        if m:
            by_mode[m.group(1)].append(path)
    return dict(by_mode)


def averaged(paths: List[Path], iters: int) -> Dict[str, List[float]]:
    tables = [kernel_ms(p, iters) for p in paths]
    names = set().union(*tables)
    return {n: [sum(t.get(n, [0.0, 0.0])[k] for t in tables) / len(tables) for k in (0, 1)]
            for n in names}


def profile_rows(directory: Path, iters: int, min_ms: float) -> Dict[str, List[dict]]:
    """Per mode, the kernels whose ms per step differ from plain's by ``min_ms`` or more,
    most first, and a total row."""
    traces = mode_traces(directory)
    if BASELINE not in traces:
        raise SystemExit(f"no {BASELINE} trace under {directory}")
    base = averaged(traces[BASELINE], iters)
    out = {}
    for mode, paths in traces.items():
        if mode == BASELINE:
            continue
        table = averaged(paths, iters)
        rows = []
        for name in set(table) | set(base):
            ms, n = table.get(name, [0.0, 0.0])
            ms0, n0 = base.get(name, [0.0, 0.0])
            rows.append({"kernel": name, "ms": ms, "launches": n, "plain_ms": ms0,
                         "plain_launches": n0, "beyond_ms": ms - ms0,
                         "nccl": name.startswith("nccl")})
        total = sum(r["beyond_ms"] for r in rows if not r["nccl"])
        nccl = sum(r["beyond_ms"] for r in rows if r["nccl"])
        rows = sorted((r for r in rows if abs(r["beyond_ms"]) >= min_ms),
                      key=lambda r: -r["beyond_ms"])
        out[mode] = rows + [{"kernel": "(all but NCCL)", "beyond_ms": total},
                            {"kernel": "(NCCL)", "beyond_ms": nccl}]
    return out


def summary_rows(document: dict) -> List[dict]:
    rows = []
    for launch in document["launches"]:
        for run in launch["runs"]:
            modes = run["modes"]
            base = modes.get(BASELINE) or {}
            for name, r in modes.items():
                if r.get("status") != "ok" or name.startswith(("floor", "comm_only")):
                    continue
                ref_name = LOSS_REFERENCES.get(name, LOSS_REFERENCE)
                if (modes.get(ref_name) or {}).get("status") != "ok":
                    ref_name = LOSS_REFERENCE
                ref = modes.get(ref_name) or {}
                rows.append({
                    "model": run["model"], "mode": name, "ms": r["median_ms"],
                    "x_plain": _ratio(r["median_ms"], base.get("median_ms")),
                    "peak_gib": _gib(r.get("peak_mem_bytes_max_rank")),
                    "peak_x_plain": _ratio(r.get("peak_mem_bytes_max_rank"),
                                           base.get("peak_mem_bytes_max_rank")),
                    "reserved_gib": _gib(r.get("peak_reserved_bytes_max_rank")),
                    "alloc_retries": r.get("alloc_retries_max_rank"),
                    "loss_reference": ref_name,
                    "loss_vs_ddp": _loss_diff(r.get("losses"), ref.get("losses")),
                    "round_medians_ms": r.get("round_medians_ms")})
    return rows


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _gib(n: Optional[int]) -> Optional[float]:
    return n / 2**30 if n else None


def _loss_diff(losses, reference) -> Optional[float]:
    """Largest |loss - DDP's loss| over the steps both recorded, every round."""
    if not losses or not reference:
        return None
    diffs = [abs(a - b) for run, ref in zip(losses, reference) for a, b in zip(run, ref)]
    return max(diffs) if diffs else None


def _f(value, digits=3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="harness JSON output(s)")
    parser.add_argument("--profile-dir", action="append", default=[],
                        help="BENCH_PROFILE directory of a launch (repeatable, one per JSON)")
    parser.add_argument("--iters", type=int, default=1,
                        help="steps per profiled window (BENCH_WINDOW; default 1)")
    parser.add_argument("--min-ms", type=float, default=0.02,
                        help="kernels differing from plain by less are left out")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    result = {"summary": [], "profiles": {}}
    for path in args.json:
        result["summary"] += summary_rows(json.loads(Path(path).read_text()))
    for path, directory in zip(args.json, args.profile_dir):
        result["profiles"][path] = profile_rows(Path(directory), args.iters, args.min_ms)
    for path, modes in result["profiles"].items():
        print(f"\nkernel ms per step beyond plain ({path})")
        print("| mode | kernel | launches/step | ms/step | plain ms/step | beyond plain |")
        print("|---|---|---|---|---|---|")
        for mode, rows in modes.items():
            for r in rows:
                name = r["kernel"] if r["kernel"].startswith("(") else short_name(r["kernel"])
                print(f"| {mode} | {name} | {_f(r.get('launches'), 1)} | "
                      f"{_f(r.get('ms'))} | {_f(r.get('plain_ms'))} | {_f(r['beyond_ms'])} |")
    print("\n| model | mode | ms/step | x plain | rounds ms | peak GiB | x plain | "
          "reserved GiB | retries | max abs loss - DDP's (bf16: DDP + bf16 hook) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["summary"]:
        rounds = "/".join(f"{m:.2f}" for m in r["round_medians_ms"] or [])
        retries = "" if r["alloc_retries"] is None else r["alloc_retries"]
        loss = "" if r["loss_vs_ddp"] is None else f"{r['loss_vs_ddp']:.3g}"
        print(f"| {r['model']} | {r['mode']} | {_f(r['ms'], 2)} | {_f(r['x_plain'])} | "
              f"{rounds} | {_f(r['peak_gib'], 2)} | {_f(r['peak_x_plain'])} | "
              f"{_f(r['reserved_gib'], 2)} | {retries} | {loss} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
