"""CPU micro-benchmark of commsched's own overhead (gloo, 2 processes).

    python examples/bench/microbench.py --out microbench.json

(a) Per-chunk cost of the scheduler. Each iteration hands K tiny tensors (256 floats, one
    chunk each) to the collective layer and waits for all of them, N chunks in total:
      direct            ``dist.all_reduce(t, async_op=True)`` for each, then ``wait()`` each
      commsched (off)   ``Scheduler.submit`` with partitioning off, unbounded credit, fifo,
                        then ``end_iteration()`` and ``wait()`` each
      commsched (default Config) the same with ``Config()`` defaults (priority plan)
      commsched (partitioned) the K tensors as one request of K*256 floats that the
                        scheduler cuts into K chunks (partitioning on, credit unbounded,
                        fifo), then ``end_iteration()`` and ``wait()``
    Each is run twice: on a gloo group of each rank's own (the collective costs almost
    nothing, so the difference is the scheduler: the number to hold against the target of
    at most 20 us added per chunk) and on the 2-rank group (realistic, but loopback latency
    makes the difference noisy). Reported: wall and process-CPU microseconds per chunk and
    what the scheduler adds over direct. Variants alternate over ``--repeats`` rounds; the
    median round is reported.
(b) DDP on a small MLP, plain vs with the commsched hook (partitioning off, unbounded
    credit, fifo; and default Config): median ms/iteration and ratio to plain DDP.
(c) The DDP hook's cost per bucket: rank 0 alone, on a gloo group of its own, trains a
    stack of small layers with one DDP bucket per layer, under PyTorch's own Python
    ``allreduce_hook`` and under the commsched hook (default Config), in interleaved
    blocks; reported: what the commsched hook adds per bucket (median step time difference
    over the number of buckets; the target is at most 15 us). A third row, DDP's built-in
    C++ all-reduce (no hook, DDP's default), tells what any Python hook costs per bucket
    over DDP itself (no target).

Output: JSON (``--out``) and a markdown table printed last. Exit status 1 when a variant
failed or a worker crashed/hung, else 0 (missing commsched APIs are "n/a", not failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import benchlib  # first: puts the checkout on sys.path
from benchlib import ModeUnavailable, close_quietly, summarize_ms

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
SEED = 1234
TARGET_ADDED_US = 20.0
MLP_LAYERS, MLP_WIDTH, MLP_BATCH, MLP_BUCKET_CAP_MB = 8, 512, 32, 1
HOOK_LAYERS, HOOK_WIDTH, HOOK_BATCH = 32, 64, 4
TARGET_HOOK_ADDED_US = 15.0


def scheduling_off(commsched):
    """The commsched Config that should cost least: no partitioning, unbounded credit,
    fifo order."""
    return commsched.Config(enabled=True, partition_bytes=0, credit_bytes=0, policy="fifo")


def default_config(commsched):
    return commsched.Config(enabled=True)


@dataclass(frozen=True)
class Settings:
    chunks: int
    chunks_per_iter: int
    numel: int
    repeats: int
    mlp_warmup: int
    mlp_iters: int
    hook_rounds: int
    port: int
    collective_timeout_s: float
    result_path: str


# ---------------------------------------------------------------------------------------
# (a) per-chunk overhead
# ---------------------------------------------------------------------------------------

def direct_round(tensors: List[torch.Tensor], group, iterations: int) -> None:
    """Baseline: the collectives commsched would issue, called directly."""
    for _ in range(iterations):
        works = [dist.all_reduce(t, async_op=True, group=group) for t in tensors]
        for work in works:
            work.wait()


def scheduler_round(scheduler, tensors: List[torch.Tensor], group, iterations: int) -> None:
    """The same collectives through the scheduler, one request (= one chunk) per tensor,
    submitted in reverse priority order as a backward pass would."""
    last = len(tensors) - 1
    for _ in range(iterations):
        requests = [scheduler.submit(t, key=i, priority=last - i, group=group)
                    for i, t in enumerate(tensors)]
        scheduler.end_iteration(group)
        for request in requests:
            request.wait()


def partitioned_round(scheduler, flat: torch.Tensor, group, iterations: int) -> None:
    """The same chunks as one request per iteration, partitioned by the scheduler."""
    for _ in range(iterations):
        request = scheduler.submit(flat, key=0, group=group)
        scheduler.end_iteration(group)
        request.wait()


def measure_round(fn: Callable[[], None]) -> Dict[str, float]:
    """Wall and process-CPU seconds (all threads: gloo's and the scheduler's included) of
    one round, started together on both ranks."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


