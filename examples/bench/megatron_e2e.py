"""Megatron-LM end to end: stock against the same launch script patched by `commsched
patch-launch`, in one command (the protocol's comparison 7, rows 7a/7b).

    python examples/bench/megatron_e2e.py --megatron /path/to/Megatron-LM --out megatron.json

For each regime (``--regimes``), round (``--rounds``) and setting (``--settings``) it runs
``examples/megatron/run_gpt.sh`` from the Megatron-LM checkout twice, stock and patched
(``COMMSCHED=1``, plus any ``--set COMMSCHED_...=VALUE``), one after the other, and reads
each log's "elapsed time per iteration (ms)" and "lm loss" at every logged iteration.
Settings:

  no_overlap       gradients all-reduced after the backward
  overlap_grad     --overlap-grad-reduce
  distopt_overlap  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather

Rounds alternate which variant runs first (stock first in odd rounds), so that a drift of
the machine over a round does not favour one. ``--variants`` picks the launches of a round:
``stock`` and ``patched`` (the default), ``launcher`` (``--launcher-only`` adds it: the
patched script with ``COMMSCHED=0``, i.e. under ``commsched.run`` with nothing patched,
which separates what the launcher costs from what the scheduler does) and ``interleaved``:
the patched script, its training steps switched between commsched's methods and
megatron's own in blocks of ``--interleave`` iterations (``worker_site/bench_interleave.py``;
the first of each block, where the switch happens, is left out; odd rounds start with a
patched block, even rounds with a stock one), so that both are measured in one process,
without the offset two processes of the same launch differ by (``--variants interleaved``
alone runs no stock launch: the losses are then compared between rounds that start with
opposite variants, each of which ran every iteration with the other one, and not at all
with one round). It needs
``--log-interval 1``; its ratio is the mean patched iteration over the mean stock one, and
the table adds patched - stock between adjacent whole blocks (non-overlapping pairs, mean
and standard error), which a slow drift of the machine does not move.

Reported per regime and setting: the median over rounds of each run's mean time per logged
iteration after ``--skip`` iterations (with the rounds' spread), patched / stock (and
launcher / stock), each round's own patched / stock (its two runs ran minutes apart), the
same ratio of the median logged interval of all rounds pooled (``--log-interval 1``: of
the median iteration), each variant's peak memory (the largest "max allocated" of
Megatron's memory reports, any rank and round), and whether the losses were identical at
every logged iteration of every round; and per variant (separate launches and
interleaved) the median, p90 and max of the logged intervals after ``--skip``, all rounds
pooled, with how many are above 1.2x the median (stalls; per run, above its own median;
``--log-interval 1`` makes each interval one iteration). The model is the protocol's GPT (24 layers x 1024,
seq 1024, micro-batch 8; ``--layers``, ``--hidden``, ``--micro-batch``, and any other
pretrain_gpt.py arguments with ``--megatron-args``). commsched is put
on the workers' path from this checkout (no install needed). Output: a progress line per
run (its mean time per iteration, or its error), JSON (``--out``, rewritten after every
stock/patched pair, so that a launch cut short keeps what it measured), every run's log
under ``--log-dir``, a table last.

``--thread-cpu``: every worker samples its threads' CPU time (``worker_site/``, put
first on the workers' PYTHONPATH; every 0.2 s); each run then reports rank 0's CPU per
iteration, per thread and for the process, between the logged iterations ``--skip`` and
the last (from the timestamps of Megatron's log lines), and the table the process's,
median over rounds: what a variant costs the host, where an iteration's time is the
host's.
Exit status 1 when a run failed or its log had no iteration times.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import benchlib  # first: puts the checkout on sys.path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPT = ROOT / "examples" / "megatron" / "run_gpt.sh"
WORKER_SITE = Path(__file__).resolve().parent / "worker_site"
SETTINGS = {"no_overlap": "0", "overlap_grad": "grad", "distopt_overlap": "1"}
# NCCL environment of each regime (None: unset); NVLink multicast stays off.
REGIMES: Dict[str, Dict[str, Optional[str]]] = {
    "nvlink": {"NCCL_P2P_DISABLE": None, "NCCL_SHM_DISABLE": None},
    "host": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": None},
    "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_TIME = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9]+(?:\.[0-9]*)?)")
_LOSS = re.compile(r"\blm loss:\s*([-+0-9.Ee]+)\s*\|")
_STAMP = re.compile(r"^\s*\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]")
# Megatron's report_memory line (after the first logged iterations), per rank
_MEMORY = re.compile(r"memory \(MB\).*?\bmax allocated:\s*([0-9]+(?:\.[0-9]*)?)")


class MegatronLog(NamedTuple):
    """The logged iterations of one Megatron-LM run, in order."""

    iterations: List[int]
    ms: List[float]          # elapsed time per iteration (ms), averaged over the interval
    loss: List[float]        # lm loss at the iteration
    # when the line was logged (time.time() of the machine's local clock), None without
    # a timestamp
    times: Optional[List[Optional[float]]] = None


def parse_megatron_log(text: str) -> MegatronLog:
    """Every training-log line of ``text`` with its iteration, time per iteration, lm loss
    and timestamp. Raises ValueError when no line has the first three (a failed or
    unfamiliar run)."""
    iterations, ms, loss, times = [], [], [], []
    for line in text.splitlines():
        it, time_ms, lm = _ITERATION.search(line), _TIME.search(line), _LOSS.search(line)
        if it and time_ms and lm:
            iterations.append(int(it.group(1)))
            ms.append(float(time_ms.group(1)))
            loss.append(float(lm.group(1)))
            stamp = _STAMP.search(line)
            times.append(datetime.datetime.fromisoformat(stamp.group(1)).timestamp()
                         if stamp else None)
    if not iterations:
        raise ValueError("no Megatron-LM training log line with 'iteration N/M', 'elapsed "
                         "time per iteration (ms)' and 'lm loss'")
    return MegatronLog(iterations, ms, loss, times)


def peak_memory_mib(text: str) -> Optional[float]:
    """The largest "max allocated" (MiB, ``torch.cuda.max_memory_allocated``) any rank's
    memory report in the log gives, or None without one. Megatron reports it after the
    first logged iterations, the first optimizer steps included."""
    values = [float(m.group(1)) for m in _MEMORY.finditer(text)]
    return max(values) if values else None


def _cpu_at(series: List[tuple], t: float) -> int:
    """A thread's CPU ns at ``t`` from its samples ``[(t, ns)]``: interpolated between the
    samples around ``t``; 0 before its first (it had not started), its last after it."""
    if t <= series[0][0]:
        return 0 if t < series[0][0] else series[0][1]
    for (t0, n0), (t1, n1) in zip(series, series[1:]):
        if t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0)
    return series[-1][1]


def rank_cpu_per_iteration(directory: Path, rank: int, log: MegatronLog,
                           skip: int) -> Optional[Dict[str, object]]:
    """:func:`thread_cpu_per_iteration` of the process of ``rank`` that used the most CPU
    (the worker itself, not a process it spawned), from ``directory``'s sample files."""
    results = [thread_cpu_per_iteration(path, log, skip)
               for path in sorted(directory.glob(f"rank{rank}-pid*.jsonl"))]
    results = [r for r in results if r is not None]
    return max(results, key=lambda r: r["process_ms"]) if results else None


