"""``commsched simulate RUN_DIR --world-size N --bandwidth GBPS ...``: what-if projections.

Takes a recorded run (its readiness profile and compute times, median iteration), replaces
the measured collective costs with a topology model of a larger cluster, and replays the
scheduler on it::

    commsched simulate runs/gpt --world-size 8,16,64 --bandwidth 50 --latency-us 10
    commsched simulate runs/gpt --world-size 16 --bandwidth 25 --topology hier:2 --tune
    commsched simulate runs/gpt --world-size 64 --bandwidth 50 --partition-bytes 16MiB \\
        --credit-bytes 64MiB --json

The first table rows are the run itself: as measured, and replayed with a cost model fitted
on its own chunks (how far the replay is from the measurement at the recorded size). The
assumptions are printed above the table (and are in ``--json`` under "assumptions").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import List, Optional

from ..config import ConfigError, parse_bytes
from .engine import MODES, simulate
from .model import SimError, TopologyCostModel, bus_factor, fit_cost_model
from .profile import RecordedRun, load_recorded_run
from .tune import tune

__all__ = ["simulate_main", "build_whatif", "parse_topology"]

PROG = "commsched simulate"


def parse_topology(text: str):
    """``ring`` | ``tree`` | ``hier:NODES`` -> (topology, nodes)."""
    t = text.strip().lower()
    if t in ("ring", "tree"):
        return t, 1
    if t.startswith("hier:"):
        try:
            nodes = int(t.split(":", 1)[1])
        except ValueError:
            nodes = 0
        if nodes >= 1:
            return "hier", nodes
    raise argparse.ArgumentTypeError(f"{text!r}: expected ring, tree or hier:NODES (NODES >= 1)")


def _world_sizes(text: str) -> List[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected world sizes >= 1, e.g. 8 or 8,16,64")
    return sizes


def _number(text: str, *, positive: bool) -> float:
    """A finite float, > 0 (``positive``) or >= 0, for argparse."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v > 0 if positive else v >= 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {'a positive number' if positive else 'a number >= 0'}")
    return v


def _positive(text: str) -> float:
    return _number(text, positive=True)


def _non_negative(text: str) -> float:
    return _number(text, positive=False)


