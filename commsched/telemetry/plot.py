"""``commsched report --plot``: a compute-vs-comm timeline, NVLink GB/s per iteration, and
each iteration's compute and exposed communication stacked against the floor.

matplotlib is imported here only (Agg backend, no display needed), so the report and the
recorder work without it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from .errors import TelemetryError
from .store import RunData

__all__ = ["plot_report", "MAX_TIMELINE_ITERATIONS"]

MAX_TIMELINE_ITERATIONS = 8


def _timeline_iterations(report: dict) -> List[int]:
    """Iterations for the timeline: all selected if few, else a window around the worst
    outlier, else the last ones."""
    its = sorted({r["iteration"] for r in report["rows"] if r["t_end_ns"] is not None})
    if len(its) <= MAX_TIMELINE_ITERATIONS:
        return its
    if report["outliers"]:
        worst = max(report["outliers"], key=lambda o: o["iteration_ms"])["iteration"]
        i = its.index(worst) if worst in its else len(its) - 1
        lo = max(0, min(i - 2, len(its) - MAX_TIMELINE_ITERATIONS))
        return its[lo:lo + MAX_TIMELINE_ITERATIONS]
    return its[-MAX_TIMELINE_ITERATIONS:]


def _floor_bars(ax, report: dict, ranks: List[int]) -> None:
    """Per iteration and rank, a bar of compute (iteration time less exposed
    communication) with the exposed communication on top, and the floor as a line."""
    width = 0.8 / max(len(ranks), 1)
    for n, rank in enumerate(ranks):
        rows = [r for r in report["rows"] if r["rank"] == rank and r["iteration_ms"] is not None
                and r["compute_ms"] is not None]
        xs = [r["iteration"] + (n - (len(ranks) - 1) / 2) * width for r in rows]
        compute = [r["compute_ms"] for r in rows]
        exposed = [r["exposed_comm_ms"] or 0.0 for r in rows]
        ax.bar(xs, compute, width, color="tab:green", alpha=0.6 + 0.4 * (n == 0),
               label="compute (iteration - exposed comm)" if n == 0 else None)
        ax.bar(xs, exposed, width, bottom=compute, color="tab:red",
               alpha=0.6 + 0.4 * (n == 0), label="exposed comm" if n == 0 else None)
    floor = report.get("floor")
    if floor:
        ax.axhline(floor["floor_ms"], color="black", linestyle="--",
                   label=f"floor {floor['floor_ms']:.2f} ms (limited by "
                         f"{floor['limited_by'].replace('_', ' ')})")
        title = "compute and exposed communication per iteration, against the floor"
    else:
        title = ("compute and exposed communication per iteration (no floor: commsched "
                 "floor --save RUN_DIR)")
    ax.set_title(title)
    ax.set_xlabel("iteration" + (f" (bars: ranks {', '.join(map(str, ranks))})"
                                 if len(ranks) > 1 else ""))
    ax.set_ylabel("ms")
    if ax.patches:
        ax.legend(fontsize=7)


def plot_report(run: RunData, report: dict, path: str) -> None:
    if os.path.isdir(path):     # savefig would write PATH.png next to it instead
        raise TelemetryError(f"cannot write the plot {path}: it is a directory")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise TelemetryError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None

    fig, (ax_t, ax_bw, ax_f) = plt.subplots(3, 1, figsize=(12, 10.5),
                                            gridspec_kw={"height_ratios": [3, 2, 2]})
    chosen = set(_timeline_iterations(report))
    rows = [r for r in report["rows"] if r["iteration"] in chosen and r["t_end_ns"] is not None]
    lane_its: Dict[Tuple[int, str, int], dict] = {
        (i["rank"], i["lane"], i["iteration"]): i for i in run.iterations}
    chunks: Dict[Tuple[int, str, int], List[dict]] = {}
    for c in run.comm_ops:
        chunks.setdefault((c["rank"], c["lane"], c["iteration"]), []).append(c)
    t0 = min((r["t_begin_ns"] for r in rows), default=0)
    ms = lambda t: (t - t0) / 1e6  # noqa: E731
    ranks = sorted({r["rank"] for r in report["rows"]})
    for r in rows:
        y = ranks.index(r["rank"])
        ax_t.broken_barh([(ms(r["t_begin_ns"]), ms(r["t_end_ns"]) - ms(r["t_begin_ns"]))],
                         (y - 0.4, 0.8), facecolors="#dddddd", edgecolors="#999999")
        ax_t.text(ms(r["t_begin_ns"]), y + 0.42, f"it {r['iteration']}", fontsize=7)
        for name in r["lane_iterations"]:
            lane, it = name.rsplit(":", 1)
            key = (r["rank"], lane, int(it))
            spans = [(ms(c["t_start_ns"]), (c["t_end_ns"] - c["t_start_ns"]) / 1e6)
                     for c in chunks.get(key, []) if c["ok"]]
            ax_t.broken_barh(spans, (y, 0.35), facecolors="tab:blue")
            li = lane_its.get(key)
            if li and li["t_flush_ns"] and li["t_last_end_ns"] and \
                    li["t_last_end_ns"] > li["t_flush_ns"]:
                ax_t.broken_barh([(ms(li["t_flush_ns"]),
                                   (li["t_last_end_ns"] - li["t_flush_ns"]) / 1e6)],
                                 (y - 0.35, 0.3), facecolors="tab:red")
    ax_t.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax_t.set_xlabel("time (ms)")
    ax_t.set_title("iterations (grey), chunk steps on the device (blue), "
                   "exposed comm after flush (red)")

    for rank in ranks:
        rr = [r for r in report["rows"] if r["rank"] == rank]
        xs = [r["iteration"] for r in rr]
        for key, style, label in (("nvlink_tx_gbps", "-o", "NVLink tx"),
                                  ("nvlink_rx_gbps", "-x", "NVLink rx"),
                                  ("busbw_gbps", "--", "busbw")):
            ys = [r[key] if r[key] is not None else float("nan") for r in rr]
            if any(y == y for y in ys):
                ax_bw.plot(xs, ys, style, markersize=3, label=f"rank {rank} {label}")
    for o in report["outliers"]:
        ax_bw.axvline(o["iteration"], color="tab:red", alpha=0.3)
    if not ax_bw.lines:
        status = ", ".join(sorted({str(r.get("nvml_status")) for r in report["runs"]}))
        ax_bw.text(0.5, 0.5, f"no bandwidth data (NVML: {status})", ha="center",
                   transform=ax_bw.transAxes)
    else:
        ax_bw.legend(fontsize=7, ncol=3)
    ax_bw.set_xlabel("iteration (red lines: outliers)")
    ax_bw.set_ylabel("GB/s while communicating")
    _floor_bars(ax_f, report, ranks)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:     # ValueError: unknown image format
        raise TelemetryError(f"cannot write the plot {path}: {exc}") from None
    finally:
        plt.close(fig)