def thread_cpu_per_iteration(samples_path: Path, log: MegatronLog,
                             skip: int) -> Optional[Dict[str, object]]:
    """A process's CPU ms per iteration, per thread name and in all, between the logged
    iteration ``skip`` (the last logged at or before it) and the last logged one, from the
    samples ``worker_site/bench_thread_cpu.py`` wrote to ``samples_path`` and the log's timestamps. None
    where the log has no timestamps there or the samples do not cover the span."""
    if log.times is None:
        return None
    marks = [(it, t) for it, t in zip(log.iterations, log.times) if t is not None]
    start = [(it, t) for it, t in marks if it <= skip]
    if not start or marks[-1][0] <= start[-1][0] or not samples_path.is_file():
        return None
    (it0, t0), (it1, t1) = start[-1], marks[-1]
    series: Dict[str, List[tuple]] = {}
    names: Dict[str, str] = {}
    samples = 0
    for line in samples_path.read_text().splitlines():
        try:
            sample = json.loads(line)
        except ValueError:
            continue                      # a line cut short when the process ended
        samples += 1
        for tid, (name, ns) in sample["threads"].items():
            series.setdefault(tid, []).append((sample["t"], ns))
            names[tid] = name
    if not series or not (min(s[0][0] for s in series.values()) <= t0
                          and max(s[-1][0] for s in series.values()) >= t1):
        return None
    threads: Dict[str, float] = {}
    for tid, points in series.items():
        ms = (_cpu_at(points, t1) - _cpu_at(points, t0)) / 1e6 / (it1 - it0)
        threads[names[tid]] = threads.get(names[tid], 0.0) + ms
    return {"iterations": [it0, it1], "samples": samples,
            "process_ms": round(sum(threads.values()), 3),
            "threads_ms": {name: round(ms, 3) for name, ms in
                           sorted(threads.items(), key=lambda kv: -kv[1]) if ms >= 0.005}}


