"""``commsched floor`` against the harness, per network regime, on one workload: does the
command's compute only and comm only match the harness's modes of the same name, what
does the report say of a telemetry run of the hook, and what does telemetry cost?

    python examples/bench/floor_check.py --regimes nvlink,host --out results/floor.json
    python examples/bench/floor_check.py --quick --regimes nvlink --out /tmp/floor.json

Per regime (``harness.REGIMES``; NCCL_NVLS_ENABLE=0 always):

1. ``commsched floor --iters N --warmup W`` on ``train_lm.py`` (the Llama-architecture
   decoder, the harness's ``llama_lib``) under torchrun, 2 ranks;
2. the harness on ``llama_lib``: compute only, DDP default (whose buckets comm only
   replays), comm only, the commsched hook, and the hook with telemetry kept under
   ``--telemetry-root`` (where the harness also writes its floor), timed in windows of
   ``BENCH_WINDOW`` iterations (``--window``) as the command times its launches;
3. ``commsched report`` of the telemetry run: its efficiency against the harness's floor.

``--quick``: the tiny GPT of ``train_lm.py --quick``, the harness's ``gpt --quick`` (the
same model and batch), on CPU with gloo. Prints a table last; exit status 1 when a step
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import benchlib  # first: puts the checkout on sys.path

from harness import ALWAYS_ENV, REGIMES

BENCH = Path(__file__).resolve().parent
MODES = ("compute_only", "ddp_default", "comm_only", "ddp_commsched",
         "ddp_commsched_telemetry")


def regime_env(regime: str, quick: bool, site: Path) -> Dict[str, str]:
    """The regime's NCCL environment, no COMMSCHED settings, and this checkout's commsched
    (as installed: commsched.hooks inside) first on the path of every process started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    for name, value in {**REGIMES[regime], **ALWAYS_ENV}.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    if quick:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run(cmd: List[str], env: Dict[str, str], timeout: float, cwd: str
        ) -> subprocess.CompletedProcess:
    print(f"[floor-check] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def check_regime(regime: str, args, tmp: str, site: Path) -> Dict[str, Any]:
    env = regime_env(regime, args.quick, site)
    out: Dict[str, Any] = {"regime": regime, "errors": []}
    script = [str(BENCH / "train_lm.py"), "--steps", str(args.warmup + args.iters + 10)]
    if args.quick:
        script.append("--quick")
    proc = run([sys.executable, "-m", "commsched", "floor", "--iters", str(args.iters),
                "--warmup", str(args.warmup), "--json", "--standalone", "--nproc-per-node",
                "2", *script], env, args.timeout, tmp)
    if proc.returncode == 0:
        out["floor"] = json.loads(proc.stdout)
    else:
        out["errors"].append(f"commsched floor: {proc.stderr.strip()[-1500:]}")
    root = os.path.join(tmp, f"telemetry_{regime}")
    result = os.path.join(tmp, f"harness_{regime}.json")
    window = str(args.window)
    proc = run([sys.executable, str(BENCH / "harness.py"),
                "--model", "gpt" if args.quick else "llama_lib", "--regime", regime,
                "--modes", ",".join(MODES), "--warmup", str(args.warmup),
                "--iters", str(max(1, args.iters // args.window)), "--rounds",
                str(args.rounds), "--telemetry-root", root, "--out", result]
               + ["--timeout", str(args.timeout - 30)]
               + (["--quick", "--cpu"] if args.quick else []),
               {**env, "BENCH_WINDOW": window}, args.timeout, tmp)
    if proc.returncode != 0 or not os.path.exists(result):
        out["errors"].append(f"harness: {proc.stdout.strip()[-1500:]}")
        return out
    with open(result) as f:
        harness = json.load(f)
    modes = harness["launches"][0]["runs"][0]["modes"]
    out["harness"] = {name: {k: modes[name].get(k) for k in (
        "status", "reason", "median_ms", "p10_ms", "p90_ms", "efficiency", "bucket_source",
        "buckets", "total_bytes")} for name in (*MODES, "floor")}
    out["system"] = harness.get("system")
    telemetry = sorted(Path(root).glob(f"{regime}_w2_ddp_commsched_telemetry*"))
    if telemetry:
        proc = run([sys.executable, "-m", "commsched", "report", "--json", str(telemetry[0])],
                   env, args.timeout, tmp)
        if proc.returncode == 0:
            report = json.loads(proc.stdout)
            out["report"] = {"run_dir": str(telemetry[0]), "floor": report["floor"],
                             "efficiency_median": {
                                 r: s["efficiency_median"]
                                 for r, s in report["summary"].items()},
                             "iteration_ms_median": {
                                 r: s["iteration_ms_median"]
                                 for r, s in report["summary"].items()}}
        else:
            out["errors"].append(f"report: {proc.stderr.strip()[-1500:]}")
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[str]:
    return None if a is None or not b else f"{a / b:.3f}"


def table(results: List[Dict[str, Any]]) -> str:
    rows = []
    for r in results:
        fl = r.get("floor") or {}
        h = r.get("harness") or {}
        ms = {name: (h.get(name) or {}).get("median_ms") for name in (*MODES, "floor")}
        eff = (r.get("report") or {}).get("efficiency_median") or {}
        rows.append([
            r["regime"], benchlib.fmt(fl.get("compute_only_ms"), 2),
            benchlib.fmt(ms["compute_only"], 2),
            _ratio(fl.get("compute_only_ms"), ms["compute_only"]),
            benchlib.fmt(fl.get("comm_only_ms"), 2), benchlib.fmt(ms["comm_only"], 2),
            _ratio(fl.get("comm_only_ms"), ms["comm_only"]),
            benchlib.fmt(fl.get("hook_ms"), 2),
            None if fl.get("efficiency") is None else f"{100 * fl['efficiency']:.1f}%",
            ", ".join(f"{100 * v:.1f}%" for v in eff.values() if v is not None) or None,
            benchlib.fmt(ms["ddp_commsched"], 2), benchlib.fmt(ms["ddp_commsched_telemetry"], 2),
            _ratio(ms["ddp_commsched_telemetry"], ms["ddp_commsched"]),
            "; ".join(e.splitlines()[0][:80] for e in r["errors"]) or None])
    return benchlib.markdown_table(
        ["regime", "floor: compute only", "harness: compute only", "ratio",
         "floor: comm only", "harness: comm only", "ratio", "floor: hook",
         "floor: efficiency", "report: efficiency (ranks)", "harness: hook",
         "harness: hook + telemetry", "telemetry ratio", "errors"], rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regimes", default="nvlink,host")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=10,
                   help="the harness's BENCH_WINDOW (iterations per timed sample)")
    p.add_argument("--rounds", type=int, default=1, help="the harness's --rounds")
    p.add_argument("--quick", action="store_true", help="tiny GPT on CPU (a script check)")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--out", default="floor_check.json")
    args = p.parse_args(argv)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if set(regimes) - set(REGIMES):
        p.error(f"--regimes: choose from {', '.join(REGIMES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="commsched-floor-check-") as tmp:
        site = benchlib.commsched_site(Path(tmp))
        for regime in regimes:
            try:
                results.append(check_regime(regime, args, tmp, site))
            except subprocess.TimeoutExpired as exc:
                results.append({"regime": regime, "errors": [f"timed out: {exc.cmd[:4]}"]})
    document = {"schema": "commsched.bench.floor_check/1", "created_utc": benchlib.utc_now(),
                "command": [sys.executable, *sys.argv], "settings": vars(args),
                "parent_env": benchlib.relevant_env(), "results": results}
    benchlib.write_json(Path(args.out), document)
    system = next((r["system"] for r in results if r.get("system")), None) or {}
    print(f"\n[floor-check] wrote {args.out}; {system.get('gpu_name') or 'CPU'}, driver "
          f"{system.get('driver')}, torch {system.get('torch')}, NCCL {system.get('nccl')}; "
          f"ms per iteration, {args.iters} after {args.warmup}\n")
    print(table(results))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
