"""DDP + commsched hook against stock DDP, same seed and data, in the same worker.

Stock DDP divides each gradient by the world size and sums whole buckets; the hook divides
the bucket and sums it chunk by chunk. With 2 ranks a two-term sum does not depend on how
the bucket is cut, so gradients and parameters must be bitwise equal.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched.hooks
from commsched import CommschedWarning, Config
from distributed import run_workers


class Net(nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh())
        self.head = nn.Linear(48, 3)
        self.unused = nn.Linear(48, 48) if unused else None

    def forward(self, x, step=0):
        h = self.body(self.embed(x))
        if self.unused is not None and step % 2 == 0:
            h = self.unused(h)          # used on even steps only
        return self.head(h)


def _train(model, ddp_kwargs, hook_config, dtype, steps, rank):
    torch.manual_seed(0)
    net = model().to(dtype)
    ddp = DDP(net, **ddp_kwargs)
    if hook_config is not None:
        commsched.hooks.register(ddp, hook_config)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    grads = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        loss = ddp(x, step).float().pow(2).mean()
        loss.backward()
        grads.append([p.grad.clone() if p.grad is not None else None
                      for p in ddp.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=False)
    return grads, [p.detach().clone() for p in ddp.parameters()]


def _hook_equals_stock_ddp(rank, world, ddp_kwargs, dtype, configs, unused):
    model = lambda: Net(unused)  # noqa: E731
    steps = 5                      # iteration 0 uses one bucket; rebuilt after it
    ref_grads, ref_params = _train(model, ddp_kwargs, None, dtype, steps, rank)
    for config in configs:
        grads, params = _train(model, ddp_kwargs, config, dtype, steps, rank)
        for step, (g, rg) in enumerate(zip(grads, ref_grads)):
            for a, b in zip(g, rg):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a, b), f"step {step} {config}: {(a - b).abs().max()}"
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b), config


CONFIGS = [
    Config(partition_bytes=512, credit_bytes=2048, policy="priority", profile_iters=1),
    Config(partition_bytes=1000, credit_bytes=0, policy="fifo", decompose="rs_ag"),
    Config(partition_bytes=0, credit_bytes=0, decompose="none"),
]


@pytest.mark.parametrize("ddp_kwargs,unused", [
    (dict(bucket_cap_mb=0.004), False),                             # many small buckets
    (dict(bucket_cap_mb=100), False),                               # one large bucket
    (dict(bucket_cap_mb=0.01, gradient_as_bucket_view=True), False),
    (dict(bucket_cap_mb=0.01, static_graph=True), False),
    (dict(bucket_cap_mb=0.01, find_unused_parameters=True), True),
])
def test_hook_equals_stock_ddp_fp32(ddp_kwargs, unused):
    run_workers(_hook_equals_stock_ddp, 2, ddp_kwargs, torch.float32, CONFIGS, unused,
                timeout=180)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hook_equals_stock_ddp_low_precision(dtype):
    run_workers(_hook_equals_stock_ddp, 2, dict(bucket_cap_mb=0.004), dtype, CONFIGS[:2],
                False, timeout=180)


def _hook_close_to_stock_ddp_4_ranks(rank, world):
    ddp_kwargs = dict(bucket_cap_mb=0.02)
    ref_grads, ref_params = _train(Net, ddp_kwargs, None, torch.float32, 3, rank)
    grads, params = _train(Net, ddp_kwargs, CONFIGS[1], torch.float32, 3, rank)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hook_close_to_stock_ddp_4_ranks():
    run_workers(_hook_close_to_stock_ddp_4_ranks, 4, timeout=180)


def _bucket_priorities_follow_forward_order(rank, world):
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.004)
    state = commsched.hooks.register(ddp, Config(profile_iters=1))
    seen = {}
    submit = state.scheduler.submit

    def spy(tensor, **kw):
        seen[kw["key"]] = kw["priority"]
        return submit(tensor, **kw)

    state.scheduler.submit = spy
    for step in range(3):
        ddp(torch.randn(4, 16)).sum().backward()
    # Bucket 0 holds the last layers (DDP fills buckets in reverse), so it is the least
    # urgent: priorities must decrease with the bucket index.
    keys = sorted(seen)
    assert len(keys) > 2
    assert [seen[k] for k in keys] == sorted((seen[k] for k in keys), reverse=True)


def test_bucket_priorities_follow_forward_order():
    run_workers(_bucket_priorities_follow_forward_order, 2, timeout=90)


def _dp_only_settings_warn(rank, world):
    import warnings

    ddp = DDP(Net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commsched.hooks.register(ddp, Config(grad_reduce_dtype="bfloat16")).close()
        commsched.hooks.register(DDP(Net()), Config(partition_bytes=1 << 20)).close()
    messages = [str(w.message) for w in caught if w.category is CommschedWarning]
    assert messages == ["commsched DDP hook: COMMSCHED_GRAD_REDUCE_DTYPE is read by the "
                        "data-parallel mode (commsched.wrap) only and ignored here"], messages
    # (pointing at the caller of register)
    assert [w.filename for w in caught if w.category is CommschedWarning] == [__file__]


def test_the_hook_warns_of_data_parallel_only_settings():
    run_workers(_dp_only_settings_warn, 1, timeout=60)