def steady_intervals(log: MegatronLog, skip: int) -> List[float]:
    """The time per iteration of every logged interval that starts after ``skip``
    iterations (the first intervals include compilation and warm-up)."""
    kept = [ms for it, ms, prev in zip(log.iterations, log.ms, [0] + log.iterations[:-1])
            if prev >= skip]
    if not kept:
        raise ValueError(f"no logged interval after iteration {skip} (logged: "
                         f"{log.iterations}); run more iterations or lower --skip")
    return kept


def _standalone(folder: Path, name: str):
    """Module ``name`` of ``folder``, a file that needs only the standard library at
    import (so, not megatron-core or torch)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def _interleave_module():
    """``worker_site/bench_interleave.py``."""
    return _standalone(WORKER_SITE, "bench_interleave")


# (anywhere in a line: two ranks' output can share one)
_SWITCH = re.compile(r"\[interleave\] iteration (\d+): (patched|stock)\b")


def check_interleaving(text: str, every: int, first: str, iterations: List[int]) -> None:
    """Raise ValueError unless the run's ``[interleave]`` lines show the switches the
    schedule expects: one at the first iteration and at each block start that ran."""
    expected_of = _interleave_module().block_variant
    seen = {int(it): variant for it, variant in _SWITCH.findall(text)}
    if not seen:
        raise ValueError("no '[interleave] iteration N: ...' line: the interleaving hook did "
                         "not run (worker_site/ not on the workers' path?)")
    last = max(iterations) if iterations else 0
    expected = {it: expected_of(it, every, first)
                for it in range(1, last + 1) if it == 1 or (it - 1) % every == 0}
    if seen != expected:
        wrong = sorted(set(seen.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"interleaving switches differ from blocks of {every} starting "
                         f"{first}: {wrong}")


def _interleaved_blocks(result: Dict[str, object]) -> Dict[int, tuple]:
    """An interleaved run's blocks by index: (variant, [(iteration, ms)]), each without its
    first iteration (the switch)."""
    every, first = result["interleave"]["every"], result["interleave"]["first"]
    variant_of = _interleave_module().block_variant
    blocks: Dict[int, tuple] = {}
    for it, ms in zip(result["iterations"], result["ms"]):
        if (it - 1) % every:
            block = (it - 1) // every
            if block not in blocks:
                blocks[block] = (variant_of(it, every, first), [])
            blocks[block][1].append((it, ms))
    return blocks


STALL_FACTOR = 1.2          # an iteration this much slower than the median is a stall


def iteration_stats(values: List[float]) -> Dict[str, float]:
    """``median``, ``p90`` and ``max`` of iteration times (ms), and ``stalls``: how many
    are above ``STALL_FACTOR`` x the median (a cycle collection inside an iteration
    shows there, not in a mean)."""
    if not values:
        raise ValueError("no iteration times")
    ordered = sorted(values)
    median = statistics.median(ordered)
    # p90: the nearest rank (an iteration that ran), not an interpolation between two
    p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)]
    return {"median": median, "p90": p90, "max": ordered[-1],
            "stalls": sum(v > STALL_FACTOR * median for v in ordered)}


def interleaved_intervals(result: Dict[str, object], skip: int) -> Dict[str, List[float]]:
    """An interleaved run's iteration times after ``skip``, per variant, without the first
    iteration of each block (the switch); needs every iteration logged."""
    iterations = result["iterations"]
    if any(b - a != 1 for a, b in zip(iterations, iterations[1:])):
        raise ValueError("interleaved: iterations were not logged one by one "
                         "(--log-interval 1)")
    out: Dict[str, List[float]] = {"patched": [], "stock": []}
    for variant, kept in _interleaved_blocks(result).values():
        out[variant].extend(ms for it, ms in kept if it > skip)
    if not out["patched"] or not out["stock"]:
        raise ValueError(f"interleaved: no iteration of both variants after {skip}")
    return out


def interleaved_block_pairs(result: Dict[str, object], skip: int) -> List[float]:
    """patched - stock (ms), between the means of two adjacent whole blocks (each without
    its first iteration), for non-overlapping pairs of blocks that start after ``skip``: a
    drift of the machine slower than two blocks cancels within a pair."""
    every = result["interleave"]["every"]
    blocks = _interleaved_blocks(result)
    whole = [j for j in sorted(blocks)
             if j * every >= skip and len(blocks[j][1]) == every - 1]
    diffs, j = [], 0
    while j + 1 < len(whole):
        a, b = whole[j], whole[j + 1]
        if b != a + 1:
            j += 1
            continue
        means = {blocks[k][0]: statistics.fmean(ms for _, ms in blocks[k][1]) for k in (a, b)}
        diffs.append(means["patched"] - means["stock"])
        j += 2
    return diffs


def run_once(script: Path, megatron: Path, env: Dict[str, str], log_path: Path,
             timeout_s: float, skip: int = 0) -> Dict[str, object]:
    """One launch; its log, parsed (``error`` set when it failed), and rank 0's CPU per
    iteration where the workers sampled it (``BENCH_THREAD_CPU_DIR``)."""
    try:
        proc = subprocess.run(["bash", str(script)], cwd=megatron, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
        text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        text, rc = out.decode(errors="replace") if isinstance(out, bytes) else out, "timeout"
    log_path.write_text(text)
    result: Dict[str, object] = {"log": str(log_path), "rc": rc, "error": None}
    try:
        log = parse_megatron_log(text)
        result.update(iterations=log.iterations, ms=log.ms, loss=log.loss,
                      peak_mib=peak_memory_mib(text))
        if env.get("BENCH_THREAD_CPU_DIR"):
            result["cpu"] = rank_cpu_per_iteration(
                Path(env["BENCH_THREAD_CPU_DIR"]), 0, log, skip)
    except ValueError as exc:
        result["error"] = f"rc {rc}: {exc}"
    if rc != 0 and result["error"] is None:
        result["error"] = f"exit status {rc}"
    return result


def run_intervals(result: Dict[str, object], skip: int) -> List[float]:
    """The logged intervals (ms per iteration) of a run that did not fail, after ``skip``
    iterations (``steady_intervals``); ValueError where none is left."""
    return steady_intervals(MegatronLog(result["iterations"], result["ms"], result["loss"]),
                            skip)


def run_line(result: Dict[str, object], skip: int) -> str:
    """One run's outcome as a progress line: its mean time per iteration, or its error."""
    if result["error"]:
        return f"failed: {result['error']} (log {result['log']})"
    try:
        if "interleave" in result:
            parts = interleaved_intervals(result, skip)
            return ", ".join(f"{name} {statistics.fmean(values):.1f} ms/iteration over "
                             f"{len(values)}" for name, values in parts.items())
        kept = run_intervals(result, skip)
    except ValueError as exc:
        return f"{exc} (log {result['log']})"
    return f"{statistics.fmean(kept):.1f} ms/iteration over {len(kept)} logged intervals"


