"""megatron-core's bucket groups patched by commsched leave nothing to Python's cycle
collector ([Note: no cycles on the hot path] in docs/design.md): with the collector off,
no Request, Chunk or collective work outlives the iteration after its own, and a
steady-state iteration adds to the collector's count at most what stock megatron-core
adds for the same bucket groups, in the same worker, plus ``EXTRA``; nothing survives it.

2 gloo ranks, CPU (``cuda_shim``), the MLP and SGD of test_megatron_equivalence.py (three
bucket groups); one pair of spawned workers measures every scenario.
"""

import json
import os
import warnings

import pytest

pytest.importorskip("megatron.core.distributed.param_and_grad_buffer",
                    reason="megatron-core is not installed (make test installs it)")

import torch  # noqa: E402

from distributed import run_workers
from gc_census import ONE_OFF  # noqa: E402

# What a patched iteration may add to the collector's generation-0 count beyond stock
# megatron-core's (measured, three bucket groups, every scenario and config: stock 1,
# patched 2; nothing survives the iteration in either).
EXTRA = 1

SCENARIOS = {
    "distopt_overlap_grad_and_param": dict(use_distributed_optimizer=True,
                                           overlap_grad_reduce=True,
                                           overlap_param_gather=True),
    "allreduce_overlap": dict(overlap_grad_reduce=True),
}
CONFIGS = {
    "default": {},
    "planned": dict(partition_bytes=512, credit_bytes=1024, policy="priority",
                    profile_iters=1),
}


def _step(spec, rank):
    """One training iteration of megatron's DDP over the MLP, and the model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from test_megatron_equivalence import BUCKET, _model, _sgd_step

    ddp_config = DistributedDataParallelConfig(bucket_size=BUCKET, **spec)
    transformer_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                           use_cpu_initialization=True)
    model = DistributedDataParallel(transformer_config, ddp_config, _model("mlp"))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))

    def step():
        model.zero_grad_buffer()
        model(x).pow(2).mean().backward()
        model.finish_grad_sync()
        _sgd_step(model, rank, ddp_config.use_distributed_optimizer,
                  ddp_config.overlap_param_gather)
    return step, model


def _worker(rank, world, outdir):
    warnings.simplefilter("ignore")
    import cuda_shim
    cuda_shim.install()
    from megatron.core import parallel_state

    import commsched.megatron_patches as mp
    from commsched import Config
    from gc_census import Lifetimes, keep_no_gloo_works, settled, steady_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    keep_no_gloo_works()
    lifetimes = Lifetimes()
    results = {}
    try:
        for name, spec in SCENARIOS.items():
            step, _ = _step(spec, rank)
            results[f"{name}/stock"] = steady_state(step, settled())
            for config_name, config in CONFIGS.items():
                mp.apply(Config(**config))
                try:
                    step, _ = _step(spec, rank)
                    runtime = mp.current_runtime()
                    step()                            # (the scheduler exists from here)
                    settle = settled(runtime.scheduler)
                    measured = steady_state(step, settle)
                    measured["left"] = lifetimes.run(step, settle)
                    results[f"{name}/{config_name}"] = measured
                    runtime.close()
                finally:
                    mp.remove()
    finally:
        parallel_state.destroy_model_parallel()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("megatron_gc")
    run_workers(_worker, 2, str(outdir), timeout=300)
    return [json.loads((outdir / f"rank{rank}.json").read_text()) for rank in range(2)]


CASES = [(s, c) for s in SCENARIOS for c in CONFIGS]


@pytest.mark.parametrize("scenario,config", CASES)
def test_no_request_chunk_or_work_outlives_the_next_iteration(measured, scenario, config):
    for rank, results in enumerate(measured):
        left = results[f"{scenario}/{config}"]["left"]
        assert all(objects == [] for objects in left), (rank, left)


@pytest.mark.parametrize("scenario,config", CASES)
def test_a_patched_iteration_leaves_no_more_than_stock_megatron(measured, scenario, config):
    for rank, results in enumerate(measured):
        stock, patched = results[f"{scenario}/stock"], results[f"{scenario}/{config}"]
        assert patched["per_iteration"] <= stock["per_iteration"] + EXTRA, (
            rank, stock, patched)
        assert patched["survivors"] <= max(stock["survivors"], 0) + ONE_OFF, (
            rank, stock, patched)
