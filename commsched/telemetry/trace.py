"""``commsched trace RUN_DIR -o trace.json``: a Chrome / Perfetto trace of a run.

Trace Event Format (the JSON ui.perfetto.dev and chrome://tracing open): an object with a
``traceEvents`` array and ``displayTimeUnit``; ``ts``/``dur`` in microseconds (floats keep
nanosecond detail), measured from the earliest event of the run (its absolute
``time.time_ns()`` is in ``otherData.t0_ns``). Layout:

* one process per rank (pid = rank), named with host and GPU;
* thread "application iterations": one slice per iteration, args = the report's row;
* per lane, thread "lane g0 iterations": the submit window (first submission -> flush)
  and the exposed communication (flush -> last chunk completion) of each iteration;
* per lane, threads "lane g0 comm #k": one complete ("X") slice per chunk step, args bytes,
  op, step, priority, busbw, and the NVLink DATA TX bytes it put on the links (its share
  of the counters, see ``analysis``) beside what a ring should put there; slices that
  overlap in time (several chunks in flight under the credit window) go to separate
  threads, because slices on one thread must nest;
* counters ("C"): "NVLink GB/s" (tx/rx summed over links) and, when sampled per link,
  "NVLink link L GB/s", each the rate between consecutive samples; per application
  iteration, from its start, "NVLink TX MB per iteration" (counted and expected),
  "communication ms per iteration" (busy, exposed) and, where the run directory holds a
  floor (``floor.json``), "efficiency" (floor / iteration time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from ..floor import load_floor
from .analysis import RankData, expected_link_bytes, iteration_rows
from .errors import TelemetryError
from .metrics import KIB
from .store import RunData, load_run

__all__ = ["build_trace", "main", "trace_main"]

PROG = "commsched trace"
_APP_TID = 1               # lane threads are numbered after it, in order of appearance


def _slots(spans: List[Tuple[int, int]]) -> List[int]:
    """Greedy interval colouring: the slot (thread) of each ``(start, end)`` span such that
    spans in one slot do not overlap. Returned in the input order."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    ends: List[int] = []
    out = [0] * len(spans)
    for i in order:
        start, end = spans[i]
        for s, last in enumerate(ends):
            if last <= start:
                ends[s] = end
                out[i] = s
                break
        else:
            ends.append(end)
            out[i] = len(ends) - 1
    return out


class _Builder:
    def __init__(self, t0_ns: int):
        self.t0 = t0_ns
        self.events: List[dict] = []

    def us(self, t_ns: int) -> float:
        return round((t_ns - self.t0) / 1000.0, 3)

    def meta(self, pid: int, tid: int, kind: str, value) -> None:
        key = "sort_index" if kind.endswith("sort_index") else "name"
        self.events.append({"name": kind, "ph": "M", "pid": pid, "tid": tid,
                            "args": {key: value}})

    def slice(self, pid: int, tid: int, name: str, t0: int, t1: int, cat: str,
              args: Optional[dict] = None) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": self.us(t0),
                            "dur": round(max(t1 - t0, 0) / 1000.0, 3), "pid": pid, "tid": tid,
                            "args": args or {}})

    def instant(self, pid: int, tid: int, name: str, t: int, cat: str) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self.us(t),
                            "pid": pid, "tid": tid})

    def counter(self, pid: int, name: str, t: int, values: Dict[str, float],
                cat: str = "nvlink") -> None:
        self.events.append({"name": name, "cat": cat, "ph": "C", "ts": self.us(t),
                            "pid": pid, "tid": 0, "args": values})