VARIANTS = ("stock", "patched", "launcher")       # one launch each, measured as a whole
ALL_VARIANTS = (*VARIANTS, "interleaved")


def summarize(runs: List[Dict[str, object]], skip: int) -> Dict[str, object]:
    """Per (regime, setting): each variant's ms (median over rounds of each run's mean,
    min-max), patched / stock (``ratio``) and launcher / stock (``launcher_ratio``, where
    it ran); each round's own ratio of means (``ratio_rounds``, ``launcher_ratio_rounds``:
    whether the rounds agree); the same ratios of the median logged interval of all rounds
    pooled (``ratio_interval_median``: with ``--log-interval 1`` a typical iteration, which one
    slow iteration of a host-bound run does not move); and whether every variant's losses
    matched stock's in every round (``losses_compared``: "stock launch"). Without a stock
    launch, interleaved rounds that start with opposite variants are compared with each
    other instead (``losses_compared`` says so); None where neither ran. An interleaved
    run (see the module docstring) gives
    ``interleaved_ratio_rounds`` (each round's mean patched iteration over its mean stock
    iteration), ``interleaved_ratio`` (their median), the same of the pooled median
    iterations (``interleaved_ratio_median_iteration``) and the iterations compared.
    Every variant, launched separately and interleaved, also gets ``{variant}_stats``
    (``iteration_stats`` of its logged intervals after ``skip``, all rounds pooled) and
    ``{variant}_stalls_rounds`` (each run's count above 1.2x its own median); interleaved
    ones are named ``interleaved_{variant}_...``."""
    out: Dict[str, object] = {}
    # Without a stock launch: each row's interleaved losses by the variant they started with
    opposite: Dict[str, Dict[str, list]] = {}
    for run in runs:
        key = f"{run['regime']}/{run['setting']}"
        row = out.setdefault(key, {"regime": run["regime"], "setting": run["setting"],
                                   "stock_ms": [], "patched_ms": [], "losses_equal": True,
                                   "errors": []})
        stock = run.get("stock")              # (none with --variants interleaved alone)
        if stock is None:
            row["losses_equal"] = None        # nothing to compare them with
        means: Dict[str, float] = {}          # this round's, per variant
        for name in VARIANTS:
            result = run.get(name)
            if result is None:
                continue
            values = row.setdefault(f"{name}_ms", [])
            if result["error"]:
                row["errors"].append(f"{name} round {run['round']}: {result['error']}")
            else:
                try:
                    kept = run_intervals(result, skip)
                    means[name] = statistics.fmean(kept)
                    values.append(means[name])
                    row.setdefault(f"{name}_intervals_ms", []).extend(kept)
                    row.setdefault(f"{name}_stalls_rounds", []).append(
                        iteration_stats(kept)["stalls"])
                except ValueError as exc:
                    row["errors"].append(f"{name} round {run['round']}: {exc}")
            if stock is not None and (result["error"] or stock["error"]
                                      or result.get("loss") != stock.get("loss")):
                row["losses_equal"] = False
            if result.get("cpu"):
                row.setdefault(f"{name}_cpu_ms", []).append(result["cpu"]["process_ms"])
            if result.get("peak_mib"):
                row.setdefault(f"{name}_peak_mib", []).append(result["peak_mib"])
        interleaved = run.get("interleaved")
        if interleaved is not None:
            if interleaved.get("peak_mib"):
                row.setdefault("interleaved_peak_mib", []).append(interleaved["peak_mib"])
            if stock is None and not interleaved["error"]:
                opposite.setdefault(key, {}).setdefault(
                    interleaved["interleave"]["first"], []).append(interleaved.get("loss"))
            if interleaved["error"]:
                row["errors"].append(f"interleaved round {run['round']}: "
                                     f"{interleaved['error']}")
            else:
                try:
                    parts = interleaved_intervals(interleaved, skip)
                except ValueError as exc:
                    row["errors"].append(f"interleaved round {run['round']}: {exc}")
                else:
                    row.setdefault("interleaved_ratio_rounds", []).append(
                        statistics.fmean(parts["patched"]) / statistics.fmean(parts["stock"]))
                    row.setdefault("interleaved_block_diff_ms", []).extend(
                        interleaved_block_pairs(interleaved, skip))
                    for name, values in parts.items():
                        row.setdefault(f"interleaved_{name}_ms", []).extend(values)
                        row.setdefault(f"interleaved_{name}_stalls_rounds", []).append(
                            iteration_stats(values)["stalls"])
            if stock is not None and (interleaved["error"] or stock["error"]
                                      or interleaved.get("loss") != stock.get("loss")):
                row["losses_equal"] = False
        # Each round's own ratios: its runs ran minutes apart, closer than any two rounds.
        for name, ratio in (("patched", "ratio"), ("launcher", "launcher_ratio")):
            if "stock" in means and name in means:
                row.setdefault(f"{ratio}_rounds", []).append(means[name] / means["stock"])
    for key, row in out.items():
        by_first = opposite.get(key, {})
        if row["losses_equal"] is None and len(by_first) == 2:
            # Without a stock launch: rounds that start with opposite variants ran every
            # iteration with the other one, so equal losses mean equal training steps.
            losses = [loss for runs_ in by_first.values() for loss in runs_]
            row["losses_equal"] = all(losses) and all(loss == losses[0] for loss in losses)
            row["losses_compared"] = "interleaved rounds starting patched and stock"
        elif row["losses_equal"] is not None:
            row["losses_compared"] = "stock launch"
        ratios = row.get("interleaved_ratio_rounds")
        if ratios:
            row["interleaved_ratio"] = statistics.median(ratios)
            row["interleaved_ratio_median_iteration"] = (
                statistics.median(row["interleaved_patched_ms"])
                / statistics.median(row["interleaved_stock_ms"]))
            row["interleaved_iterations"] = {
                name: len(row[f"interleaved_{name}_ms"]) for name in ("patched", "stock")}
            for name in ("patched", "stock"):
                row[f"interleaved_{name}_stats"] = iteration_stats(row[f"interleaved_{name}_ms"])
            diffs = row.get("interleaved_block_diff_ms") or []
            if len(diffs) >= 2:
                row["interleaved_block_diff_mean_ms"] = statistics.fmean(diffs)
                row["interleaved_block_diff_se_ms"] = statistics.stdev(diffs) / len(diffs) ** 0.5
        for name in VARIANTS:
            values = row.get(f"{name}_ms")
            if values is not None:
                row[f"{name}_median_ms"] = statistics.median(values) if values else None
            intervals = row.get(f"{name}_intervals_ms")
            if intervals:
                row[f"{name}_interval_median_ms"] = statistics.median(intervals)
                row[f"{name}_stats"] = iteration_stats(intervals)
            cpu = row.get(f"{name}_cpu_ms")
            if cpu:
                row[f"{name}_cpu_median_ms"] = statistics.median(cpu)
        for name, ratio in (("patched", "ratio"), ("launcher", "launcher_ratio")):
            if f"{name}_ms" not in row:
                continue
            row[ratio] = (row[f"{name}_median_ms"] / row["stock_median_ms"]
                          if row["stock_median_ms"] and row[f"{name}_median_ms"] else None)
            typical = row.get(f"{name}_interval_median_ms")
            row[f"{ratio}_interval_median"] = (
                typical / row["stock_interval_median_ms"]
                if typical and row.get("stock_interval_median_ms") else None)
    return out


