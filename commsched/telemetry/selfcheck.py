"""GPU self-check of the NVLink telemetry: do NVML DATA counters see the bytes NCCL moves?

Runs NCCL all-reduces of known sizes with the recorder and the NVLink sampler on, then
compares each measurement window's DATA TX/RX bytes summed over links with the ring
all-reduce payload of a rank, ``ops * 2 (n-1) / n * bytes``. Every window must be within
``RATIO_TOLERANCE`` (the median and the worst window are reported); docs/telemetry.md
links what it found.

Measurement protocol. NVML's cumulative NVLink counters lag the traffic ([Note: NVLink
counters] in docs/design.md): read right after ``torch.cuda.synchronize()`` they may miss
the tail of an all-reduce, which then shows up in the next window. So a window is bounded
by quiescent boundaries; at each boundary every rank does::

    synchronize(); barrier(); synchronize()    # every rank's traffic of the window is over
    settle                                     # poll the aggregate DATA TX/RX fields every
                                               # settle_poll_ms until settle_stable
                                               # consecutive reads are equal (at most
                                               # settle_ms); the counters are now settled
    recorder.step(); recorder.flush()          # the boundary sample: taken after settling,
                                               # so it is the settled value
    barrier()                                  # no rank starts the next window before every
                                               # rank has its boundary sample

and each window runs ``ops_per_iter`` all-reduces (default: enough to move >= 1 GiB, at
most 1024), so that whatever skew is left is small against the window. The settle polls
use their own NVML handle (the sampler's per-link query is slow); the check
opens the recorder with a long sampling period so that no periodic sample can land on a
boundary, and stores its chunk and iteration records after the last boundary (their times
place them in their windows), so that no sample the writer asks for does either.

Run on one node with at least two NVLink-connected GPUs::

    NCCL_ALGO=Ring torchrun --nproc-per-node 2 -m commsched.telemetry.selfcheck \\
        --sizes 16MiB,256MiB --iters 10 --dir /tmp/nvlink_check

NCCL_ALGO=Ring matters: NVLS (NVSwitch multicast) and tree all-reduces move other amounts.
``--settle-ms 0`` turns settling off (the old protocol, for comparison). The run directory is
a normal telemetry run, so ``commsched report`` / ``commsched trace`` work on it too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import UnavailableError
from .metrics import KIB, median
from .nvml import (FIELD, HEALTH_COUNTERS, SCOPE_ALL_LINKS, NvmlBackend, discover_links,
                   resolve_gpu)

__all__ = ["nvlink_allreduce_check", "drive_allreduces", "compare", "main", "CounterProbe",
           "settle_counters", "auto_ops_per_iter"]

RATIO_TOLERANCE = 0.02      # |measured / expected - 1| accepted, for every window
WINDOW_BYTES = 1 << 30      # default window: at least this many bytes all-reduced ...
MAX_AUTO_OPS = 1024         # ... with at most this many all-reduces
SETTLE_MS = 200.0           # settle bound at a boundary
SETTLE_POLL_MS = 5.0        # interval between settle reads
SETTLE_STABLE = 2           # consecutive equal reads that count as settled
CHECK_PERIOD_MS = 10_000    # the check's sampler period: boundaries only, no periodic samples


def auto_ops_per_iter(size: int) -> int:
    """All-reduces per window by default: enough to all-reduce ``WINDOW_BYTES`` (4 for
    256 MiB, 64 for 16 MiB), at most ``MAX_AUTO_OPS``. The same on every rank (no timing),
    which it must be: ranks disagreeing on the count would hang in NCCL."""
    return max(1, min(MAX_AUTO_OPS, math.ceil(WINDOW_BYTES / max(int(size), 1))))


class CounterProbe:
    """Reads one GPU's DATA TX/RX counters summed over links (KiB) for the settle polls,
    through its own backend: NVML is thread-safe and reference-counts init/shutdown, so this
    runs beside the sampler thread. Reads the aggregate fields (scope all links, one short
    query); where those are unsupported, the active links' fields summed (``mode``
    ``"per-link"``, a slower query). Keeps each read's latency."""

    AGGREGATE = [(FIELD["data_tx"], SCOPE_ALL_LINKS), (FIELD["data_rx"], SCOPE_ALL_LINKS)]

    def __init__(self, backend: NvmlBackend, selector,
                 clock: Callable[[], int] = time.perf_counter_ns):
        self.backend = backend
        self.selector = selector
        self.clock = clock
        self.gpu = None
        self.mode = "aggregate"
        self._query = list(self.AGGREGATE)
        self.latencies_ns: List[int] = []

    def open(self) -> "CounterProbe":
        self.backend.init()
        self.gpu = resolve_gpu(self.backend, self.selector)
        if None in self.backend.read_fields(self.gpu.index, self._query):
            active = [l.link for l in discover_links(self.backend, self.gpu) if l.state == 1]
            self.mode = "per-link"
            self._query = [(FIELD[c], l) for c in ("data_tx", "data_rx") for l in active]
        return self

    def read(self) -> Tuple[Optional[int], Optional[int]]:
        t0 = self.clock()
        values = self.backend.read_fields(self.gpu.index, self._query)
        self.latencies_ns.append(self.clock() - t0)
        if self.mode == "aggregate":
            return tuple(values)
        half = len(values) // 2
        return tuple(None if not part or None in part else sum(part)
                     for part in (values[:half], values[half:]))

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except Exception:
            pass