def build_trace(run: RunData) -> dict:
    """The trace of ``run`` as a Trace Event Format dict."""
    starts = [r["start_ns"] for r in run.runs if r.get("start_ns")]
    starts += [c["t_submit_ns"] for c in run.comm_ops]
    t0 = min(starts) if starts else 0
    b = _Builder(t0)
    floor, _ = load_floor(run.run_dir)
    for info in run.runs:
        rank = info["rank"]
        gpu = f", GPU {info['gpu_index']} {info['gpu_name']}" if info.get("gpu_name") else ""
        b.meta(rank, 0, "process_name", f"rank {rank} ({info['host']}{gpu})")
        b.meta(rank, 0, "process_sort_index", rank)
        data = RankData.build(run, rank)
        rows = iteration_rows(data, floor)
        _app_track(b, data, rows)
        _lane_tracks(b, run, data)
        _counters(b, data)
        _iteration_counters(b, data.rank, rows)
    return {"traceEvents": b.events, "displayTimeUnit": "ms",
            "otherData": {"producer": "commsched trace", "run_dir": run.run_dir,
                          "t0_ns": t0}}


# The report's columns that each application iteration's slice carries.
_ITERATION_ARGS = ("iteration_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_pct",
                   "efficiency", "bytes", "busbw_gbps", "nvlink_tx_gbps", "nvlink_tx_bytes",
                   "nvlink_expected_bytes", "nvlink_tx_ratio")


def _app_track(b: _Builder, data: RankData, rows: List[dict]) -> None:
    b.meta(data.rank, _APP_TID, "thread_name", "application iterations")
    b.meta(data.rank, _APP_TID, "thread_sort_index", _APP_TID)
    for row in rows:
        if row["t_end_ns"] is None:
            continue
        args = {k: row[k] for k in _ITERATION_ARGS}
        b.slice(data.rank, _APP_TID, f"iteration {row['iteration']}", row["t_begin_ns"],
                row["t_end_ns"], "iteration", args)


def _lane_tracks(b: _Builder, run: RunData, data: RankData) -> None:
    lanes = sorted({i["lane"] for i in data.lane_iterations}
                   | {lane for lane, _ in data.chunks_by_lane_iter})
    next_tid = _APP_TID + 1
    for lane in lanes:
        base = next_tid
        its = [i for i in data.lane_iterations if i["lane"] == lane]
        spans, labels = [], []
        for i in its:
            if i["t_first_submit_ns"] is not None and i["t_flush_ns"] is not None:
                spans.append((i["t_first_submit_ns"], i["t_flush_ns"]))
                labels.append((f"submit {lane}:{i['iteration']}", i))
            if i["t_flush_ns"] is not None and i["t_last_end_ns"] is not None \
                    and i["t_last_end_ns"] > i["t_flush_ns"]:
                spans.append((i["t_flush_ns"], i["t_last_end_ns"]))
                labels.append((f"exposed comm {lane}:{i['iteration']}", i))
        slots = _slots(spans)
        next_tid = base + max(slots, default=0) + 1
        for s in sorted(set(slots)):
            b.meta(data.rank, base + s, "thread_name", f"lane {lane} iterations")
            b.meta(data.rank, base + s, "thread_sort_index", base + s)
        for (t_a, t_b), slot, (name, i) in zip(spans, slots, labels):
            b.slice(data.rank, base + slot, name, t_a, t_b, "iteration", {
                "iteration": i["iteration"], "requests": i["requests"], "chunks": i["chunks"],
                "bytes": i["nbytes"], "planned": i["planned"], "complete": i["complete"]})
        for i in its:
            if i["t_flush_ns"] is not None:
                b.instant(data.rank, base, f"flush {lane}:{i['iteration']}", i["t_flush_ns"],
                          "iteration")

        chunks = [c for (ln, _), cs in data.chunks_by_lane_iter.items() if ln == lane
                  for c in cs]
        chunks.sort(key=lambda c: (c["t_start_ns"], c["t_end_ns"]))
        comm_base = next_tid
        slots = _slots([(c["t_start_ns"], c["t_end_ns"]) for c in chunks])
        next_tid = comm_base + max(slots, default=0) + 1
        for s in sorted(set(slots)):
            b.meta(data.rank, comm_base + s, "thread_name", f"lane {lane} comm #{s}")
            b.meta(data.rank, comm_base + s, "thread_sort_index", comm_base + s)
        for c, slot in zip(chunks, slots):
            nvl = data.chunk_tx.get(id(c))
            b.slice(data.rank, comm_base + slot,
                    f"{c['step']} {c['request_key']}[{c['chunk_index']}]",
                    c["t_start_ns"], c["t_end_ns"], "comm", {
                        "bytes": c["nbytes"], "op": c["op"], "step": c["step"],
                        "decompose": c["decompose"], "priority": c["priority"],
                        "iteration": c["iteration"], "chunk": f"{c['chunk_index']}/"
                                                            f"{c['num_chunks']}",
                        "busbw_gbps": c["busbw_gbps"], "algbw_gbps": c["algbw_gbps"],
                        "queued_ms": (c["t_dispatch_ns"] - c["t_submit_ns"]) / 1e6,
                        "nvlink_tx_bytes": None if nvl is None else int(round(nvl)),
                        "nvlink_expected_bytes": expected_link_bytes(c),
                        "ok": bool(c["ok"]), "error": c["error"]})