def stats_cell(row: Dict[str, object]) -> Optional[str]:
    """Each variant's ``iteration_stats`` (separate launches, then interleaved)."""
    parts = []
    for name in (*VARIANTS, "interleaved_patched", "interleaved_stock"):
        stats = row.get(f"{name}_stats")
        if stats:
            per_run = ", ".join(map(str, row.get(f"{name}_stalls_rounds", [])))
            parts.append(f"{name.replace('_', ' ')} {stats['median']:.1f} / "
                         f"{stats['p90']:.1f} / {stats['max']:.1f}, {stats['stalls']} "
                         f"({per_run})")
    return "; ".join(parts) or None


def table(summary: Dict[str, object]) -> str:
    launcher = any("launcher_ms" in row for row in summary.values())
    cpu = any("stock_cpu_median_ms" in row for row in summary.values())
    interleaved = any("interleaved_ratio" in row for row in summary.values())
    rows = []
    for row in summary.values():
        def cell(name):
            values = row.get(f"{name}_ms")
            if not values:
                return None
            return (f"{row[f'{name}_median_ms']:.1f} ({min(values):.1f}-{max(values):.1f})")

        def ratio(key):
            return f"{row[key]:.3f}" if row.get(key) else None

        def per_round(key):
            values = row.get(key)
            return ", ".join(f"{value:.3f}" for value in values) if values else None

        def cpu_cell(name):
            value = row.get(f"{name}_cpu_median_ms")
            return None if value is None else f"{value:.1f}"

        def peak_cell():
            peaks = [f"{name} {max(row[f'{name}_peak_mib']) / 1024:.1f}"
                     for name in ALL_VARIANTS if row.get(f"{name}_peak_mib")]
            return ", ".join(peaks) or None
        extra = [cell("launcher"), ratio("launcher_ratio"),
                 ratio("launcher_ratio_interval_median")] if launcher else []
        if cpu:
            extra += [cpu_cell(name) for name in VARIANTS if launcher or name != "launcher"]
        if interleaved:
            counts = row.get("interleaved_iterations")
            mean = row.get("interleaved_block_diff_mean_ms")
            extra += [ratio("interleaved_ratio"), per_round("interleaved_ratio_rounds"),
                      ratio("interleaved_ratio_median_iteration"),
                      None if mean is None else
                      f"{mean:+.1f} ({row['interleaved_block_diff_se_ms']:.1f}), "
                      f"{len(row['interleaved_block_diff_ms'])} pairs",
                      f"{counts['patched']} / {counts['stock']}" if counts else None]
        rows.append([row["regime"], row["setting"], cell("stock"), cell("patched"),
                     ratio("ratio"), per_round("ratio_rounds"),
                     ratio("ratio_interval_median"), *extra, stats_cell(row),
                     peak_cell(),
                     {True: "yes", False: "NO", None: "not compared"}[row["losses_equal"]]
                     + (" (opposite rounds)" if row.get("losses_compared", "").startswith(
                         "interleaved") else ""),
                     "; ".join(row["errors"])[:120] or None])
    extra = (["launcher only ms/iter", "launcher/stock", "launcher/stock (median interval)"]
             if launcher else [])
    if cpu:
        extra += [f"{name} CPU ms/iter (rank 0)" for name in VARIANTS
                  if launcher or name != "launcher"]
    if interleaved:
        extra += ["interleaved: patched/stock", "interleaved per round",
                  "interleaved (median iteration)",
                  "interleaved: patched - stock ms, adjacent blocks (s.e.)",
                  "interleaved iterations patched / stock"]
    return benchlib.markdown_table(
        ["regime", "setting", "7a stock ms/iter", "7b patched ms/iter", "patched/stock",
         "patched/stock per round", "patched/stock (median interval)", *extra,
         "iterations: median / p90 / max ms, count > 1.2x median (per run)", "peak GiB (max allocated, any rank)", "losses equal", "note"], rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron", required=True, type=Path,
                        help="root of a Megatron-LM checkout (pretrain_gpt.py, megatron/)")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--regimes", default="nvlink,host,sockets")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=100,
                        help="iterations per run (default 100; shorter runs scatter, see "
                             "benchmarks/megatron_e2e_2xH200_2026-11-27.md)")
    parser.add_argument("--skip", type=int, default=20,
                        help="iterations left out of the mean (default 20)")
    parser.add_argument("--variants", default="stock,patched",
                        help="launches per round and setting, from "
                             f"{', '.join(ALL_VARIANTS)} (default stock,patched; stock is "
                             "added to patched or launcher, which are compared with it; "
                             "interleaved alone runs no stock launch; its losses are then "
                             "compared between rounds that start with opposite variants, "
                             "with --rounds 2 or more)")
    parser.add_argument("--interleave", type=int, default=5, metavar="K",
                        help="the interleaved variant's block: K iterations patched, K "
                             "stock, ... (default 5)")
    parser.add_argument("--launcher-only", action="store_true",
                        help="also run the patched script with COMMSCHED=0 (commsched.run, "
                             "nothing patched)")
    parser.add_argument("--set", metavar="VAR=VALUE", action="append", default=[],
                        dest="settings_env",
                        help="a COMMSCHED* variable for the patched run, exported by its "
                             "launch script as `commsched patch-launch --set` writes it "
                             "(repeatable; e.g. COMMSCHED_POLICY=fifo); this script's own "
                             "environment passes no COMMSCHED* variable on")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--megatron-args", default="",
                        help="more pretrain_gpt.py arguments for every run, appended last "
                             "(e.g. \"--recompute-granularity full --recompute-method "
                             "uniform --recompute-num-layers 1\" for a shape that does not "
                             "fit otherwise)")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="Megatron's --log-interval (default 10); 1 logs every iteration")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="profile rank 0 of every run with torch.profiler over the 3 "
                             "iterations after --skip; the Chrome trace goes to "
                             "DIR/<run>/torch_profile/rank-0.json.gz (read it with "
                             "trace_overlap.py)")
    parser.add_argument("--thread-cpu", action="store_true",
                        help="sample every worker's per-thread CPU time; report rank 0's "
                             "CPU per iteration after --skip (worker_site/)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where each run's log goes (default: next to --out)")
    parser.add_argument("--run-timeout", type=float, default=300.0,
                        help="seconds one launch may take (default 300)")
    parser.add_argument("--out", type=Path, default=Path("megatron_e2e.json"))
    args = parser.parse_args(argv)
    try:
        args.settings_env = dict(_launch_script()._setting(arg)
                                 for arg in args.settings_env)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--set {error}")
    if "COMMSCHED" in args.settings_env:
        parser.error("--set COMMSCHED=...: the patched run has COMMSCHED=1 (and "
                     "--launcher-only a run with 0)")
    variants = args.variants.split(",")
    for value in variants:
        if value not in ALL_VARIANTS:
            parser.error(f"--variants: {value!r} is not one of {', '.join(ALL_VARIANTS)}")
    if args.launcher_only and "launcher" not in variants:
        variants.append("launcher")
    if "stock" not in variants and ("patched" in variants or "launcher" in variants):
        variants.insert(0, "stock")
    args.variants = ",".join(variants)
    if "interleaved" in variants:
        if args.interleave < 2:
            parser.error(f"--interleave must be >= 2 (the first iteration of each block is "
                         f"left out), got {args.interleave}")
        if args.log_interval != 1:
            parser.error("--variants interleaved needs --log-interval 1 (each iteration's "
                         "time, to tell the blocks apart)")
    for name, choices in (("settings", SETTINGS), ("regimes", REGIMES)):
        for value in getattr(args, name).split(","):
            if value not in choices:
                parser.error(f"--{name}: {value!r} is not one of {', '.join(choices)}")
    if not (args.megatron / "pretrain_gpt.py").is_file():
        parser.error(f"--megatron {args.megatron}: no pretrain_gpt.py there")
    if args.rounds < 1 or args.train_iters <= args.skip:
        parser.error("--rounds must be >= 1 and --train-iters larger than --skip")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.thread_cpu:
        period = os.environ.get("BENCH_THREAD_CPU_PERIOD_S", "0.2")
        try:
            ok = 0 < float(period) < 60
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--thread-cpu: BENCH_THREAD_CPU_PERIOD_S={period!r} is not a "
                         f"sampling period in seconds (0 < s < 60)")
    if args.profile_dir is not None and args.train_iters < args.skip + 4:
        parser.error("--profile-dir profiles iterations skip+1 .. skip+3: --train-iters "
                     "must be at least --skip + 4")
    return args