def _bytes(name: str):
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, name)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="telemetry run directory "
                   "(COMMSCHED_TELEMETRY_DIR of the recorded run)")
    p.add_argument("--world-size", type=_world_sizes, required=True, metavar="N[,N...]",
                   help="ranks of the projected cluster(s)")
    p.add_argument("--bandwidth", type=_positive, required=True, metavar="GBPS",
                   help="per-rank bus bandwidth of the (inter-node) network, GB/s (1e9 B/s), "
                        "as nccl-tests reports busbw")
    p.add_argument("--latency-us", type=_non_negative, default=5.0, metavar="A",
                   help="latency per algorithm step (alpha), microseconds (default 5)")
    p.add_argument("--topology", type=parse_topology, default=("ring", 1),
                   metavar="ring|tree|hier:NODES", help="collective cost model (default ring)")
    p.add_argument("--intra-bandwidth", type=_positive, default=None, metavar="GBPS",
                   help="hier: intra-node busbw (default: fitted on the recorded run)")
    p.add_argument("--intra-latency-us", type=_non_negative, default=None, metavar="A",
                   help="hier: intra-node latency per step (default: fitted on the run)")
    p.add_argument("--partition-bytes", type=_bytes("--partition-bytes"), default=None,
                   metavar="B", help="override the run's partition size (e.g. 4MiB; 0 = off)")
    p.add_argument("--credit-bytes", type=_bytes("--credit-bytes"), default=None, metavar="B",
                   help="override the run's credit window (e.g. 16MiB; 0 or inf = unbounded)")
    p.add_argument("--policy", choices=("priority", "fifo"), default=None,
                   help="override the run's dispatch policy")
    p.add_argument("--decompose", choices=("none", "rs_ag"), default=None,
                   help="override the run's all-reduce decomposition")
    p.add_argument("--mode", choices=MODES, default="ddp",
                   help="ddp: DDP hook (comm must end before the step); dp: commsched "
                        "data-parallel mode (comm may spill into the next forward)")
    p.add_argument("--lane", default=None, help="process-group lane to replay (default: "
                   "the one with most bytes)")
    p.add_argument("--readiness", choices=("device", "host"), default="device",
                   help="request readiness: device estimate (default) or host submission")
    p.add_argument("--no-host-costs", action="store_true",
                   help="do not carry the run's host costs (step issue, credit return) over "
                        "to the projection")
    p.add_argument("--tune", action="store_true",
                   help="also search partition x credit x decomposition per world size")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def build_whatif(run: RecordedRun, args: argparse.Namespace) -> dict:
    """The projection as a JSON-serialisable dict (what ``--json`` prints)."""
    changes = {k: v for k, v in (("partition_bytes", args.partition_bytes),
                                 ("credit_bytes", args.credit_bytes),
                                 ("policy", args.policy), ("decompose", args.decompose))
               if v is not None}
    base = run.sim_config(**changes)
    profile = run.representative()
    notes = list(run.notes)
    fitted = None
    try:
        fitted = fit_cost_model(run.fit_rows, source=run.run_dir)
    except SimError as exc:
        notes.append(f"no cost model fitted on the run ({exc}): no replay row")
    topology, nodes = args.topology
    intra_bw, intra_lat = args.intra_bandwidth, args.intra_latency_us
    if topology == "hier" and (intra_bw is None or intra_lat is None):
        ar = None
        if fitted is not None:
            try:
                ar = fitted.lookup("all_reduce", "none", run.world_size)
            except SimError:
                ar = None
        if ar is None or ar.beta <= 0 or run.world_size < 2:
            raise SimError("hier: pass --intra-bandwidth and --intra-latency-us (no all_reduce "
                           "cost could be fitted on the recorded run to take them from)")
        if intra_bw is None:
            intra_bw = bus_factor("all_reduce", run.world_size) / ar.beta / 1e9
            notes.append(f"intra-node busbw {intra_bw:.1f} GB/s fitted on the run's "
                         f"all_reduce ({run.world_size} ranks)")
        if intra_lat is None:
            intra_lat = max(0.0, ar.alpha) / (2 * (run.world_size - 1)) * 1e6
            notes.append(f"intra-node latency {intra_lat:.2f} us per step fitted on the run")
    issue_s = credit_return_s = 0.0
    if fitted is not None and not args.no_host_costs:
        issue_s, credit_return_s = fitted.issue_s, fitted.credit_return_s
    model = TopologyCostModel(topology, args.bandwidth, args.latency_us * 1e-6, nodes,
                              intra_bw, None if intra_lat is None else intra_lat * 1e-6,
                              issue_s, credit_return_s)
    for n in args.world_size:
        model.check_world(n)

    ms = 1e3
    rows = [{"scenario": "recorded (measured)", "world_size": run.world_size,
             "topology": "as run", "config": run.sim_config().label(),
             "comm_alone_ms": None, "compute_only_ms": profile.compute_only_s * ms,
             "iteration_ms": run.measured_s * ms,
             "exposed_ms": _median([it.exposed_s for it in run.steady]) * ms}]
    if fitted is not None:
        replays = [("recorded, replayed (fitted costs)", run.sim_config(),
                    run.plan_for(args.mode))]
        if changes:
            replays.append(("recorded size, overrides (fitted costs)", base, None))
        for scenario, config, plan in replays:
            try:
                r = simulate(profile, fitted, config, args.mode, plan)
                rows.append(_row(scenario, run.world_size, "fitted", r))
            except SimError as exc:
                notes.append(f"{scenario}: {exc}")
    label = topology if topology != "hier" else f"hier:{nodes}"
    for n in args.world_size:
        config = base.replace(world_size=n)
        row = _row("projected", n, label, simulate(profile, model, config, args.mode))
        if args.tune:
            best, best_ms = tune(profile, model, policy=config.policy, world_size=n,
                                 mode=args.mode)[0]
            row["tuned_config"] = best.label()
            row["tuned_ms"] = best_ms
        rows.append(row)
    gib = profile.nbytes / 2**30
    assumptions = [
        f"recorded run: {run.run_dir}, lane {run.lane}, {run.world_size} ranks, "
        f"{len(run.steady)} steady iterations; {profile.nbytes / 2**20:.1f} MiB "
        f"({gib:.3f} GiB) of gradients in {len(profile.requests)} requests per iteration",
        f"compute from the run (median iteration): backward ends "
        f"{profile.compute_end_s * ms:.2f} ms after the first submission, other compute "
        f"(optimizer, forward, backward before the first gradient) {profile.tail_s * ms:.2f} "
        f"ms; compute-only iteration {profile.compute_only_s * ms:.2f} ms",
        "weak scaling: per-rank batch, model and compute unchanged at every world size; all "
        "ranks identical (no stragglers, no skew); request readiness "
        f"{'estimated on the device' if args.readiness == 'device' else 'host submission'}",
        "communication: one serial link per process group (collectives run one after "
        "another); every chunk step pays the full model cost; communication slows no compute",
        *model.describe(),
        f"host costs of the scheduler (from the run; --no-host-costs: 0): "
        f"{issue_s * 1e6:.1f} us to issue a collective step, {credit_return_s * 1e6:.1f} us "
        f"from a chunk's end to the start of the chunk its credit admits",
        f"scheduler: {base.label()}" + (" (overrides applied)" if changes else
                                         " (as recorded)"),
        ("mode ddp: iteration = max(backward end, last chunk end) + other compute"
         if args.mode == "ddp" else
         "mode dp: next forward per priority group waits for the group's chunks; forward "
         "time split over groups by bytes"),
    ]
    return {"run_dir": run.run_dir, "assumptions": assumptions, "notes": notes,
            "rows": rows,
            "fitted_costs": fitted.describe() if fitted is not None else []}