def _counters(b: _Builder, data: RankData) -> None:
    for link in sorted(data.sample_times):
        times = data.sample_times[link]
        tx, rx = data.sample_tx[link], data.sample_rx[link]
        name = "NVLink GB/s" if link == -1 else f"NVLink link {link} GB/s"
        for k in range(1, len(times)):
            dt = times[k] - times[k - 1]
            if dt <= 0:
                continue
            values = {}
            for key, series in (("tx", tx), ("rx", rx)):
                a, c = series[k - 1], series[k]
                if a is not None and c is not None and c >= a:
                    values[key] = round((c - a) * KIB / dt, 3)    # bytes/ns == GB/s
            if values:
                b.counter(data.rank, name, times[k - 1], values)
        if len(times) > 1:
            b.counter(data.rank, name, times[-1], {"tx": 0.0, "rx": 0.0})


def _iteration_counters(b: _Builder, rank: int, rows: List[dict]) -> None:
    """Per application iteration, from its start: its communication busy and exposed
    time, its efficiency against the floor, and the NVLink TX bytes its collectives put on
    the links beside what they should have."""
    for row in rows:
        if row["t_end_ns"] is not None and row["comm_ms"] is not None \
                and row["exposed_comm_ms"] is not None:
            b.counter(rank, "communication ms per iteration", row["t_begin_ns"],
                      {"busy": round(row["comm_ms"], 6),
                       "exposed": round(row["exposed_comm_ms"], 6)}, "iteration")
        if row["efficiency"] is not None:
            b.counter(rank, "efficiency", row["t_begin_ns"],
                      {"efficiency": round(row["efficiency"], 6)}, "iteration")
        if row["nvlink_tx_bytes"] is not None and row["nvlink_expected_bytes"] is not None:
            b.counter(rank, "NVLink TX MB per iteration", row["t_begin_ns"],
                      {"counted": round(row["nvlink_tx_bytes"] / 1e6, 6),
                       "expected": round(row["nvlink_expected_bytes"] / 1e6, 6)})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Write a Chrome/Perfetto trace (open it in ui.perfetto.dev) "
                               "of a commsched telemetry run directory.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the COMMSCHED_TELEMETRY_DIR of the run")
    p.add_argument("-o", "--output", metavar="TRACE.json", default="trace.json",
                   help="output file (default: trace.json)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        run = load_run(args.run_dir)
        for note in run.notes():
            print(f"{PROG}: {note}", file=sys.stderr)
        trace = build_trace(run)
        _write_atomic(args.output, trace)
    except TelemetryError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"{args.output}: {n} events from {len(load_ranks(trace))} ranks; "
          f"open it in https://ui.perfetto.dev")
    return 0


def _write_atomic(path: str, trace: dict) -> None:
    """Temp file next to ``path``, then rename: a failed write (disk full) leaves ``path``
    as it was instead of a truncated trace. Anything but a regular file (``/dev/stdout``,
    a FIFO, a directory) is opened and written as given."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        return
    path = os.path.realpath(path)       # through a symlink, as open() would write
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # what open(path, "w") would have given
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_ranks(trace: dict) -> List[int]:
    return sorted({e["pid"] for e in trace["traceEvents"]})


trace_main = main      # the name commsched.cli looks up


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