def _launch_script():
    """This checkout's ``megatron_patches/launch_script.py``, which ``commsched
    patch-launch`` runs."""
    return _standalone(ROOT / "megatron_patches", "launch_script")


def extra_args(args: argparse.Namespace, run_name: str) -> str:
    """pretrain_gpt.py arguments appended by run_gpt.sh (``EXTRA_ARGS``) for one run."""
    extra = ["--log-interval", str(args.log_interval)]
    if args.profile_dir is not None:
        # Megatron writes the trace next to the TensorBoard directory.
        extra += ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0",
                  "--profile-step-start", str(args.skip + 1),
                  "--profile-step-end", str(args.skip + 4),
                  "--tensorboard-dir", str(args.profile_dir.resolve() / run_name / "tb")]
    return " ".join(extra + shlex.split(args.megatron_args))


def write_document(args: argparse.Namespace, runs: List[Dict[str, object]],
                   system: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    """Write the runs so far, and their summary, to ``--out``; returns the summary.
    ``system``: ``benchlib.system_info()``, read once the runs ended (it queries the GPUs
    from this process), empty before."""
    summary = summarize(runs, args.skip)
    document = {"schema": "commsched.bench.megatron_e2e/1", "created_utc": benchlib.utc_now(),
                "command": [sys.executable, *sys.argv], "settings": {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "system": system, "env": benchlib.relevant_env(),
                "runs": runs, "summary": summary}
    benchlib.write_json(args.out, document)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    patch_script = _launch_script().patch_script

    log_dir = args.log_dir or args.out.with_suffix("").with_name(args.out.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="commsched-megatron-") as tmp:
        tmp_path = Path(tmp)
        stock_script = tmp_path / "run_gpt.sh"
        shutil.copy(LAUNCH_SCRIPT, stock_script)
        patched_script = tmp_path / "run_gpt_commsched.sh"
        patched_script.write_text(patch_script(LAUNCH_SCRIPT.read_text(),
                                               {"COMMSCHED": "1", **args.settings_env}))
        scripts = {"stock": stock_script, "patched": patched_script,
                   "interleaved": patched_script}
        if "launcher" in args.variants.split(","):
            scripts["launcher"] = tmp_path / "run_gpt_launcher.sh"
            scripts["launcher"].write_text(
                patch_script(LAUNCH_SCRIPT.read_text(), {"COMMSCHED": "0"}))
        variants = [(name, scripts[name]) for name in args.variants.split(",")]
        site = benchlib.commsched_site(tmp_path)
        base = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
        base.update(NCCL_NVLS_ENABLE="0", TRAIN_ITERS=str(args.train_iters),
                    MICRO_BATCH_SIZE=str(args.micro_batch), GPUS_PER_NODE=str(args.gpus),
                    NUM_LAYERS=str(args.layers), HIDDEN_SIZE=str(args.hidden),
                    NUM_HEADS=str(args.heads),
                    # the torchrun of the Python running this script
                    PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                          base.get("PATH", "")]),
                    PYTHONPATH=os.pathsep.join(
                        [str(site), str(args.megatron), base.get("PYTHONPATH", "")]))
        for regime in args.regimes.split(","):
            for round_ in range(1, args.rounds + 1):
                for setting in args.settings.split(","):
                    env = dict(base, OVERLAP=SETTINGS[setting])
                    for name, value in REGIMES[regime].items():
                        if value is None:
                            env.pop(name, None)
                        else:
                            env[name] = value
                    run = {"regime": regime, "setting": setting, "round": round_}
                    order = variants if round_ % 2 else variants[::-1]
                    run["order"] = [variant for variant, _ in order]
                    for variant, script in order:
                        name = f"{regime}_{setting}_r{round_}_{variant}"
                        log_path = log_dir / f"{name}.log"
                        run_env = dict(env, EXTRA_ARGS=extra_args(args, name),
                                       MASTER_PORT=str(benchlib.free_port()))
                        if args.thread_cpu or variant == "interleaved":
                            run_env["PYTHONPATH"] = os.pathsep.join(
                                [str(WORKER_SITE), env["PYTHONPATH"]])
                        if args.thread_cpu:
                            samples = log_dir / f"{name}_cpu"
                            shutil.rmtree(samples, ignore_errors=True)
                            run_env["BENCH_THREAD_CPU_DIR"] = str(samples)
                        blocks = None
                        if variant == "interleaved":
                            blocks = {"every": args.interleave,
                                      "first": "patched" if round_ % 2 else "stock"}
                            run_env.update(BENCH_INTERLEAVE=str(blocks["every"]),
                                           BENCH_INTERLEAVE_FIRST=blocks["first"])
                        print(f"[megatron] {regime} {setting} round {round_}: {variant}",
                              flush=True)
                        result = run[variant] = run_once(script, args.megatron, run_env,
                                                         log_path, args.run_timeout, args.skip)
                        if blocks is not None:
                            result["interleave"] = blocks
                            if not result["error"]:
                                try:
                                    check_interleaving(log_path.read_text(), blocks["every"],
                                                       blocks["first"], result["iterations"])
                                except ValueError as exc:
                                    result["error"] = str(exc)
                        print(f"[megatron]   {run_line(result, args.skip)}", flush=True)
                    runs.append(run)
                    # (after every pair: a launch cut short keeps what it measured)
                    write_document(args, runs, {})
    summary = write_document(args, runs, benchlib.system_info())
    print(f"[megatron] wrote {args.out}", flush=True)
    print("", flush=True)
    print(table(summary), flush=True)
    failed = any(row["errors"] for row in summary.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
