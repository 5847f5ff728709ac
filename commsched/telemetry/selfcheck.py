"""GPU self-check of the NVLink telemetry: do NVML DATA counters see the bytes NCCL moves?

Runs NCCL all-reduces of known sizes with the recorder and the NVLink sampler on, one
all-reduce per application iteration (``step()`` between them), then compares each
iteration's DATA TX/RX bytes summed over links with the ring all-reduce payload of a rank,
``2 (n-1) / n * bytes``. Measured on 2x H200 (DESIGN.md): 256 MiB x10 moved 2,621,534 KiB
against 2,621,440 KiB expected, so the ratio should be within a fraction of a percent.

Run on one node with at least two NVLink-connected GPUs::

    NCCL_ALGO=Ring torchrun --nproc-per-node 2 -m commsched.telemetry.selfcheck \\
        --sizes 16MiB,256MiB --iters 10 --dir /tmp/nvlink_check

NCCL_ALGO=Ring matters: NVLS (NVSwitch multicast) and tree all-reduces move other amounts.
The run directory is a normal telemetry run, so ``commsched report`` / ``commsched trace``
work on it too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from .metrics import median
from .nvml import HEALTH_COUNTERS

__all__ = ["nvlink_allreduce_check", "drive_allreduces", "compare", "main"]

RATIO_TOLERANCE = 0.02      # |measured / expected - 1| accepted


def nvlink_allreduce_check(sizes: Sequence[int] = (16 << 20, 256 << 20), iters: int = 10, *,
                           run_dir: Optional[str] = None, warmup: int = 2,
                           nvml_per_link: bool = True, verbose: bool = True) -> Dict:
    """All-reduce ``iters`` float32 tensors of each size in ``sizes`` (bytes) and compare the
    NVLink DATA bytes of each iteration with ``2 (n-1) / n * size``.

    Needs CUDA, NCCL and NVML; initialises the default process group from the torchrun
    environment if it is not initialised. Returns ``{"rank", "world_size", "nvml_status",
    "run_dir", "results": [per iteration], "summary": {size: median ratios}, "ok"}``.

    Example::

        result = nvlink_allreduce_check([64 << 20], iters=5)
        assert result["ok"], result["summary"]
    """
    import torch
    import torch.distributed as dist

    from ..config import Config
    from .recorder import open_recorder

    if not torch.cuda.is_available():
        raise RuntimeError("nvlink_allreduce_check needs CUDA GPUs")
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    if run_dir is None:
        holder = [f"commsched_runs/nvlink_check_{time.strftime('%Y%m%d_%H%M%S')}"]
        dist.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    recorder = open_recorder(Config(telemetry_dir=run_dir), rank=rank, world_size=world,
                             local_rank=local_rank, device=local_rank,
                             nvml_per_link=nvml_per_link)
    planned = drive_allreduces(
        recorder, sizes, iters, warmup, group_ranks=tuple(range(world)),
        make_tensor=lambda size: torch.ones(size // 4, dtype=torch.float32, device="cuda"),
        all_reduce=dist.all_reduce, synchronize=torch.cuda.synchronize, barrier=dist.barrier)
    recorder.close()
    dist.barrier()
    out = compare(run_dir, rank, world, planned, sizes)
    if verbose:
        _print(out)
    return out


def drive_allreduces(recorder, sizes: Sequence[int], iters: int, warmup: int, *,
                     group_ranks, make_tensor: Callable, all_reduce: Callable,
                     synchronize: Callable, barrier: Callable) -> List[Dict]:
    """Run the all-reduces, one per application iteration, feeding ``recorder`` as the
    scheduler would; returns, per all-reduce, the step marker that closes its iteration."""
    from ..observer import ChunkRecord, IterationRecord

    planned: List[Dict] = []
    step_index = 0

    def boundary():
        nonlocal step_index
        synchronize()
        recorder.step()
        recorder.flush()            # the boundary sample exists before the next all-reduce
        step_index += 1

    boundary()                      # iteration 0: start-up, not compared
    lane_iteration = 0
    for size in sizes:
        x = make_tensor(size)
        for _ in range(warmup):
            all_reduce(x)
        boundary()
        for _ in range(iters):
            barrier()               # a few bytes; keeps ranks in step so windows align
            synchronize()
            t0 = time.time_ns()
            all_reduce(x)
            synchronize()
            t1 = time.time_ns()
            recorder.on_chunk(ChunkRecord("selfcheck", lane_iteration, f"ar{size}",
                                          "all_reduce", "all_reduce", "none", 0, 1, size,
                                          "float32", tuple(group_ranks), 0, t0, t0, t0, t1))
            recorder.on_iteration(IterationRecord("selfcheck", lane_iteration, t0, t0, 1, 1,
                                                  size, False))
            lane_iteration += 1
            planned.append({"step": step_index, "size": size, "time_ms": (t1 - t0) / 1e6})
            boundary()
        del x
    return planned


def compare(run_dir: str, rank: int, world: int, planned: List[Dict],
            sizes: Sequence[int]) -> Dict:
    """Measured NVLink bytes of each planned all-reduce vs ``2 (n-1)/n * size``."""
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
        expected = factor * p["size"]
        tx, rx = r.get("nvlink_tx_bytes"), r.get("nvlink_rx_bytes")
        results.append({
            "size": p["size"], "step": p["step"], "time_ms": p["time_ms"],
            "busbw_gbps": expected / (p["time_ms"] * 1e6) if p["time_ms"] > 0 else None,
            "expected_bytes": expected, "data_tx_bytes": tx, "data_rx_bytes": rx,
            "raw_tx_bytes": raw.get(p["step"]),
            "ratio_tx": tx / expected if tx is not None and expected else None,
            "ratio_rx": rx / expected if rx is not None and expected else None,
            "link_tx_bytes": r.get("link_tx_bytes", {}),
        })
    summary = {}
    for size in sizes:
        rs = [x for x in results if x["size"] == size]
        summary[size] = {
            "ratio_tx_median": median([x["ratio_tx"] for x in rs if x["ratio_tx"] is not None]),
            "ratio_rx_median": median([x["ratio_rx"] for x in rs if x["ratio_rx"] is not None]),
            "raw_over_data_median": median([x["raw_tx_bytes"] / x["data_tx_bytes"] for x in rs
                                            if x["raw_tx_bytes"] and x["data_tx_bytes"]]),
            "busbw_gbps_median": median([x["busbw_gbps"] for x in rs
                                         if x["busbw_gbps"] is not None]),
        }
    ok = info["nvml_status"] == "ok" and all(
        s["ratio_tx_median"] is not None and abs(s["ratio_tx_median"] - 1) <= RATIO_TOLERANCE
        and s["ratio_rx_median"] is not None and abs(s["ratio_rx_median"] - 1) <= RATIO_TOLERANCE
        for s in summary.values())
    latencies = [s["latency_ns"] for s in run.rows("nvlink_metrics", rank) if s["link"] == -1]
    health = run.rows("nvlink_health", rank)
    readable = [c for c in HEALTH_COUNTERS if any(h[c] is not None for h in health)]
    return {"rank": rank, "world_size": world, "run_dir": run_dir,
            "health_counters_readable": readable,
            "nvml_status": info["nvml_status"], "nvml_detail": info["nvml_detail"],
            "links": run.rows("intra_node_topo", rank),
            "sample_latency_ms_median": median(latencies) / 1e6 if latencies else None,
            "results": results, "summary": summary, "ok": ok}


def _raw_bytes(data, run, rank) -> Dict[int, int]:
    """RAW TX bytes (sum over links) between the samples taken at each step boundary."""
    from .metrics import KIB, boundary_indices
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
      f"({out['nvml_detail']}); one sample costs {_f(out['sample_latency_ms_median'], 0)} ms"
      f"; run dir {out['run_dir']}")
    active = [l for l in out["links"] if l["state"] == 1]
    if active:
        l0 = active[0]
        p(f"  {len(active)} active links, version {l0['version']}, {l0['speed_mbps']} MB/s, "
          f"remote {sorted({l['remote_type'] for l in active})}")
    p(f"  health counters readable: {', '.join(out['health_counters_readable']) or 'none'}")
    p(f"  {'size':>12} {'step':>5} {'ms':>8} {'busbw':>7} {'expected KiB':>13} "
      f"{'DATA tx KiB':>12} {'DATA rx KiB':>12} {'tx/exp':>7} {'rx/exp':>7} {'RAW/DATA':>8}")
    for r in out["results"]:
        def kib(v):
            return f"{v / 1024:>12.0f}" if v is not None else f"{'-':>12}"
        ratio_raw = (r["raw_tx_bytes"] / r["data_tx_bytes"]
                     if r["raw_tx_bytes"] and r["data_tx_bytes"] else None)
        p(f"  {r['size']:>12} {r['step']:>5} {r['time_ms']:>8.2f} {_f(r['busbw_gbps'], 7)} "
          f"{r['expected_bytes'] / 1024:>13.0f} {kib(r['data_tx_bytes'])} "
          f"{kib(r['data_rx_bytes'])} {_f(r['ratio_tx'])} {_f(r['ratio_rx'])} "
          f"{_f(ratio_raw, 8)}")
    for size, s in out["summary"].items():
        p(f"  size {size}: median tx/expected {_f(s['ratio_tx_median'])}, rx/expected "
          f"{_f(s['ratio_rx_median'])}, RAW/DATA {_f(s['raw_over_data_median'])}, "
          f"busbw {_f(s['busbw_gbps_median'])} GB/s")
    if out["results"]:
        links = out["results"][-1]["link_tx_bytes"]
        if links:
            p("  last iteration, DATA tx KiB per link: " + ", ".join(
                f"{l}:{(b or 0) / 1024:.0f}" for l, b in sorted(links.items())))
    p(f"  => {'OK' if out['ok'] else 'MISMATCH'} (tolerance {RATIO_TOLERANCE:.0%})")


def _f(v, width: int = 7) -> str:
    return f"{v:>{width}.4f}" if v is not None else f"{'-':>{width}}"


def _parse_sizes(text: str) -> List[int]:
    from ..config import parse_bytes
    return [parse_bytes(s, "--sizes") for s in text.split(",") if s.strip()]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.telemetry.selfcheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16MiB,256MiB", type=_parse_sizes,
                   help="comma-separated all-reduce sizes (default 16MiB,256MiB)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dir", default=None, help="run directory (default commsched_runs/...)")
    p.add_argument("--sums-only", action="store_true",
                   help="sample link sums only (the ~1.2 ms query) instead of per link")
    args = p.parse_args(argv)
    out = nvlink_allreduce_check(args.sizes, args.iters, run_dir=args.dir,
                                 nvml_per_link=not args.sums_only)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0 if out["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
