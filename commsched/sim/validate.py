"""``python -m commsched.sim.validate RUN_DIR...``: predicted vs measured iteration time.

Each run directory is one recorded setting (partition, credit, policy, decompose). For each:

1. the cost model is fitted on chunks (``--fit own``: the run's own steady iterations;
   ``others``: every *other* run given — an out-of-sample test of predicting a setting that
   was not run; ``all``: every run pooled);
2. every steady iteration is replayed with the run's recorded configuration: its readiness
   profile and backward end, the run's median tail (optimizer, forward, ...) — the same
   for all iterations, so per-iteration noise in the tail is not fed back;
3. measured (first submission to next first submission) and predicted iteration times are
   compared by their medians; so are measured and predicted exposed communication
   (``max(0, last chunk end - backward end)``), which does not involve the tail at all.

``same order`` counts the iterations whose replayed dispatch order is exactly the one the
scheduler recorded (``t_dispatch``): the policy replay itself, independent of costs. With
policy priority the replay follows the plan the run used, rebuilt as the scheduler built it
(see :func:`commsched.sim.profile.load_recorded_run`).

Only the communication side is predicted: compute comes from the run. An error of a few
percent on the iteration time can hide a large error on exposed communication when the
iteration is compute-bound; read both columns. ``rank agreement`` counts the pairs of
settings that the simulator orders as the measurement does (what a tuner needs).

    python -m commsched.sim.validate runs/p1M_c4M runs/p4M_c16M runs/p16M_c64M
    python -m commsched.sim.validate runs/* --fit others --json
    python -m commsched.sim.validate runs/* --tune 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from itertools import combinations
from typing import List, Optional, Sequence

from .engine import MODES, simulate
from .model import SimError, fit_cost_model
from .profile import RecordedRun, load_recorded_run
from .tune import tune

__all__ = ["validate_runs", "main"]

PROG = "python -m commsched.sim.validate"


def validate_runs(run_dirs: Sequence[str], *, fit: str = "own", lane: Optional[str] = None,
                  readiness: str = "device", mode: str = "ddp", tune_top: int = 0) -> dict:
    """Replay every steady iteration of each run and compare with the measurement.

    Returns ``{"rows": [...], "errors": [...], "rank_agreement": (agree, pairs), "tuned":
    [...]}``; a run that cannot be read is listed under errors, the others still validated.
    ``tune_top`` > 0: also the tuner's best settings for the first run's workload, on a
    cost model fitted on every run (``tuned``).

    Example::
        doc = validate_runs(["runs/a", "runs/b"])
        print(doc["rows"][0]["error_pct"])
    """
    if fit not in ("own", "others", "all"):
        raise SimError(f"fit {fit!r}: expected own, others or all")
    if fit == "others" and len(run_dirs) < 2:
        raise SimError("--fit others needs at least two run directories")
    runs: List[RecordedRun] = []
    errors = []
    for d in run_dirs:
        try:
            runs.append(load_recorded_run(d, lane, readiness))
        except SimError as exc:
            errors.append({"run_dir": d, "error": str(exc)})
    rows = []
    for run in runs:
        try:
            rows.append(_validate_one(run, runs, fit, mode))
        except SimError as exc:
            errors.append({"run_dir": run.run_dir, "error": str(exc)})
    agree = pairs = 0
    for a, b in combinations(rows, 2):
        if a["measured_ms"] == b["measured_ms"]:
            continue
        pairs += 1
        agree += (a["measured_ms"] < b["measured_ms"]) == (a["predicted_ms"] < b["predicted_ms"])
    doc = {"fit": fit, "mode": mode, "readiness": readiness, "rows": rows, "errors": errors,
           "rank_agreement": [agree, pairs], "tuned": []}
    if tune_top and runs:
        doc["tuned"] = _tune(runs, mode, tune_top)
    return doc


def _tune(runs: List[RecordedRun], mode: str, top: int) -> List[dict]:
    """What the tuner picks for the first run's workload, with costs fitted on every run."""
    run = runs[0]
    model = fit_cost_model([r for other in runs for r in other.fit_rows], source="all")
    ranked = tune(run.representative(), model, policy=run.sim_config().policy,
                  world_size=run.world_size, mode=mode)
    return [{"run_dir": run.run_dir, "setting": c.label(), "predicted_ms": ms}
            for c, ms in ranked[:top]]