# (name, label, config, one request per iteration that the scheduler partitions into the
# chunks instead of a request per chunk)
SUBMIT_VARIANTS = [
    ("direct", "direct all_reduce(async_op=True) + wait", None, False),
    ("commsched_off", "commsched: partition off, credit unbounded, fifo", scheduling_off,
     False),
    ("commsched_default", "commsched: default Config (priority plan)", default_config, False),
    ("commsched_partitioned", "commsched: one request partitioned into the chunks, fifo",
     scheduling_off, True),
]

# Where the collectives run. On "own" each rank all-reduces within a process group of its
# own (gloo, one rank): the collective costs a few microseconds, so the difference between
# variants is the scheduler's cost. On "pair" both ranks all-reduce together: the realistic
# case, but loopback gloo latency (~0.5-1 ms per op on small VMs) makes the difference noisy.
GROUP_KINDS = [("own", "own 1-rank group"), ("pair", "2-rank group")]


def submit_overhead(settings: Settings) -> Dict[str, Any]:
    """Part (a); see the module docstring."""
    rank = dist.get_rank()
    # new_group is collective: every rank creates every group, in the same order.
    own_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    groups = {"own": own_groups[rank], "pair": None}
    tensors = [torch.zeros(settings.numel) for _ in range(settings.chunks_per_iter)]
    flat = torch.zeros(settings.numel * settings.chunks_per_iter)
    iterations = max(1, settings.chunks // settings.chunks_per_iter)
    chunks = iterations * settings.chunks_per_iter
    rows: List[Dict[str, Any]] = []
    runners: List[Callable[[int], None]] = []
    schedulers = []
    for kind, kind_label in GROUP_KINDS:
        group = groups[kind]
        for name, label, make_config, whole in SUBMIT_VARIANTS:
            row = {"name": f"{name}/{kind}", "variant": name, "group": kind,
                   "label": label, "group_label": kind_label, "status": "ok",
                   "reason": None, "config": None,
                   "wall_us_per_chunk": None, "cpu_us_per_chunk": None,
                   "added_wall_us_per_chunk": None, "added_cpu_us_per_chunk": None,
                   "rounds_wall_us_per_chunk": [], "rounds_cpu_us_per_chunk": []}
            rows.append(row)
            if make_config is None:
                runners.append(lambda n, g=group: direct_round(tensors, g, n))
                continue
            try:
                commsched = benchlib.import_commsched()
                config = make_config(commsched)
                if whole:
                    config = dataclasses.replace(config, partition_bytes=settings.numel * 4)
                scheduler = commsched.Scheduler(config)
            except ModeUnavailable as exc:
                row.update(status="n/a", reason=str(exc))
                runners.append(None)
                continue
            row["config"] = dataclasses.asdict(config)
            schedulers.append(scheduler)
            if whole:
                runners.append(lambda n, s=scheduler, g=group: partitioned_round(s, flat, g, n))
            else:
                runners.append(lambda n, s=scheduler, g=group: scheduler_round(s, tensors, g, n))
    try:
        # Warm-up covers the priority policy's profiled iterations and its first plan.
        for row, run in zip(rows, runners):
            if run is not None:
                guarded(row, lambda: run(8))
        for _ in range(settings.repeats):
            for row, run in zip(rows, runners):
                if row["status"] != "ok":
                    continue
                timing = guarded(row, lambda: measure_round(lambda: run(iterations)))
                if timing is not None:
                    row["rounds_wall_us_per_chunk"].append(timing["wall_s"] / chunks * 1e6)
                    row["rounds_cpu_us_per_chunk"].append(timing["cpu_s"] / chunks * 1e6)
    finally:
        for scheduler in schedulers:
            close_quietly(scheduler)

    for row in rows:
        if row["status"] == "ok":
            row["wall_us_per_chunk"] = statistics.median(row["rounds_wall_us_per_chunk"])
            row["cpu_us_per_chunk"] = statistics.median(row["rounds_cpu_us_per_chunk"])
    for row in rows:
        base = next(r for r in rows if r["group"] == row["group"] and r["variant"] == "direct")
        if row["status"] == "ok" and base["status"] == "ok":
            row["added_wall_us_per_chunk"] = row["wall_us_per_chunk"] - base["wall_us_per_chunk"]
            row["added_cpu_us_per_chunk"] = row["cpu_us_per_chunk"] - base["cpu_us_per_chunk"]
    return {"chunk_numel": settings.numel, "chunk_bytes": settings.numel * 4,
            "chunks": chunks, "chunks_per_iteration": settings.chunks_per_iter,
            "repeats": settings.repeats, "target_added_us": TARGET_ADDED_US,
            "rows": rows}


def guarded(row: Dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure mark ``row`` as an error. Both ranks then agree on whether
    either failed (one gloo all-reduce), so they stay in step. Returns ``fn()``'s value, or
    None when a rank failed."""
    failed, value = 0, None
    try:
        value = fn()
    except ModeUnavailable as exc:  # the same on every rank (a missing API)
        row.update(status="n/a", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - report, go on with the other variants
        failed = 1
        print(f"[microbench] rank {dist.get_rank()} {row['name']} failed:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        row.update(status="error", reason=f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
    flag = torch.tensor([failed])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not failed:
        row.update(status="error", reason="failed on another rank (see its stderr)")
    return None if flag.item() or row["status"] == "n/a" else value


# ---------------------------------------------------------------------------------------
# (b) DDP on a small MLP
# ---------------------------------------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(SEED)
    layers: List[nn.Module] = []
    for _ in range(MLP_LAYERS):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


class DDPVariant:
    """DDP(mlp) with SGD and a fixed batch; ``register(ddp)`` installs a comm hook first."""

    def __init__(self, register: Optional[Callable[[DDP], Any]]) -> None:
        self.model = DDP(mlp(), bucket_cap_mb=MLP_BUCKET_CAP_MB)
        self.state = register(self.model) if register is not None else None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(SEED + dist.get_rank())
        self.inputs = torch.randn(MLP_BATCH, MLP_WIDTH, generator=generator)

    def steps(self, count: int) -> List[float]:
        """Run ``count`` training steps; ms each."""
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.model(self.inputs).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def close(self) -> None:
        close_quietly(self.state)


def ddp_mlp(settings: Settings) -> Dict[str, Any]:
    """Part (b); see the module docstring. The variants' models live side by side and run in
    interleaved blocks of iterations, so slow drift of the machine hits all alike."""
    def hook_with(make_config):
        def register(model):
            commsched = benchlib.import_commsched()
            hooks = benchlib.import_commsched_hooks()
            return hooks.register(model, config=make_config(commsched))
        return register

    specs = [("ddp", "plain DDP", None),
             ("ddp_commsched_off", "DDP + commsched hook: partition off, credit unbounded, "
              "fifo", hook_with(scheduling_off)),
             ("ddp_commsched_default", "DDP + commsched hook: default Config",
              hook_with(default_config))]
    rows, variants = [], []
    for name, label, register in specs:
        row = {"name": name, "label": label, "status": "ok", "reason": None,
               "median_ms": None, "mean_ms": None, "p10_ms": None, "p90_ms": None,
               "min_ms": None, "max_ms": None, "iter_ms": [], "ratio_to_ddp": None}
        rows.append(row)
        variants.append(guarded(row, lambda: DDPVariant(register)))
    blocks = max(1, min(5, settings.mlp_iters))
    per_block = [settings.mlp_iters // blocks + (b < settings.mlp_iters % blocks)
                 for b in range(blocks)]
    try:
        for row, variant in zip(rows, variants):
            if variant is not None:
                guarded(row, lambda: variant.steps(settings.mlp_warmup))
        for count in per_block:
            for row, variant in zip(rows, variants):
                if variant is None or row["status"] != "ok":
                    continue
                times = guarded(row, lambda: variant.steps(count))
                if times is not None:
                    row["iter_ms"] += times
    finally:
        for variant in variants:
            if variant is not None:
                variant.close()
    for row in rows:
        if row["status"] == "ok":
            row.update(summarize_ms(row["iter_ms"]))
    if rows[0]["status"] == "ok":
        for row in rows:
            if row["status"] == "ok":
                row["ratio_to_ddp"] = row["median_ms"] / rows[0]["median_ms"]
    return {"layers": MLP_LAYERS, "width": MLP_WIDTH, "batch": MLP_BATCH,
            "bucket_cap_mb": MLP_BUCKET_CAP_MB, "warmup": settings.mlp_warmup,
            "iters": settings.mlp_iters, "rows": rows}


# ---------------------------------------------------------------------------------------
# (c) the DDP hook's cost per bucket
# ---------------------------------------------------------------------------------------

def layer_stack() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(*[nn.Linear(HOOK_WIDTH, HOOK_WIDTH) for _ in range(HOOK_LAYERS)])


def hook_overhead(settings: Settings) -> Dict[str, Any]:
    """Part (c); see the module docstring. Only rank 0 measures (the other rank would
    compete for the two cores of a small machine); ``new_group`` is collective."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    own = dist.new_group([0])
    rows = [{"name": name, "label": label, "status": "ok", "reason": None,
             "us_per_step": None, "rounds_us_per_step": []}
            for name, label in (("allreduce_hook", "PyTorch allreduce_hook (Python)"),
                                ("commsched_hook", "commsched hook, default Config"),
                                ("builtin", "DDP's built-in all-reduce (C++, no hook)"))]
    doc: Dict[str, Any] = {"layers": HOOK_LAYERS, "width": HOOK_WIDTH, "batch": HOOK_BATCH,
                           "rounds": settings.hook_rounds, "rows": rows, "buckets": None,
                           "added_us_per_bucket": None, "target_us": TARGET_HOOK_ADDED_US,
                           "added_over_builtin_us_per_bucket": None}
    if dist.get_rank() == 0:
        layer_bytes = (HOOK_WIDTH * HOOK_WIDTH + HOOK_WIDTH) * 4
        models, states = [], []
        for row in rows:
            model = DDP(layer_stack(), process_group=own, bucket_cap_mb=layer_bytes / 2**20)
            if row["name"] == "allreduce_hook":
                model.register_comm_hook(own, default_hooks.allreduce_hook)
            elif row["name"] == "commsched_hook":
                hooks = benchlib.import_commsched_hooks()
                states.append(hooks.register(model, config=default_config(
                    benchlib.import_commsched())))
            models.append(model)
        inputs = torch.randn(HOOK_BATCH, HOOK_WIDTH)
        steps_per_round = 20

        def run(model, steps):
            for _ in range(steps):
                model(inputs).sum().backward()
        try:
            for model in models:          # iteration 0 rebuilds the buckets; then the plan
                run(model, 10)
            # (the commsched hook submits one request per bucket)
            doc["buckets"] = states[0].scheduler.last_iteration(own).requests
            for _ in range(settings.hook_rounds):
                for row, model in zip(rows, models):
                    start = time.perf_counter()
                    run(model, steps_per_round)
                    row["rounds_us_per_step"].append(
                        (time.perf_counter() - start) / steps_per_round * 1e6)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            for row in rows:
                row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        finally:
            for state in states:
                close_quietly(state)
        if all(row["status"] == "ok" for row in rows):
            for row in rows:
                row["us_per_step"] = statistics.median(row["rounds_us_per_step"])
            doc["added_us_per_bucket"] = (
                (rows[1]["us_per_step"] - rows[0]["us_per_step"]) / doc["buckets"])
            doc["added_over_builtin_us_per_bucket"] = (
                (rows[1]["us_per_step"] - rows[2]["us_per_step"]) / doc["buckets"])
    dist.barrier()
    return doc


# ---------------------------------------------------------------------------------------
# Workers and parent
# ---------------------------------------------------------------------------------------

def worker(rank: int, settings: Settings) -> None:
    torch.set_num_threads(1)
    benchlib.init_process_group(rank, WORLD_SIZE, settings.port, "gloo",
                                settings.collective_timeout_s)
    try:
        doc: Dict[str, Any] = {"env": benchlib.relevant_env()}
        doc["submit_overhead"] = submit_overhead(settings)
        if rank == 0:
            print("[microbench] (a) per-chunk overhead done", flush=True)
            benchlib.write_json(Path(settings.result_path), doc)
        doc["ddp_mlp"] = ddp_mlp(settings)
        if rank == 0:
            print("[microbench] (b) DDP MLP done", flush=True)
            benchlib.write_json(Path(settings.result_path), doc)
        doc["hook_overhead"] = hook_overhead(settings)
        if rank == 0:
            print("[microbench] (c) DDP hook per bucket done", flush=True)
            benchlib.write_json(Path(settings.result_path), doc)
    finally:
        dist.destroy_process_group()


def _row_note(row: Dict[str, Any]) -> Optional[str]:
    return None if row["status"] == "ok" else f"{row['status']}: {(row['reason'] or '')[:100]}"


def results_table(document: Dict[str, Any]) -> str:
    headers = ["benchmark", "variant", "median", "vs baseline", "note"]
    rows = []
    submit = document.get("submit_overhead") or {}
    for row in submit.get("rows", []):
        value = vs = None
        note = _row_note(row)
        if row["status"] == "ok":
            value = f"{row['wall_us_per_chunk']:.1f} us/chunk (CPU {row['cpu_us_per_chunk']:.1f})"
            if row["variant"] != "direct" and row["added_wall_us_per_chunk"] is not None:
                added = row["added_wall_us_per_chunk"]
                vs = f"{added:+.1f} us/chunk (CPU {row['added_cpu_us_per_chunk']:+.1f})"
                note = (f"{'meets' if added <= TARGET_ADDED_US else 'ABOVE'} target "
                        f"<= {TARGET_ADDED_US:.0f} us added")
        rows.append([f"per-chunk, {submit.get('chunk_bytes')} B x {submit.get('chunks')}, "
                     f"{row['group_label']}", row["label"], value, vs, note])
    mlp_doc = document.get("ddp_mlp") or {}
    for row in mlp_doc.get("rows", []):
        ok = row["status"] == "ok"
        rows.append([f"DDP MLP {mlp_doc.get('layers')}x{mlp_doc.get('width')}, batch "
                     f"{mlp_doc.get('batch')}", row["label"],
                     f"{row['median_ms']:.2f} ms/iter" if ok else None,
                     f"{row['ratio_to_ddp']:.2f}x" if ok and row["ratio_to_ddp"] else None,
                     _row_note(row)])
    hook_doc = document.get("hook_overhead") or {}
    added = hook_doc.get("added_us_per_bucket")
    for row in hook_doc.get("rows", []):
        ok = row["status"] == "ok"
        vs = note = None
        if ok and row["name"] == "commsched_hook" and added is not None:
            vs = f"{added:+.1f} us/bucket"
            target = hook_doc.get("target_us", TARGET_HOOK_ADDED_US)
            note = f"{'meets' if added <= target else 'ABOVE'} target <= {target:.0f} us added"
            builtin = hook_doc.get("added_over_builtin_us_per_bucket")
            if builtin is not None:
                note += f"; {builtin:+.1f} us/bucket over DDP's built-in"
        rows.append([f"DDP hook, 1 rank, {hook_doc.get('buckets')} buckets (one per layer)",
                     row["label"], f"{row['us_per_step']:.0f} us/step" if ok else None, vs,
                     note if ok else _row_note(row)])
    return benchlib.markdown_table(headers, rows)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=2000,
                        help="chunks per variant and round in (a) (default 2000)")
    parser.add_argument("--chunks-per-iter", type=int, default=16,
                        help="chunks submitted per scheduler iteration (default 16)")
    parser.add_argument("--numel", type=int, default=256, help="floats per chunk (256)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="alternating rounds per variant in (a); median reported")
    parser.add_argument("--mlp-warmup", type=int, default=10)
    parser.add_argument("--mlp-iters", type=int, default=50)
    parser.add_argument("--hook-rounds", type=int, default=30,
                        help="interleaved rounds of 20 steps per hook in (c) (default 30)")
    parser.add_argument("--out", default="microbench_results.json")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before hung workers are terminated (default 300)")
    parser.add_argument("--collective-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    for name in ("chunks", "chunks_per_iter", "numel", "repeats", "mlp_iters",
                 "hook_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="commsched-microbench-") as tmp:
        settings = Settings(args.chunks, args.chunks_per_iter, args.numel, args.repeats,
                            args.mlp_warmup, args.mlp_iters, args.hook_rounds,
                            benchlib.free_port(),
                            args.collective_timeout, str(Path(tmp) / "result.json"))
        print(f"[microbench] spawning {WORLD_SIZE} gloo workers", flush=True)
        outcome = benchlib.launch(worker, (settings,), WORLD_SIZE, args.timeout)
        path = Path(settings.result_path)
        partial = json.loads(path.read_text()) if path.exists() else {}
    document: Dict[str, Any] = {
        "schema": "commsched.bench.microbench/1",
        "created_utc": benchlib.utc_now(),
        "command": [sys.executable, *sys.argv],
        "settings": {k: v for k, v in dataclasses.asdict(settings).items()
                     if k not in ("port", "result_path")},
        "world_size": WORLD_SIZE, "backend": "gloo",
        "system": benchlib.system_info(),
        "env": partial.get("env", benchlib.relevant_env()),
        "status": "ok" if outcome.ok else "error",
        "error": outcome.error,
        "wall_s": round(outcome.wall_s, 1),
        "submit_overhead": partial.get("submit_overhead"),
        "ddp_mlp": partial.get("ddp_mlp"),
        "hook_overhead": partial.get("hook_overhead"),
    }
    benchlib.write_json(Path(args.out), document)
    failed = [row["name"] for part in ("submit_overhead", "ddp_mlp", "hook_overhead")
              for row in (document[part] or {}).get("rows", []) if row["status"] == "error"]
    ok = outcome.ok and not failed and all(
        document[p] for p in ("submit_overhead", "ddp_mlp", "hook_overhead"))
    print(f"[microbench] wrote {args.out}"
          + ("" if outcome.ok else f"; launch failed: {outcome.error}")
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    print("", flush=True)
    system = document["system"]
    print(f"commsched CPU micro-benchmark: gloo, {WORLD_SIZE} processes on "
          f"{system.get('cpu_count')} cores, torch {system.get('torch')}", flush=True)
    print("", flush=True)
    print(results_table(document), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