def _row(scenario: str, n: int, topology: str, r) -> dict:
    ms = 1e3
    return {"scenario": scenario, "world_size": n, "topology": topology,
            "config": r.config.label(), "comm_alone_ms": r.comm_busy_s * ms,
            "compute_only_ms": r.compute_only_s * ms, "iteration_ms": r.iteration_s * ms,
            "exposed_ms": r.exposed_s * ms}


def _median(values):
    return statistics.median(values) if values else 0.0


def format_text(doc: dict) -> str:
    lines = ["assumptions:"] + [f"  - {a}" for a in doc["assumptions"]]
    if doc["fitted_costs"]:
        lines += ["costs fitted on the recorded run:"] + [f"  {c}" for c in doc["fitted_costs"]]
    if doc["notes"]:
        lines += ["notes:"] + [f"  - {n}" for n in doc["notes"]]
    tuned = any("tuned_ms" in r for r in doc["rows"])
    headers = ["scenario", "ranks", "topology", "comm alone ms", "compute ms", "iter ms",
               "exposed ms", "efficiency", "config"]
    if tuned:
        headers += ["tuned iter ms", "tuned config"]
    table = []
    for r in doc["rows"]:
        eff = r["compute_only_ms"] / r["iteration_ms"] if r["iteration_ms"] else None
        cells = [r["scenario"], str(r["world_size"]), r["topology"], _f(r["comm_alone_ms"]),
                 _f(r["compute_only_ms"]), _f(r["iteration_ms"]), _f(r["exposed_ms"]),
                 "-" if eff is None else f"{100 * eff:.0f}%", r["config"]]
        if tuned:
            cells += [_f(r.get("tuned_ms")), r.get("tuned_config", "-")]
        table.append(cells)
    lines += ["", _table(headers, table)]
    lines.append("efficiency = compute-only / iteration time; comm alone = link busy time "
                 "(sum of chunk step costs, no overlap)")
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _table(headers: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def simulate_main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``commsched simulate``; returns the exit status (2 on bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:          # argparse printed the message (or --help)
        return int(exc.code or 0)
    try:
        run = load_recorded_run(args.run_dir, args.lane, args.readiness)
        doc = build_whatif(run, args)
    except SimError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if args.json else format_text(doc))
    return 0


if __name__ == "__main__":
    sys.exit(simulate_main())