def _validate_one(run: RecordedRun, runs: List[RecordedRun], fit: str, mode: str) -> dict:
    if fit == "own":
        fit_rows = run.fit_rows
    else:
        fit_rows = [r for other in runs if fit == "all" or other is not run
                    for r in other.fit_rows]
    model = fit_cost_model(fit_rows, source=fit)
    config = run.sim_config()
    tail = statistics.median(it.profile.tail_s for it in run.steady)
    predicted, exposed_pred = [], []
    same_order = 0
    for it in run.steady:
        p = it.profile
        profile = type(p)(p.requests, p.compute_end_s, tail, p.forward_s)
        r = simulate(profile, model, config, mode, run.plan_for(mode))
        predicted.append(r.iteration_s)
        exposed_pred.append(max(0.0, r.comm_end_s - p.compute_end_s))
        same_order += tuple(r.order[run.lane]) == it.order
    measured = statistics.median(it.measured_s for it in run.steady)
    pred = statistics.median(predicted)
    return {
        "run_dir": run.run_dir, "setting": config.label(), "world_size": run.world_size,
        "iterations": len(run.steady),
        "measured_ms": measured * 1e3, "predicted_ms": pred * 1e3,
        "error_pct": 100.0 * (pred - measured) / measured if measured else None,
        "exposed_measured_ms": statistics.median(it.exposed_s for it in run.steady) * 1e3,
        "exposed_predicted_ms": statistics.median(exposed_pred) * 1e3,
        "tail_ms": tail * 1e3,
        "same_order": same_order,
        "costs": model.describe(), "notes": run.notes,
    }


def format_text(doc: dict) -> str:
    headers = ["setting", "ranks", "iters", "measured ms", "predicted ms", "error %",
               "exposed meas ms", "exposed pred ms", "same order", "run"]
    rows = [[r["setting"], str(r["world_size"]), str(r["iterations"]),
             f"{r['measured_ms']:.2f}", f"{r['predicted_ms']:.2f}",
             "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}",
             f"{r['exposed_measured_ms']:.2f}", f"{r['exposed_predicted_ms']:.2f}",
             f"{r['same_order']}/{r['iterations']}", r["run_dir"]] for r in doc["rows"]]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = [f"cost model fitted on: {doc['fit']}; mode {doc['mode']}; readiness "
             f"{doc['readiness']}", "",
             "  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if doc["rows"]:
        errs = [abs(r["error_pct"]) for r in doc["rows"] if r["error_pct"] is not None]
        if errs:
            lines.append(f"\nmean |error| {sum(errs) / len(errs):.1f}%, max "
                         f"{max(errs):.1f}%")
        agree, pairs = doc["rank_agreement"]
        if pairs:
            lines.append(f"rank agreement: {agree}/{pairs} pairs of settings ordered as "
                         f"measured")
    for r in doc["rows"]:
        lines.append(f"\n{r['run_dir']}: tail {r['tail_ms']:.2f} ms")
        lines += [f"  cost: {c}" for c in r["costs"]]
        lines += [f"  note: {n}" for n in r["notes"]]
    if doc["tuned"]:
        lines.append(f"\ntuner's best settings for {doc['tuned'][0]['run_dir']} "
                     f"(costs fitted on every run):")
        lines += [f"  {t['predicted_ms']:9.2f} ms  {t['setting']}" for t in doc["tuned"]]
    for e in doc["errors"]:
        lines.append(f"\nerror: {e['run_dir']}: {e['error']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="telemetry run directories, one per recorded setting")
    p.add_argument("--fit", choices=("own", "others", "all"), default="own",
                   help="chunks the cost model is fitted on (default own)")
    p.add_argument("--mode", choices=MODES, default="ddp")
    p.add_argument("--lane", default=None)
    p.add_argument("--readiness", choices=("device", "host"), default="device")
    p.add_argument("--tune", type=int, default=0, metavar="N",
                   help="also list the tuner's N best settings for the first run's workload")
    p.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        doc = validate_runs(args.run_dirs, fit=args.fit, lane=args.lane,
                            readiness=args.readiness, mode=args.mode, tune_top=args.tune)
    except SimError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if args.json else format_text(doc))
    for e in doc["errors"]:
        print(f"{PROG}: error: {e['run_dir']}: {e['error']}", file=sys.stderr)
    return 2 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
