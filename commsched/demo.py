"""``commsched demo``: train a small model on 2 processes with the scheduler on.

CPU + gloo when fewer than 2 GPUs are visible, NCCL on every local GPU otherwise. Prints a
line per iteration: loss, iteration time, chunks and bytes the scheduler dispatched.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from .config import Config, ConfigError
from .workers import exit_worker


def _model(width: int, depth: int) -> nn.Module:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _worker(rank: int, world: int, port: int, args, config: Config) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from commsched.hooks import register

    cuda = args.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # One intra-op thread per process: the ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _model(args.width, args.depth).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                  bucket_cap_mb=args.bucket_mb)
    state = register(ddp, config)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(7)).to(device)
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print(f"commsched demo: {world} ranks, {args.backend}, {nparams / 1e6:.2f}M params, "
              f"partition {config.partition_bytes} B, credit {config.credit_bytes} B, "
              f"policy {state.scheduler.config.policy}, decompose {config.decompose}", flush=True)
        print(f"{'iter':>4} {'loss':>10} {'ms':>8} {'chunks':>7} {'KiB':>9}", flush=True)
    previous = state.scheduler.stats(state.group)
    for it in range(args.iters):
        t0 = time.perf_counter()
        x = torch.randn(args.batch, args.width, generator=gen, device=device)
        y = (x @ target).tanh()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        stats = state.scheduler.stats(state.group)
        if rank == 0:
            print(f"{it:>4} {loss.item():>10.5f} {ms:>8.2f} "
                  f"{stats['chunks'] - previous['chunks']:>7} "
                  f"{(stats['bytes'] - previous['bytes']) / 1024:>9.1f}", flush=True)
        previous = stats
    state.close()
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="commsched demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="training iterations (20)")
    parser.add_argument("--width", type=int, default=512, help="hidden width (512)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (4)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank (64)")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (1)")
    parser.add_argument("--no-telemetry", action="store_true",
                        help="do not record telemetry (default: commsched_runs/demo-TIME, "
                             "or COMMSCHED_TELEMETRY_DIR)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes (default: GPUs if >= 2, else 2 on CPU)")
    args = parser.parse_args(argv)
    for name in ("iters", "width", "depth", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if not math.isfinite(args.bucket_mb) or args.bucket_mb <= 0:
        parser.error("--bucket-mb must be a finite number > 0")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    try:
        config = Config.from_env().replace(enabled=True)
    except ConfigError as exc:
        print(f"commsched demo: error: {exc}", file=sys.stderr)
        return 2
    if "COMMSCHED_PARTITION_BYTES" not in os.environ:
        # Small enough that the demo's 1 MiB buckets visibly split into chunks.
        config = config.replace(partition_bytes=256 << 10)
    if config.telemetry_dir is None and not args.no_telemetry:
        config = config.replace(telemetry_dir=os.path.join(
            "commsched_runs", time.strftime("demo-%Y%m%d-%H%M%S")))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.backend = "nccl" if gpus >= 2 else "gloo"
    world = args.world_size if args.world_size is not None else (gpus if gpus >= 2 else 2)
    if args.backend == "nccl" and world > gpus:
        parser.error(f"--world-size {world} exceeds the {gpus} visible GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, args, config), nprocs=world)
    if config.telemetry_dir:
        from .telemetry.report import report_main

        print(f"\ntelemetry of this run: {config.telemetry_dir}", flush=True)
        report_main([config.telemetry_dir])
        print(f"\nmore: commsched report {config.telemetry_dir} --plot timeline.png\n"
              f"      commsched trace {config.telemetry_dir} -o trace.json "
              f"(open in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
