"""Plot ms/iteration per mode (median, p10-p90 bars) from harness.py JSON files, one
panel per regime and model: the figure of a dated report under ``benchmarks/``.

    python examples/bench/plot_modes.py results/*.json -o benchmarks/some_report.png
    python examples/bench/plot_modes.py busbw.json -o benchmarks/busbw_report.png

Modes that did not run (n/a, error) are left out. A busbw.py JSON (one file) is plotted
instead as time per operation against message size, a line per variant, with the spread
over its rounds. megatron_e2e.py JSON files give a panel per regime and setting: stock,
patched (and launcher only), the median over rounds with the rounds' range; an interleaved
launch's stock and patched iterations, their median with p10-p90.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def _short_label(label: str, width: int = 60) -> str:
    """``label`` within ``width`` characters, keeping its end (where the sweeps' labels
    differ)."""
    if len(label) <= width:
        return label
    keep = (width - 3) // 2
    return f"{label[:keep]}...{label[-(width - 3 - keep):]}"


def panels(paths: List[Path]) -> Dict[Tuple[str, str], List[Tuple[str, float, float, float]]]:
    """(regime, model) -> [(mode label, median, p10, p90)], in file and table order; a
    mode measured in several files keeps its first measurement."""
    out: Dict[Tuple[str, str], List[Tuple[str, float, float, float]]] = {}
    for path in paths:
        document = json.loads(path.read_text())
        for row in (document.get("summary") or {}).values():        # megatron_e2e.py
            rows = out.setdefault((row["regime"], f"Megatron-LM {row['setting']}"), [])
            for name in ("stock", "patched", "launcher"):
                values = row.get(f"{name}_ms")
                if values:
                    rows.append((name, row[f"{name}_median_ms"], min(values), max(values)))
            for name in ("stock", "patched"):
                values = row.get(f"interleaved_{name}_ms")
                if values:
                    rows.append((f"interleaved {name} (iterations: median, p10-p90)",
                                 *_median_p10_p90(values)))
        for launch in document.get("launches", []):
            for run in launch.get("runs", []):
                rows = out.setdefault((run["regime"], run["model"]), [])
                seen = {label for label, *_ in rows}
                for mode in run["modes"].values():
                    if mode.get("status") != "ok" or mode.get("median_ms") is None:
                        continue
                    label = mode.get("label") or mode.get("name")
                    if label not in seen:
                        # (a computed row, the floor, has no samples: no spread)
                        median = mode["median_ms"]
                        rows.append((label, median, _or(mode.get("p10_ms"), median),
                                     _or(mode.get("p90_ms"), median)))
    return {key: rows for key, rows in out.items() if rows}


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


def _median_p10_p90(values: List[float]) -> Tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), deciles[0], deciles[-1]


def plot(data, output: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(data)
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 1.2 + 0.45 * sum(
        len(data[k]) for k in keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        rows = data[key]
        labels = [_short_label(label) for label, *_ in rows]
        medians = [m for _, m, _, _ in rows]
        low = [m - p10 for _, m, p10, _ in rows]
        high = [p90 - m for _, m, _, p90 in rows]
        y = range(len(rows))
        ax.barh(y, medians, xerr=[low, high], color="#4c78a8", capsize=3)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(m + h for m, h in zip(medians, high)) * 1.08)
        ax.set_title(f"{key[1]}, {key[0]}", fontsize=9)
        ax.set_xlabel("ms/iteration (median, p10-p90)" if not key[1].startswith(
            "Megatron-LM") else "ms/iteration (a launch: median of rounds, rounds' range; "
            "interleaved: as labelled)", fontsize=8)
        for i, m in enumerate(medians):
            ax.text(m, i, f" {m:.1f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def busbw_series(document) -> Dict[str, List[Tuple[int, float, float, float]]]:
    """variant -> [(bytes, us per operation, lowest round, highest round)] of a busbw.py
    document, variants that measured nothing left out."""
    out: Dict[str, List[Tuple[int, float, float, float]]] = {}
    for name, result in document.get("variants", {}).items():
        points = []
        for row in result.get("rows", []):
            rounds = row.get("time_us_rounds") or [row["time_us"]]
            points.append((row["size"], row["time_us"], min(rounds), max(rounds)))
        if points:
            out[name] = points
    return out


def plot_busbw(series, title: str, output: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in series.items():
        sizes = [p[0] for p in points]
        ax.plot(sizes, [p[1] for p in points], marker="o", markersize=3, label=name)
        ax.fill_between(sizes, [p[2] for p in points], [p[3] for p in points], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("message size (bytes)", fontsize=8)
    ax.set_ylabel("us per operation (median; band: rounds' range)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path,
                        help="harness.py --out files, or one busbw.py --out file")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    first = json.loads(args.json[0].read_text())
    if str(first.get("schema", "")).startswith("commsched.bench.busbw/"):
        if len(args.json) > 1:
            parser.error("a busbw.py JSON is plotted alone: give one file")
        series = busbw_series(first)
        if not series:
            print("plot_modes: no measured variant in the busbw file", file=sys.stderr)
            return 1
        settings = first.get("settings", {})
        plot_busbw(series, f"all-reduce, {settings.get('world_size')} ranks, "
                           f"{settings.get('regime')}", args.output)
        print(f"plot_modes: wrote {args.output}")
        return 0
    data = panels(args.json)
    if not data:
        print("plot_modes: no measured mode in the given files", file=sys.stderr)
        return 1
    plot(data, args.output)
    print(f"plot_modes: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