def settle_counters(read: Callable[[], Tuple], *, bound_s: float = SETTLE_MS / 1e3,
                    poll_s: float = SETTLE_POLL_MS / 1e3, stable: int = SETTLE_STABLE,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> Dict:
    """Poll ``read()`` every ``poll_s`` until ``stable`` consecutive reads are equal, for at
    most ``bound_s``. Returns ``{"value": last read (the settled value), "first": first
    read, "settled": True / False (bound reached) / None (counters unreadable), "settle_ms",
    "reads"}``."""
    t_start = clock()
    first = last = read()
    reads, run = 1, 1
    if any(v is None for v in first):
        return {"value": first, "first": first, "settled": None,
                "settle_ms": (clock() - t_start) * 1e3, "reads": reads}
    while run < stable and clock() - t_start < bound_s:
        sleep(poll_s)
        value = read()
        reads += 1
        run = run + 1 if value == last else 1
        last = value
    return {"value": last, "first": first, "settled": run >= stable,
            "settle_ms": (clock() - t_start) * 1e3, "reads": reads}


def nvlink_allreduce_check(sizes: Sequence[int] = (16 << 20, 256 << 20), iters: int = 10, *,
                           run_dir: Optional[str] = None, warmup: int = 2,
                           ops_per_iter: Optional[int] = None,
                           settle_ms: float = SETTLE_MS, settle_poll_ms: float = SETTLE_POLL_MS,
                           settle_stable: int = SETTLE_STABLE,
                           nvml_per_link: bool = True, verbose: bool = True) -> Dict:
    """All-reduce float32 tensors of each size in ``sizes`` (bytes), ``iters`` windows of
    ``ops_per_iter`` all-reduces each (None: :func:`auto_ops_per_iter`), and compare the
    NVLink DATA bytes of each window with ``ops * 2 (n-1) / n * size``. ``settle_ms`` bounds
    the settle at each boundary (0: no settling).

    Needs CUDA, NCCL and NVML; initialises the default process group from the torchrun
    environment if it is not initialised. Returns ``{"rank", "world_size", "nvml_status",
    "run_dir", "results": [per window], "summary": {size: medians and worst}, "ok"}``.

    Example::

        result = nvlink_allreduce_check([64 << 20], iters=5)
        assert result["ok"], result["summary"]
    """
    import torch
    import torch.distributed as dist

    from ..config import Config
    from .nvml import PynvmlBackend
    from .recorder import _gpu_selector, open_recorder

    if not torch.cuda.is_available():
        raise UnavailableError("nvlink_allreduce_check needs CUDA GPUs")
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    if run_dir is None:
        holder = [f"commsched_runs/nvlink_check_{time.strftime('%Y%m%d_%H%M%S')}"]
        dist.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    probe = None
    if settle_ms > 0:
        try:
            probe = CounterProbe(PynvmlBackend(), _gpu_selector(local_rank)).open()
        except Exception as exc:    # the sampler reports NVML problems in the store
            print(f"[rank {rank}] cannot read NVML for settling ({exc}); boundaries are not "
                  f"settled", file=sys.stderr)
            probe = None
    recorder = open_recorder(Config(telemetry_dir=run_dir), rank=rank, world_size=world,
                             local_rank=local_rank, device=local_rank,
                             nvml_period_ms=CHECK_PERIOD_MS, nvml_per_link=nvml_per_link)
    try:
        planned = drive_allreduces(
            recorder, sizes, iters, warmup, group_ranks=tuple(range(world)),
            make_tensor=lambda size: torch.ones(size // 4, dtype=torch.float32, device="cuda"),
            all_reduce=dist.all_reduce, synchronize=torch.cuda.synchronize,
            barrier=dist.barrier, ops_per_iter=ops_per_iter,
            read_counters=probe.read if probe is not None else None,
            settle_s=settle_ms / 1e3, settle_poll_s=settle_poll_ms / 1e3,
            settle_stable=settle_stable)
    finally:
        recorder.close()
        if probe is not None:
            probe.close()
    dist.barrier()
    out = compare(run_dir, rank, world, planned, sizes,
                  probe_latencies_ns=probe.latencies_ns if probe is not None else None)
    out["probe_mode"] = probe.mode if probe is not None else None
    if verbose:
        _print(out)
    return out


def drive_allreduces(recorder, sizes: Sequence[int], iters: int, warmup: int, *,
                     group_ranks, make_tensor: Callable, all_reduce: Callable,
                     synchronize: Callable, barrier: Callable,
                     ops_per_iter: Optional[int] = None,
                     read_counters: Optional[Callable[[], Tuple]] = None,
                     settle_s: float = SETTLE_MS / 1e3, settle_poll_s: float = SETTLE_POLL_MS / 1e3,
                     settle_stable: int = SETTLE_STABLE,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> List[Dict]:
    """Run ``iters`` windows of ``ops_per_iter`` all-reduces per size (after ``warmup``
    all-reduces in a window of their own), each window one application iteration of
    ``recorder`` between quiescent boundaries (see the module docstring). ``read_counters``
    returns the aggregate (DATA TX, DATA RX) KiB for the settle polls (None: no settling).

    Returns, per window: ``step`` (the step marker closing it), ``size``, ``ops``,
    ``time_ms`` (the window's all-reduces), ``open`` / ``close`` (the settle results of its
    boundaries, None without settling)."""
    from ..observer import ChunkRecord, IterationRecord

    planned: List[Dict] = []
    records: List[object] = []
    step_index = 0

    def boundary() -> Optional[Dict]:
        nonlocal step_index
        synchronize()
        barrier()                   # every rank's all-reduces, so every byte into this GPU
        synchronize()
        settled = None
        if read_counters is not None and settle_s > 0:
            settled = settle_counters(read_counters, bound_s=settle_s, poll_s=settle_poll_s,
                                      stable=settle_stable, clock=clock, sleep=sleep)
        recorder.step()
        recorder.flush()            # the boundary sample exists, taken after settling
        barrier()                   # nobody sends before every rank has sampled
        step_index += 1
        return settled

    last = boundary()               # iteration 0: start-up, not compared
    lane_iteration = 0
    for size in sizes:
        ops = int(ops_per_iter) if ops_per_iter else auto_ops_per_iter(size)
        x = make_tensor(size)
        for _ in range(warmup):
            all_reduce(x)
        last = boundary()
        for _ in range(iters):
            synchronize()
            t0 = time.time_ns()
            for _ in range(ops):
                all_reduce(x)
            synchronize()
            t1 = time.time_ns()
            for k in range(ops):
                a = t0 + (t1 - t0) * k // ops
                b = t0 + (t1 - t0) * (k + 1) // ops
                records.append(ChunkRecord("selfcheck", lane_iteration, f"ar{size}",
                                           "all_reduce", "all_reduce", "none", k, ops, size,
                                           "float32", tuple(group_ranks), 0, t0, a, a, b))
            records.append(IterationRecord("selfcheck", lane_iteration, t0, t0, 1, ops,
                                           size * ops, False))
            lane_iteration += 1
            opened = last
            last = boundary()
            planned.append({"step": step_index - 1, "size": size, "ops": ops,
                            "time_ms": (t1 - t0) / 1e6, "open": opened, "close": last})
        del x
    # Stored only now: the writer asks for a sample when an iteration's chunks complete,
    # which during the run could land on a boundary before the counters settled.
    for r in records:
        if isinstance(r, ChunkRecord):
            recorder.on_chunk(r)
        else:
            recorder.on_iteration(r)
    return planned


def compare(run_dir: str, rank: int, world: int, planned: List[Dict],
            sizes: Sequence[int], probe_latencies_ns: Optional[List[int]] = None) -> Dict:
    """Measured NVLink bytes of each planned window vs ``ops * 2 (n-1)/n * size``."""
    from .analysis import RankData, iteration_rows
    from .store import load_run

    run = load_run(run_dir)
    info = run.rows("runs", rank)[0]
    data = RankData.build(run, rank)
    rows = {r["iteration"]: r for r in iteration_rows(data)}
    raw = _raw_bytes(data, run, rank)
    results = []
    factor = 2.0 * (world - 1) / world
    for p in planned:
        r = rows.get(p["step"], {})
        ops = p.get("ops", 1)
        expected = factor * p["size"] * ops
        tx, rx = r.get("nvlink_tx_bytes"), r.get("nvlink_rx_bytes")
        opened, closed = p.get("open"), p.get("close")
        probe_tx = _delta_kib(opened, closed, 0)
        late_tx = _delta_kib(closed, closed, 0, first=True)
        results.append({
            "size": p["size"], "ops": ops, "step": p["step"], "time_ms": p["time_ms"],
            "op_ms": p["time_ms"] / ops,
            "busbw_gbps": expected / (p["time_ms"] * 1e6) if p["time_ms"] > 0 else None,
            "expected_bytes": expected, "data_tx_bytes": tx, "data_rx_bytes": rx,
            "raw_tx_bytes": raw.get(p["step"]),
            "ratio_tx": tx / expected if tx is not None and expected else None,
            "ratio_rx": rx / expected if rx is not None and expected else None,
            "link_tx_bytes": r.get("link_tx_bytes", {}),
            # the closing boundary: how long it settled, whether it did, and how many bytes
            # arrived in the counters after every rank had synchronized (the NVML lag)
            "settle_ms": closed["settle_ms"] if closed else None,
            "settled": closed["settled"] if closed else None,
            "late_tx_bytes": late_tx,
            # settled aggregate counter over the window; the stored DATA TX should equal it
            "probe_tx_bytes": probe_tx,
            "sample_minus_probe_bytes": tx - probe_tx if tx is not None and probe_tx is not None
            else None,
        })
    summary = {}
    for size in sizes:
        rs = [x for x in results if x["size"] == size]
        tx = [x["ratio_tx"] for x in rs if x["ratio_tx"] is not None]
        rx = [x["ratio_rx"] for x in rs if x["ratio_rx"] is not None]
        summary[size] = {
            "windows": len(rs), "ops": rs[0]["ops"] if rs else None,
            "ratio_tx_median": median(tx), "ratio_tx_worst": _worst(tx),
            "ratio_rx_median": median(rx), "ratio_rx_worst": _worst(rx),
            "missing": sum(1 for x in rs if x["ratio_tx"] is None or x["ratio_rx"] is None),
            "raw_over_data_median": median([x["raw_tx_bytes"] / x["data_tx_bytes"] for x in rs
                                            if x["raw_tx_bytes"] and x["data_tx_bytes"]]),
            "busbw_gbps_median": median([x["busbw_gbps"] for x in rs
                                         if x["busbw_gbps"] is not None]),
            "unsettled": sum(1 for x in rs if x["settled"] is False),
            "settle_ms_max": max((x["settle_ms"] for x in rs if x["settle_ms"] is not None),
                                 default=None),
            "late_tx_bytes_max": max((x["late_tx_bytes"] for x in rs
                                      if x["late_tx_bytes"] is not None), default=None),
            "sample_minus_probe_bytes_max": max(
                (abs(x["sample_minus_probe_bytes"]) for x in rs
                 if x["sample_minus_probe_bytes"] is not None), default=None),
        }
    ok = info["nvml_status"] == "ok" and bool(results) and all(
        s["windows"] > 0 and s["missing"] == 0
        and abs(s["ratio_tx_worst"] - 1) <= RATIO_TOLERANCE
        and abs(s["ratio_rx_worst"] - 1) <= RATIO_TOLERANCE
        for s in summary.values())
    latencies = [s["latency_ns"] for s in run.rows("nvlink_metrics", rank) if s["link"] == -1]
    health = run.rows("nvlink_health", rank)
    readable = [c for c in HEALTH_COUNTERS if any(h[c] is not None for h in health)]
    probe = probe_latencies_ns or []
    return {"rank": rank, "world_size": world, "run_dir": run_dir,
            "health_counters_readable": readable,
            "nvml_status": info["nvml_status"], "nvml_detail": info["nvml_detail"],
            "nvml_per_link": bool(info.get("nvml_per_link")),
            "links": run.rows("intra_node_topo", rank),
            "sample_latency_ms_median": median(latencies) / 1e6 if latencies else None,
            "sample_latency_ms_max": max(latencies) / 1e6 if latencies else None,
            "samples": len(latencies),
            "probe_latency_ms_median": median(probe) / 1e6 if probe else None,
            "probe_latency_ms_max": max(probe) / 1e6 if probe else None,
            "probe_reads": len(probe),
            "results": results, "summary": summary, "ok": ok}


def _delta_kib(a: Optional[Dict], b: Optional[Dict], slot: int,
               first: bool = False) -> Optional[int]:
    """Bytes between settle results: ``b["value"] - a["value"]`` (or, with ``first``,
    ``b["value"] - b["first"]``), None when either is unknown."""
    if not a or not b:
        return None
    x = a["first"][slot] if first else a["value"][slot]
    y = b["value"][slot]
    return None if x is None or y is None else int((y - x) * KIB)


def _worst(ratios: List[float]) -> Optional[float]:
    """The ratio furthest from 1."""
    return max(ratios, key=lambda r: abs(r - 1)) if ratios else None


def _raw_bytes(data, run, rank) -> Dict[int, int]:
    """RAW TX bytes (sum over links) between the samples taken at each step boundary."""
    from .metrics import boundary_indices
    samples = sorted((s["t_ns"], s["raw_tx_kib"]) for s in run.rows("nvlink_metrics", rank)
                     if s["link"] == -1 and s["raw_tx_kib"] is not None)
    times = [t for t, _ in samples]
    steps = [s["t_ns"] for s in data.steps]
    out = {}
    for k in range(1, len(steps)):
        ij = boundary_indices(times, steps[k - 1], steps[k])
        if ij is not None:
            out[data.steps[k]["step"]] = int((samples[ij[1]][1] - samples[ij[0]][1]) * KIB)
    return out


def _print(out: Dict) -> None:
    p = print
    p(f"[rank {out['rank']}/{out['world_size']}] NVML: {out['nvml_status']} "
      f"({out['nvml_detail']}); run dir {out['run_dir']}")
    active = [l for l in out["links"] if l["state"] == 1]
    if active:
        l0 = active[0]
        p(f"  {len(active)} active links, version {l0['version']}, {l0['speed_mbps']} MB/s, "
          f"remote {sorted({l['remote_type'] for l in active})}")
    p(f"  health counters readable: {', '.join(out['health_counters_readable']) or 'none'}")
    p(f"  {'size':>12} {'step':>5} {'ops':>4} {'ms/op':>7} {'busbw':>7} {'expected KiB':>13} "
      f"{'DATA tx KiB':>12} {'DATA rx KiB':>12} {'tx/exp':>7} {'rx/exp':>7} {'RAW/DATA':>8} "
      f"{'settle ms':>9} {'late KiB':>9} {'smp-set KiB':>11}")
    for r in out["results"]:
        def kib(v, w=12):
            return f"{v / 1024:>{w}.0f}" if v is not None else f"{'-':>{w}}"
        ratio_raw = (r["raw_tx_bytes"] / r["data_tx_bytes"]
                     if r["raw_tx_bytes"] and r["data_tx_bytes"] else None)
        settle = (f"{r['settle_ms']:>8.1f}{'' if r['settled'] is not False else '!'}"
                  if r["settle_ms"] is not None else f"{'-':>8}")
        p(f"  {r['size']:>12} {r['step']:>5} {r['ops']:>4} {r['op_ms']:>7.3f} "
          f"{_g(r['busbw_gbps'], 7, 1)} {r['expected_bytes'] / 1024:>13.0f} "
          f"{kib(r['data_tx_bytes'])} {kib(r['data_rx_bytes'])} {_f(r['ratio_tx'])} "
          f"{_f(r['ratio_rx'])} {_f(ratio_raw, 8)} {settle:>9} {kib(r['late_tx_bytes'], 9)} "
          f"{kib(r['sample_minus_probe_bytes'], 11)}")
    p("  (settle ms: closing boundary's settle, '!' = bound reached before two equal reads; "
      "late KiB: DATA TX that reached the counter after all ranks synchronized; smp-set: "
      "stored DATA TX minus the settled aggregate counter over the window)")
    for size, s in out["summary"].items():
        p(f"  size {size} x{s['ops']}: tx/expected median {_f(s['ratio_tx_median'])} worst "
          f"{_f(s['ratio_tx_worst'])}; rx/expected median {_f(s['ratio_rx_median'])} worst "
          f"{_f(s['ratio_rx_worst'])}; RAW/DATA {_f(s['raw_over_data_median'])}; busbw "
          f"{_g(s['busbw_gbps_median'], 0, 1)} GB/s; settle max {_g(s['settle_ms_max'], 0, 1)}"
          f" ms, {s['unsettled']} unsettled, late max "
          f"{_g(None if s['late_tx_bytes_max'] is None else s['late_tx_bytes_max'] / 1024)}"
          f" KiB")
    moved = [s["sample_minus_probe_bytes_max"] for s in out["summary"].values()
             if s["sample_minus_probe_bytes_max"]]
    if moved:
        p(f"  note: the counters moved after settling (up to {max(moved) / 1024:.0f} KiB "
          f"between the settled value and the boundary sample); if windows mismatch, try "
          f"--settle-stable 4 or --settle-poll-ms 10")
    if out["results"]:
        links = out["results"][-1]["link_tx_bytes"]
        if links:
            p("  last window, DATA tx KiB per link: " + ", ".join(
                f"{l}:{(b or 0) / 1024:.0f}" for l, b in sorted(links.items())))
    p(f"  => {'OK' if out['ok'] else 'MISMATCH'} (every window within "
      f"{RATIO_TOLERANCE:.0%} of expected, tx and rx)")
    if out["probe_reads"]:
        probe = (f"settle read ({out.get('probe_mode') or 'aggregate'} DATA TX/RX) median "
                 f"{_g(out['probe_latency_ms_median'], 0, 3)} ms, max "
                 f"{_g(out['probe_latency_ms_max'], 0, 3)} ms over {out['probe_reads']} reads")
    else:
        probe = "no settle reads (settling off)"
    p(f"  NVML sample latency: sampler query "
      f"({'per link' if out.get('nvml_per_link') else 'sums over links'}) median "
      f"{_g(out['sample_latency_ms_median'], 0, 3)} ms, max "
      f"{_g(out['sample_latency_ms_max'], 0, 3)} ms over {out['samples']} samples; {probe}")


def _f(v, width: int = 7) -> str:
    return f"{v:>{width}.4f}" if v is not None else f"{'-':>{width}}"


def _g(v, width: int = 0, digits: int = 0) -> str:
    return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def _parse_sizes(text: str) -> List[int]:
    from ..config import parse_bytes
    return [parse_bytes(s, "--sizes") for s in text.split(",") if s.strip()]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.telemetry.selfcheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16MiB,256MiB", type=_parse_sizes,
                   help="comma-separated all-reduce sizes (default 16MiB,256MiB)")
    p.add_argument("--iters", type=int, default=10, help="measured windows per size")
    p.add_argument("--dir", default=None, help="run directory (default commsched_runs/...)")
    p.add_argument("--sums-only", action="store_true",
                   help="sample link sums only (the cheaper query) instead of per link")
    p.add_argument("--ops-per-iter", type=int, default=0,
                   help="all-reduces per measured window (default 0: enough to all-reduce "
                        f"{WINDOW_BYTES >> 30} GiB, at most {MAX_AUTO_OPS})")
    p.add_argument("--warmup", type=int, default=2, help="warm-up all-reduces per size")
    p.add_argument("--settle-ms", type=float, default=SETTLE_MS,
                   help="at most this long at a boundary waiting for the NVLink counters to "
                        f"stop changing (default {SETTLE_MS:g}; 0: no settling)")
    p.add_argument("--settle-poll-ms", type=float, default=SETTLE_POLL_MS,
                   help=f"interval of the settle reads (default {SETTLE_POLL_MS:g})")
    p.add_argument("--settle-stable", type=int, default=SETTLE_STABLE,
                   help="consecutive equal reads that count as settled "
                        f"(default {SETTLE_STABLE})")
    args = p.parse_args(argv)
    if args.ops_per_iter < 0 or args.iters < 1 or args.warmup < 0 or args.settle_stable < 1:
        p.error("--ops-per-iter, --warmup must be >= 0, --iters and --settle-stable >= 1")
    out = nvlink_allreduce_check(args.sizes, args.iters, run_dir=args.dir, warmup=args.warmup,
                                 ops_per_iter=args.ops_per_iter or None,
                                 settle_ms=args.settle_ms, settle_poll_ms=args.settle_poll_ms,
                                 settle_stable=args.settle_stable,
                                 nvml_per_link=not args.sums_only)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0 if out["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
