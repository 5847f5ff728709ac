"""megatron-core DDP patched by commsched against stock megatron-core: same seed, same data,
in the same worker (2 ranks, gloo, CPU, tensor/pipeline parallel size 1).

Each scenario trains a tiny MLP wrapped in megatron's DistributedDataParallel for a few
iterations, once stock and once patched, and compares bitwise:

- the gradients after ``finish_grad_sync``: the whole buffer after an all-reduce; this rank's
  shard of every bucket after a reduce-scatter (the only part the distributed optimizer
  reads; the rest of the buffer is scratch);
- the parameters the forward pass used, every iteration, and the final ones (after the
  parameter all-gather of the last step).

With 2 ranks every reduction is a sum of two terms, which is the same whatever order the
scheduler runs the chunks in and however it cuts a bucket, so the results must be equal
bit for bit. The optimizer is SGD written out here: on ``main_grad`` without the
distributed optimizer; on this rank's shard of each bucket, then the all-gather, with it
(what megatron's DistributedOptimizer does; that class itself allocates on CUDA).

Importing megatron-core costs seconds, so all scenarios run in one pair of spawned workers
(``run_workers``); each scenario is then reported by its own test.
"""

import json
import os
import sys
import warnings

import pytest

pytest.importorskip("megatron.core.distributed.param_and_grad_buffer",
                    reason="megatron-core is not installed (make test installs it)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from commsched import Config  # noqa: E402
from distributed import run_workers  # noqa: E402

# bench_interleave (the Megatron-LM benchmark's switch); spawned workers inherit sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "bench",
                                "worker_site"))

WORLD = 2
ITERATIONS = 6
LR = 0.05
BUCKET = 400          # elements: the MLP below gets three bucket groups
# Small chunks and credit so that buckets are cut and dispatch is gated; profile_iters=1
# so that the scheduler's last iterations run on a priority plan (its first is not
# profiled, its second is), also where only every other iteration is patched.
COMMSCHED = dict(partition_bytes=512, credit_bytes=1024, policy="priority", profile_iters=1)

SCENARIOS = {
    "allreduce_sync": dict(ddp={}),
    "allreduce_overlap": dict(
        ddp=dict(overlap_grad_reduce=True, bucket_size=BUCKET),
        commsched=dict(decompose="rs_ag")),
    # Stock megatron cannot run ReduceOp.AVG on gloo; its other way to average (pre-scaling
    # by 1/size, then SUM) is the reference, and must be bitwise what the patch does.
    "allreduce_average_in_collective": dict(
        ddp=dict(overlap_grad_reduce=True, bucket_size=BUCKET, average_in_collective=True),
        reference=dict(ddp=dict(average_in_collective=False))),
    "distopt_sync": dict(
        ddp=dict(use_distributed_optimizer=True), force_all_reduce_at=2),
    "distopt_overlap_grad": dict(
        ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 bucket_size=BUCKET)),
    "distopt_overlap_grad_and_param": dict(
        ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True, bucket_size=BUCKET)),
    # fp32 and fp64 parameters: two buffers, whose buckets disable_bucketing puts in one
    # bucket group. Stock megatron coalesces the group's collectives, and gloo's coalesced
    # all-gather garbles tensors of mixed dtypes; the reference is stock megatron with the
    # same two buckets in two bucket groups (no coalescing, the same reductions).
    "distopt_two_buckets_per_group": dict(
        ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True),
        model="two_dtypes", disable_bucketing=True, coalesced=True,
        reference=dict(disable_bucketing=False)),
    # Iterations alternating between commsched's methods and megatron's own in one run
    # (examples/bench/worker_site/bench_interleave.py, for the Megatron-LM benchmark).
    "distopt_overlap_interleaved": dict(
        ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True, bucket_size=BUCKET),
        interleave=True),
    # Bucket groups built before apply() keep megatron's own collectives.
    "built_before_apply": dict(
        ddp=dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True, bucket_size=BUCKET),
        built_before_apply=True),
}


class _TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 24)
        self.second = torch.nn.Linear(24, 8).double()

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)).double()).float()


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "two_dtypes":
        return _TwoDtypes()
    return torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
        torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))


def _grads(model, rank, full):
    """Reduced gradients megatron's optimizers read after finish_grad_sync."""
    out = []
    for bucket_group in model.bucket_groups:
        for bucket in bucket_group.buckets:
            data = bucket.grad_data
            out.append(data.clone() if full else data.view(WORLD, -1)[rank].clone())
    return out


