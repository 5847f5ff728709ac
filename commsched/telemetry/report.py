"""``commsched report RUN_DIR [--json] [--plot out.png] [--iterations A:B] [--rank R]``.

Prints the topology (nodes x ranks per node) and how the all-reduces were decomposed
(``auto``'s measured table, where it measured), then, per rank, one row per iteration (time, compute, communication busy time, exposed
communication, overlap, efficiency against the floor where the run directory holds one,
bytes, bus bandwidth, the NVLink bytes the iteration's collectives put on the links beside
what they should, NVLink GB/s), a summary, and the outlier iterations with their likely
cause (application, communication library, hardware). The definitions are in
:mod:`commsched.telemetry.analysis`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Tuple

from ..floor import load_floor
from .analysis import DEFINITIONS, analyze
from .decomposition import decomposition_section, format_decomposition
from .errors import TelemetryError
from .step_split import TELEMETRY_REASON, from_telemetry
from .store import RunData, load_run

__all__ = ["main", "report_main", "build_report", "report_from_run", "format_text",
           "parse_range"]

PROG = "commsched report"


def parse_range(text: str) -> Tuple[Optional[int], Optional[int]]:
    """``"A:B"`` -> iterations ``A <= i < B``; either side may be empty; ``"A"`` is ``A:A+1``."""
    try:
        if ":" not in text:
            a = int(text)
            return a, a + 1
        a, b = text.split(":", 1)
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected A:B (iterations A <= i < B), A:, :B or A") from None
    if lo is not None and hi is not None and hi <= lo:
        raise argparse.ArgumentTypeError(f"{text!r}: empty range (B must be greater than A)")
    return lo, hi


def build_report(run_dir: str, iterations=None, ranks=None) -> dict:
    """The report as a JSON-serialisable dict (what ``--json`` prints)."""
    return report_from_run(load_run(run_dir), iterations, ranks)


def report_from_run(run: RunData, iterations=None, ranks=None) -> dict:
    floor, note = load_floor(run.run_dir)
    result = analyze(run, iterations, ranks, floor)
    result["floor_note"] = note
    result["split"] = _splits(result["summary"], floor)
    result["run_dir"] = run.run_dir
    result["other_runs"], result["skipped"] = run.other_runs, run.skipped
    result["summary"] = {str(k): v for k, v in result["summary"].items()}
    for r in result["rows"]:
        r["link_tx_bytes"] = {str(k): v for k, v in r["link_tx_bytes"].items()}
    result["runs"] = [{k: v for k, v in r.items() if k != "config_json"} | {
        "config": _json_or_text(r.get("config_json"))} for r in result["runs"]]
    result.update(decomposition_section(run, ranks))
    return result


def _json_or_text(text):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _fmt(value, spec: str = ".2f", width: int = 9) -> str:
    if value is None:
        return "-".rjust(width)
    return format(value, spec).rjust(width)


def format_text(report: dict) -> str:
    lines: List[str] = [f"commsched report: {report['run_dir']}"]
    for r in report["runs"]:
        lines.append(
            f"  rank {r['rank']}/{r['world_size']} on {r['host']}: torch {r['torch_version']}"
            f", nccl {r['nccl_version'] or '-'}, driver {r['driver_version'] or '-'}, "
            f"GPU {r['gpu_name'] or '-'}; NVML: {r['nvml_status']}"
            + (f" ({r['nvml_detail']})" if r.get("nvml_detail") else ""))
    if "decomposition" in report:
        lines += format_decomposition(report)
    header = (f"{'iter':>6} {'iter ms':>9} {'compute':>9} {'comm busy':>9} {'exposed':>9} "
              f"{'overlap%':>9} {'eff%':>6} {'idle ms':>9} {'gap ms':>9} {'MB':>9} "
              f"{'busbw':>9} {'NVL MB':>9} {'exp MB':>9} {'NVL/exp':>7} {'NVL tx':>9} "
              f"{'NVL rx':>9} {'util%':>7}")
    for rank, summary in report["summary"].items():
        rows = [r for r in report["rows"] if str(r["rank"]) == rank]
        lines += ["", f"rank {rank}: per iteration (GB/s for bandwidths)", header]
        for r in rows:
            lines.append(
                f"{r['iteration']:>6} {_fmt(r['iteration_ms'])} {_fmt(r['compute_ms'])} "
                f"{_fmt(r['comm_ms'])} {_fmt(r['exposed_comm_ms'])} "
                f"{_fmt(r['overlap_pct'], '.1f')} {_fmt(_pct(r['efficiency']), '.1f', 6)} "
                f"{_fmt(r['link_idle_ms'])} "
                f"{_fmt(r['widest_gap_ms'])} {_fmt(r['bytes'] / 1e6)} "
                f"{_fmt(r['busbw_gbps'])} {_fmt(_mb(r['nvlink_tx_bytes']))} "
                f"{_fmt(_mb(r['nvlink_expected_bytes']))} "
                f"{_fmt(r['nvlink_tx_ratio'], '.3f', 7)} {_fmt(r['nvlink_tx_gbps'])} "
                f"{_fmt(r['nvlink_rx_gbps'])} "
                f"{_fmt(None if r['nvlink_util'] is None else 100 * r['nvlink_util'], '.1f', 7)}"
                + ("" if r["complete"] else "  (incomplete)"))
        s = summary
        lines.append(
            f"summary: {s['iterations']} iterations; median iteration "
            f"{_fmt(s['iteration_ms_median'], '.2f', 0)} ms, compute "
            f"{_fmt(s['compute_ms_median'], '.2f', 0)} ms, comm busy "
            f"{_fmt(s['comm_ms_median'], '.2f', 0)} ms, exposed "
            f"{_fmt(s['exposed_comm_ms_median'], '.2f', 0)} ms, overlap "
            f"{_fmt(s['overlap_pct_median'], '.1f', 0)}%, busbw "
            f"{_fmt(s['busbw_gbps_median'], '.1f', 0)} GB/s, NVLink tx "
            f"{_fmt(s['nvlink_tx_gbps_median'], '.1f', 0)} GB/s; "
            f"{s['bytes_total'] / 1e6:.1f} MB communicated"
            + (f"; {s['incomplete_iterations']} incomplete" if s["incomplete_iterations"]
               else ""))
        gap = s["widest_gap_usual"]
        if gap is not None:
            lines.append(
                f"link idle: median {_fmt(s['link_idle_ms_median'], '.2f', 0)} ms per "
                f"iteration; meanwhile the collective that ended it was not yet submitted "
                f"{_fmt(s['idle_unsubmitted_ms_median'], '.2f', 0)} ms, queued in commsched "
                f"{_fmt(s['idle_queued_ms_median'], '.2f', 0)} ms, issued but not started on "
                f"the device {_fmt(s['idle_issued_ms_median'], '.2f', 0)} ms (medians); "
                f"widest gap median {_fmt(s['widest_gap_ms_median'], '.2f', 0)} ms; "
                f"in {gap['iterations']} of {gap['of']} iterations the widest gap came after "
                f"{gap['after'] or 'the start'} and before {gap['before'] or 'the end'}")
        if s["nvlink_tx_bytes_total"]:
            outside = s["nvlink_tx_bytes_outside_collectives"]
            lines.append(
                f"NVLink TX: {s['nvlink_tx_bytes_total'] / 1e6:.1f} MB put on the links by "
                f"these iterations' collectives, {s['nvlink_expected_bytes_total'] / 1e6:.1f} "
                f"MB expected (ring share of their bytes): "
                f"{_fmt(s['nvlink_tx_ratio_total'], '.3f', 0)}x in total, "
                f"{_fmt(s['nvlink_tx_ratio_median'], '.3f', 0)}x median per iteration"
                + (f"; {outside / 1e6:.1f} MB over the run while no collective ran"
                   if outside else ""))
        if s["nvlink_tx_bytes_total"] == 0 and s["bytes_total"] > 0:
            lines.append("note: NVLink sent nothing while the collectives moved "
                         f"{s['bytes_total'] / 1e6:.1f} MB: their traffic took another path "
                         "(NCCL_P2P_DISABLE=1 or host shared memory, PCIe, the network), "
                         "so NVLink GB/s reads 0")
    floor = report.get("floor")
    if floor:
        lines += ["", f"floor {floor['floor_ms']:.2f} ms = max(compute only "
                      f"{floor['compute_only_ms']:.2f}, comm only {floor['comm_only_ms']:.2f}), "
                      f"limited by {floor['limited_by'].replace('_', ' ')}; from "
                      f"{report['floor_note']}"]
        for rank, s in report["summary"].items():
            if s["efficiency_median"] is not None:
                lines.append(f"rank {rank}: efficiency {100 * s['efficiency_median']:.1f}% "
                             f"(floor / median iteration "
                             f"{s['iteration_ms_median']:.2f} ms)")
    else:
        lines += ["", f"efficiency: {report.get('floor_note', 'no floor')}"]
    lines += _split_lines(report)
    lines += ["", f"outliers ({DEFINITIONS['outlier']}): {len(report['outliers'])}"]
    for o in report["outliers"]:
        lines.append(f"  rank {o['rank']} iteration {o['iteration']}: {o['iteration_ms']:.2f} ms"
                     f" (median {o['median_ms']:.2f}, threshold {o['threshold_ms']:.2f}) -> "
                     f"{o['cause']}")
        lines += [f"      {e}" for e in o["evidence"]]
    return "\n".join(lines)


def _splits(summary: dict, floor: Optional[dict]) -> dict:
    """Per rank, the parts of the median iteration above compute only that these device
    timestamps give (``step_split.from_telemetry``)."""
    compute = floor.get("compute_only_ms") if floor else None
    return {str(rank): from_telemetry(s["iteration_ms_median"], s["exposed_comm_ms_median"],
                                      compute)
            for rank, s in summary.items()}


def _split_lines(report: dict) -> List[str]:
    lines = [""]
    for rank, s in (report.get("split") or {}).items():
        above = ("above compute only: needs floor.json's compute only" if s["above_ms"] is None
                 else f"{s['above_ms']:.2f} ms above compute only (median iteration less "
                      f"floor.json's compute only)")
        tail = ("not measured" if s["tail_ms"] is None else f"{s['tail_ms']:.2f} ms")
        lines.append(f"rank {rank}: {above}; the tail (communication after the device ended "
                     f"the backward) {tail}; exposed communication before it, compute slowed "
                     f"beside communication, own device work and host: {TELEMETRY_REASON}")
    floor = report.get("floor") or {}
    if floor.get("split_verdict"):
        lines.append(f"commsched floor's split of its hook launch: {floor['split_verdict']}")
    return lines


def _pct(fraction: Optional[float]) -> Optional[float]:
    return None if fraction is None else 100 * fraction


def _mb(nbytes: Optional[float]) -> Optional[float]:
    return None if nbytes is None else nbytes / 1e6


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Per-iteration communication report of a commsched telemetry "
                               "run directory, with the likely cause of slow iterations.")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory, or the COMMSCHED_TELEMETRY_DIR holding them (the "
                        "newest is read, the others listed)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw a compute-vs-comm timeline, NVLink GB/s per iteration, and "
                        "each iteration's compute and exposed communication against the floor")
    p.add_argument("--iterations", metavar="A:B", type=parse_range,
                   help="only iterations A <= i < B (A:, :B and a single A also work)")
    p.add_argument("--rank", type=int, action="append",
                   help="only this rank (repeatable; default all)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:           # --help, or a usage error already printed
        return int(exc.code or 0)
    try:
        run = load_run(args.run_dir)
        for note in run.notes():
            print(f"{PROG}: {note}", file=sys.stderr)
        report = report_from_run(run, args.iterations, args.rank)
        if not report["rows"] and (args.iterations is not None or args.rank):
            raise TelemetryError(f"{args.run_dir}: no iterations match the --iterations / "
                                 f"--rank selection")
        if args.plot:
            from .plot import plot_report
            plot_report(run, report, args.plot)
        if args.json:
            json.dump(report, sys.stdout, indent=1, default=str)
            sys.stdout.write("\n")
        else:
            print(format_text(report))
            if args.plot:
                print(f"\nplot written to {args.plot}")
    except TelemetryError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


report_main = main      # the name commsched.cli looks up


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
