"""NVLink bytes per iteration, as the telemetry report counts them, against the bytes the
iteration's collectives should put on the links.

    python examples/bench/nvlink_accounting.py --out results/nvlink_accounting.json
    python examples/bench/nvlink_accounting.py --quick --out /tmp/nvlink.json    # CPU check

On a machine with at least ``--world-size`` GPUs (default 2), one spawned worker per GPU
trains the Llama-architecture decoder of ``models.llama_lm`` (8 x 2048, MLP 5632, 16
heads, vocab 32000, untied; seq 2048, micro-batch 4, bf16 autocast, fused AdamW, built on
its GPU) for ``--steps`` steps (20) with no synchronisation in the loop, twice in one
process group, with telemetry on (NVML sampling at its defaults):

    hook   plain DDP with the commsched hook
    dp     commsched's data-parallel mode (``commsched.wrap``), whose collectives run into
           the next forward

Then it reads each run's stores with the report's code (``commsched report``) and prints
per rank the NVLink DATA TX bytes the report gives each iteration against the expected
bytes (2(n-1)/n of each all-reduce's bytes): the median ratio over the iterations with
its p10-p90, and the ratio of the run's sums. NCCL_NVLS_ENABLE=0 in every worker.

``--quick``: gloo on CPU, a tiny GPT in plain PyTorch, and a fake NVML whose counters move
by each collective's ring share as the scheduler reports it complete (a check of the
script and the report's arithmetic, not of NVLink). Exit status 1 when a launch failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import benchlib  # first: puts the checkout on sys.path

import torch

import models
import train_lm

MODES = ("hook", "dp")
TOLERANCE = 0.02        # counted within 2% of expected


@dataclass(frozen=True)
class Spec:
    """What the parent tells the workers (picklable)."""

    root: str
    steps: int
    world_size: int
    backend: str
    port: int
    quick: bool
    collective_timeout_s: float


class _FakeLinkTraffic:
    """Telemetry observer in front of a recorder, and the counters of a fake NVML: every
    collective the scheduler reports complete moves them by its ring share (half on each
    of two links), at the moment it is reported."""

    def __init__(self) -> None:
        self.recorder = None
        self.kib = 0.0
        self.lock = threading.Lock()

    def on_chunks(self, records) -> None:
        from commsched.telemetry.metrics import ring_link_bytes
        with self.lock:
            self.kib += sum(ring_link_bytes(r.step, r.nbytes, len(r.group_ranks))
                            for r in records if r.ok) / 1024
        self.recorder.on_chunks(records)

    def on_chunk(self, record) -> None:
        self.on_chunks([record])

    def on_iteration(self, record) -> None:
        self.recorder.on_iteration(record)

    def on_tuning(self, entry) -> None:
        self.recorder.on_tuning(entry)

    def counter(self, gpu: int, link: int, name: str, read: int) -> int:
        with self.lock:
            per_link = int(self.kib) // 2
        return per_link * 5 // 4 if name.startswith("raw") else per_link


def _observer(config, rank: int, world_size: int) -> Optional[_FakeLinkTraffic]:
    """With ``--quick``: a recorder on a fake NVML fed by the collectives (above)."""
    from commsched.telemetry import open_recorder
    from commsched.telemetry.nvml import FakeGpu, FakeLink, FakeNvmlBackend

    traffic = _FakeLinkTraffic()
    backend = FakeNvmlBackend([FakeGpu(links=[FakeLink(), FakeLink()])],
                              counter_fn=traffic.counter)
    # (device "cuda:0" only picks the fake's GPU: nothing runs on CUDA)
    traffic.recorder = open_recorder(config, rank=rank, world_size=world_size,
                                     device=torch.device("cuda", 0), nvml_backend=backend,
                                     nvml_period_ms=20)
    return traffic


def _train(mode: str, rank: int, spec: Spec) -> None:
    import commsched
    hooks = benchlib.import_commsched_hooks()
    cuda = spec.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model, shape = train_lm.build(spec.quick, device)
    config = commsched.Config.from_env().replace(
        enabled=True, telemetry_dir=os.path.join(spec.root, mode))
    observer = _observer(config, rank, spec.world_size) if spec.quick else None
    extra = {"fused": True} if cuda else {}
    if mode == "hook":
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if cuda else None)
        state = hooks.register(net, config, observer=observer)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.1, **extra)
    else:
        net, optimizer = commsched.wrap(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **extra),
            config, observer=observer)
    tokens, targets = train_lm.batch(shape, device, rank)
    train_lm.train(net, optimizer, tokens, targets, spec.steps, cuda)
    if mode == "hook":
        state.close()
    else:
        commsched.drain(net)
        net.close()
    if cuda:
        torch.cuda.synchronize(device)
    if observer is not None:
        observer.recorder.close()


def worker(rank: int, spec: Spec) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if spec.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    benchlib.init_process_group(rank, spec.world_size, spec.port, spec.backend,
                                spec.collective_timeout_s)
    try:
        for mode in MODES:
            _train(mode, rank, spec)
            benchlib.barrier(spec.backend)
    finally:
        torch.distributed.destroy_process_group()


def summarize(run_dir: str) -> Dict[str, Any]:
    """Per rank, from the report of ``run_dir``: counted against expected NVLink TX."""
    from commsched.telemetry.report import build_report

    report = build_report(run_dir)
    out: Dict[str, Any] = {"ranks": {}, "runs": report["runs"]}
    for rank, summary in report["summary"].items():
        rows = [r for r in report["rows"] if str(r["rank"]) == rank
                and r["nvlink_tx_bytes"] is not None and r["nvlink_expected_bytes"]]
        ratios = [r["nvlink_tx_bytes"] / r["nvlink_expected_bytes"] for r in rows]
        counted = sum(r["nvlink_tx_bytes"] for r in rows)
        expected = sum(r["nvlink_expected_bytes"] for r in rows)
        out["ranks"][rank] = {
            "iterations": len(rows),
            "per_iteration": [{"iteration": r["iteration"], "counted": r["nvlink_tx_bytes"],
                               "expected": r["nvlink_expected_bytes"]} for r in rows],
            "counted_bytes": counted, "expected_bytes": expected,
            "ratio_median": benchlib.statistics.median(ratios) if ratios else None,
            "ratio_p10": benchlib.percentile(ratios, 10) if ratios else None,
            "ratio_p90": benchlib.percentile(ratios, 90) if ratios else None,
            "ratio_run": counted / expected if expected else None,
            "outside_collectives_bytes": summary["nvlink_tx_bytes_outside_collectives"],
        }
    return out


def table(document: Dict[str, Any]) -> str:
    rows = []
    for mode in MODES:
        result = document["modes"].get(mode) or {}
        criterion = "ratio_median" if mode == "hook" else "ratio_run"
        for rank, r in sorted((result.get("ranks") or {}).items()):
            ok = (r[criterion] is not None and abs(r[criterion] - 1) <= TOLERANCE)
            rows.append([mode, rank, r["iterations"], f"{r['counted_bytes'] / 1e9:.3f}",
                         f"{r['expected_bytes'] / 1e9:.3f}",
                         benchlib.fmt(r["ratio_median"], 4),
                         None if r["ratio_p10"] is None else
                         f"{r['ratio_p10']:.4f}-{r['ratio_p90']:.4f}",
                         benchlib.fmt(r["ratio_run"], 4),
                         None if r["outside_collectives_bytes"] is None else
                         f"{r['outside_collectives_bytes'] / 1e9:.3f}",
                         f"{criterion.replace('ratio_', '')} {'within' if ok else 'OUTSIDE'} "
                         f"{100 * TOLERANCE:.0f}%"])
    return benchlib.markdown_table(
        ["mode", "rank", "iterations", "counted GB", "expected GB", "median ratio",
         "p10-p90", "run-sum ratio", "outside collectives GB", "criterion"], rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="gloo on CPU, tiny model, fake NVML (a check of the script)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default="nvlink_accounting.json")
    p.add_argument("--keep", default=None,
                   help="keep the telemetry run directories here (default: removed)")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    backend = "gloo" if args.quick else benchlib.choose_backend(False, args.world_size)
    if backend != "nccl" and not args.quick:
        print(f"[nvlink] needs {args.world_size} GPUs (or --quick for the CPU check)",
              file=sys.stderr)
        return 2
    root = args.keep or tempfile.mkdtemp(prefix="commsched-nvlink-")
    spec = Spec(str(root), args.steps, args.world_size, backend, benchlib.free_port(),
                args.quick, 120.0)
    started = time.monotonic()
    outcome = benchlib.launch(worker, (spec,), args.world_size, args.timeout)
    document: Dict[str, Any] = {
        "schema": "commsched.bench.nvlink_accounting/1", "created_utc": benchlib.utc_now(),
        "command": [sys.executable, *sys.argv], "system": benchlib.system_info(),
        "settings": {"steps": args.steps, "world_size": args.world_size, "backend": backend,
                     "quick": args.quick,
                     "model": "tiny GPT" if args.quick else {
                         "library": "transformers LlamaForCausalLM", **models.LLAMA_SHAPE}},
        "parent_env": benchlib.relevant_env(), "status": "ok" if outcome.ok else "error",
        "error": outcome.error, "wall_s": round(time.monotonic() - started, 1), "modes": {}}
    try:
        for mode in MODES:
            run_dir = os.path.join(root, mode)
            try:
                document["modes"][mode] = summarize(run_dir)
            except Exception as exc:  # noqa: BLE001 - a launch that failed early
                document["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"}
                document["status"] = "error"
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for result in document["modes"].values():
        for run in result.get("runs", []):
            run.pop("config", None)
    benchlib.write_json(Path(args.out), document)
    system = document["system"]
    card = (f"{args.world_size}x {system.get('gpu_name')}, driver {system.get('driver')}, "
            f"torch {system.get('torch')}, NCCL {system.get('nccl')}" if backend == "nccl"
            else f"CPU, gloo, fake NVML - a check of the script, torch {system.get('torch')}")
    print(f"[nvlink] wrote {args.out}" + (f"; failed: {outcome.error}" if not outcome.ok
                                          else ""))
    print(f"\nNVLink DATA TX per iteration, counted by the report vs expected "
          f"(2(n-1)/n x all-reduce bytes), {args.steps} steps: {card}\n")
    print(table(document))
    return 0 if document["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