def _params(model):
    return [p.detach().clone() for p in model.module.parameters()]


@torch.no_grad()
def _sgd_step(model, rank, distopt, overlap_param_gather):
    if not distopt:
        for p in model.module.parameters():
            p.data.add_(p.main_grad, alpha=-LR)
        return
    for bucket_group in model.bucket_groups:
        for bucket in bucket_group.buckets:
            shard = bucket.param_data.numel() // WORLD
            bucket.param_data.narrow(0, rank * shard, shard).add_(
                bucket.grad_data.narrow(0, rank * shard, shard), alpha=-LR)
    if not overlap_param_gather:
        model.start_param_sync()     # as DistributedOptimizer does after its step


def _train(spec, rank, patched):
    """Returns (grads per iteration, params per iteration + final, scheduler summary)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    import commsched.megatron_patches as mp

    reference = {} if patched else spec.get("reference", {})
    ddp_config = DistributedDataParallelConfig(**{**spec["ddp"], **reference.get("ddp", {})})
    disable_bucketing = reference.get("disable_bucketing", spec.get("disable_bucketing", False))
    distopt = ddp_config.use_distributed_optimizer
    overlap_param_gather = ddp_config.overlap_param_gather
    config = Config(**{**COMMSCHED, **spec.get("commsched", {})})
    transformer_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                           use_cpu_initialization=True)
    early = spec.get("built_before_apply", False)
    if patched and not early:
        mp.apply(config)
    model = DistributedDataParallel(transformer_config, ddp_config,
                                    _model(spec.get("model", "mlp")),
                                    disable_bucketing=disable_bucketing)
    if patched and early:
        mp.apply(config)
    submitted = []            # (op, async_op) of every scheduler request
    if patched:
        from commsched.scheduler import Scheduler
        original_submit = Scheduler.submit

        def submit(self, tensor, **kwargs):
            submitted.append((kwargs.get("op", "all_reduce"), kwargs.get("async_op", True)))
            return original_submit(self, tensor, **kwargs)
        Scheduler.submit = submit
    switch = None
    if patched and spec.get("interleave"):
        import bench_interleave
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
        switch = bench_interleave.Switch(_ParamAndGradBucketGroup, mp.current_runtime())
    gen = torch.Generator().manual_seed(1000 + rank)
    try:
        grads, params = _iterations(model, spec, rank, gen, distopt, overlap_param_gather,
                                    switch)
    finally:
        if patched:
            Scheduler.submit = original_submit
    summary = None
    if patched:
        runtime = mp.current_runtime()
        scheduler = runtime.scheduler
        summary = {"scheduled": scheduler is not None, "iterations": [],
                   "submitted": sorted(set(submitted)), "requests": len(submitted)}
        for state in runtime.states.values():
            record = None if scheduler is None else scheduler.last_iteration(state.group)
            if record is not None:
                summary["iterations"].append((record.requests, record.planned))
    if overlap_param_gather:
        model(torch.randn(8, 16, generator=gen))  # the last step's all-gathers
        params.append(_params(model))
        if not spec.get("coalesced", False):
            # force_sync all-gathers, as before evaluation or a checkpoint (megatron's own,
            # once the scheduler is idle).
            model.disable_forward_pre_hook()
    params.append(_params(model))
    return grads, params, summary


def _iterations(model, spec, rank, gen, distopt, overlap_param_gather, switch=None):
    grads, params = [], []
    for it in range(ITERATIONS):
        if switch is not None:       # patched in even iterations, megatron's own in odd
            switch.use("stock" if it % 2 else "patched")
        model.zero_grad_buffer()
        x = torch.randn(8, 16, generator=gen)
        out = model(x)
        params.append(_params(model))
        out.pow(2).mean().backward()
        forced = it == spec.get("force_all_reduce_at")
        model.finish_grad_sync(force_all_reduce=forced)
        grads.append(_grads(model, rank, full=forced or not distopt))
        _sgd_step(model, rank, distopt, overlap_param_gather)
    return grads, params


def _first_difference(name, ours, stock):
    if len(ours) != len(stock):
        return f"{name}: {len(ours)} snapshots, stock has {len(stock)}"
    for step, (a_list, b_list) in enumerate(zip(ours, stock)):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if not torch.equal(a, b):
                return (f"{name} differ at iteration {step}, tensor {i}: max |diff| "
                        f"{(a.double() - b.double()).abs().max().item():.3g}")
    return None


def _run_scenario(name, rank):
    """None when patched equals stock and the scheduler ran as expected, else a message."""
    import commsched.megatron_patches as mp

    spec = SCENARIOS[name]
    stock_grads, stock_params, _ = _train(spec, rank, patched=False)
    try:
        grads, params, summary = _train(spec, rank, patched=True)
    finally:
        mp.remove()
    problem = (_first_difference("gradients", grads, stock_grads)
               or _first_difference("parameters", params, stock_params))
    if problem:
        return problem
    buckets = len(grads[0])           # one snapshot per bucket
    if spec.get("built_before_apply"):
        return "the scheduler ran for bucket groups built before apply()" \
            if summary["scheduled"] else None
    # Gradient syncs, and the all-gathers overlapped with the forward (megatron's own
    # synchronous all-gathers are not scheduled).
    expected = buckets * (2 if spec["ddp"].get("overlap_param_gather") else 1)
    if summary["iterations"] != [(expected, True)]:
        return (f"last scheduler iteration (requests, planned) per process group: "
                f"{summary['iterations']}, expected [({expected}, True)]")
    if spec.get("interleave"):
        # every other iteration through the scheduler: its gradient syncs and all-gathers
        if summary["requests"] != ITERATIONS // 2 * expected:
            return (f"{summary['requests']} requests went through the scheduler, expected "
                    f"{ITERATIONS // 2 * expected} (half of the iterations)")
    # A gradient sync megatron would wait for at once is submitted as such (async_op=False).
    ddp = spec["ddp"]
    wanted = {("reduce_scatter" if ddp.get("use_distributed_optimizer") else "all_reduce",
               bool(ddp.get("overlap_grad_reduce")))}
    if ddp.get("overlap_param_gather"):
        wanted.add(("all_gather", True))
    if set(map(tuple, summary["submitted"])) != wanted:
        return f"submitted (op, async_op): {summary['submitted']}, expected {sorted(wanted)}"
    return None


def _worker(rank, world, names, outdir):
    warnings.simplefilter("ignore")
    import cuda_shim
    cuda_shim.install()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    results = {}
    sys.stderr = _Tee(sys.stderr)
    try:
        for name in names:
            try:
                results[name] = _run_scenario(name, rank) or "ok"
            except Exception as exc:     # ranks may now be out of step: stop here
                results[name] = f"raised {type(exc).__name__}: {exc}"
                raise
            finally:
                results[START_UP] = [line for line in "".join(sys.stderr.written).splitlines()
                                     if line.startswith("commsched: on ")]
                with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
                    json.dump(results, f)
    finally:
        parallel_state.destroy_model_parallel()
    dist.barrier()


START_UP = "start-up lines"


class _Tee:
    """stderr, with what was written kept (the start-up lines are checked)."""

    def __init__(self, stream):
        self.stream, self.written = stream, []

    def write(self, text):
        self.written.append(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Runs every scenario once; maps (rank, scenario) to "ok" or what went wrong."""
    outdir = tmp_path_factory.mktemp("megatron_equivalence")
    error = None
    try:
        run_workers(_worker, WORLD, list(SCENARIOS), str(outdir), timeout=240)
    except Exception as exc:  # reported per scenario below
        error = exc
    results = {}
    for rank in range(WORLD):
        path = outdir / f"rank{rank}.json"
        if path.exists():
            for name, outcome in json.loads(path.read_text()).items():
                results[(rank, name)] = outcome
    return results, error


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_patched_megatron_equals_stock(outcomes, name):
    results, error = outcomes
    for rank in range(WORLD):
        outcome = results.get((rank, name))
        if outcome is None:
            pytest.fail(f"rank {rank} did not run {name!r}: workers failed with {error!r}")
        assert outcome == "ok", f"rank {rank}: {outcome}"


def test_rank_0_alone_says_the_scheduler_is_on_and_the_jobs_size(outcomes):
    results, error = outcomes
    lines = results.get((0, START_UP))
    assert lines, f"no start-up line on rank 0 (workers: {error!r})"
    from commsched.megatron_patches.versions import megatron_version

    version = megatron_version()
    for line in lines:
        assert line.startswith("commsched: on (version "), line
        assert (f"megatron-core {version} bucket-group collectives go through the scheduler "
                f"(a job of {WORLD} ranks); settings: ") in line, line
    assert results.get((1, START_UP)) == []
