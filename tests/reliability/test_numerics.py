"""NaN and Inf in gradients propagate exactly as with stock DDP, and do not upset the
scheduler.

Two gloo ranks; in each worker the same model is trained side by side with stock DDP and
with DDP + the commsched hook, same seed, same inputs. Some iterations get a crafted input
on one rank (NaN, +Inf, or +Inf on one rank and -Inf on the other at the same place, which
sums to NaN) so that the gradients hold NaN/Inf in some elements and finite values in
others. Without an optimizer step (the parameters stay finite), the averaged gradients of
every iteration must match stock DDP's element by element: the same NaN positions, the
same infinities with the same signs, and bitwise-equal finite values (2 ranks: a two-term
sum does not depend on how a bucket is cut; see test_ddp_hook.py). Finite iterations after
the non-finite ones must match too: the scheduler carried on.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched.hooks
from commsched import Config
from distributed import run_workers

from .harness import count_fault, count_hang

# (name, {rank: [(row, col, value)]}) applied to the input of that iteration
INPUTS = [
    ("finite", {}),
    ("nan on rank 1", {1: [(0, 3, math.nan)]}),
    ("+inf on rank 0", {0: [(2, 5, math.inf)]}),
    ("+inf / -inf at one place", {0: [(1, 7, math.inf)], 1: [(1, 7, -math.inf)]}),
    ("nan and -inf on rank 0", {0: [(0, 0, math.nan), (3, 9, -math.inf)]}),
    ("finite after", {}),
    ("finite after 2", {}),
]
CONFIGS = {
    "fifo, chunks, bounded credit": Config(partition_bytes=256, credit_bytes=1024,
                                           policy="fifo"),
    "priority plan, rs_ag": Config(partition_bytes=512, credit_bytes=0, policy="priority",
                                   profile_iters=1, decompose="rs_ag"),
    "whole buckets": Config(partition_bytes=0, credit_bytes=0, policy="fifo"),
}


class Net(nn.Module):
    """Linear layers without a saturating activation in between: an Inf input gives Inf
    (not only NaN) in the weight gradients, a NaN gives NaN; the biases' gradients and
    those of a tanh side branch stay finite, so every bucket mixes finite and non-finite
    values."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(12, 24)
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 2)
        self.side = nn.Linear(12, 2)

    def forward(self, x):
        finite = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        return self.head(self.mid(self.first(x))) + torch.tanh(self.side(finite))


def _grads(rank, config):
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.002)            # several buckets
    state = commsched.hooks.register(ddp, config) if config is not None else None
    gen = torch.Generator().manual_seed(50 + rank)
    out = []
    try:
        for _, faults in INPUTS:
            x = torch.randn(4, 12, generator=gen)
            for row, col, value in faults.get(rank, []):
                x[row, col] = value
            ddp(x).sum().backward()
            out.append([p.grad.clone() for p in ddp.parameters()])
            ddp.zero_grad(set_to_none=True)
    finally:
        if state is not None:
            state.close()
    return out


def same_including_nonfinite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element by element: NaN where the other is NaN, equal values (infinities included,
    with their signs) everywhere else. torch.equal is False whenever a NaN is present."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def _worker(rank, world, out_dir):
    reference = _grads(rank, None)
    report = {"mismatches": [], "nonfinite_reference": [   # [NaNs, Infs] per iteration
        [sum(int(torch.isnan(g).sum()) for g in grads),
         sum(int(torch.isinf(g).sum()) for g in grads)] for grads in reference]}
    for name, config in CONFIGS.items():
        grads = _grads(rank, config.replace(enabled=True))
        for it, (g, r) in enumerate(zip(grads, reference)):
            for k, (a, b) in enumerate(zip(g, r)):
                if not same_including_nonfinite(a, b):
                    report["mismatches"].append(f"{name}: iteration {it} ({INPUTS[it][0]}), "
                                                f"parameter {k}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def test_nan_and_inf_gradients_match_stock_ddp_elementwise(tmp_path):
    try:
        run_workers(_worker, 2, str(tmp_path), timeout=240)
    except TimeoutError:
        count_hang()
        raise
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    injected = sum(len(f.get(r, [])) for _, f in INPUTS for r in range(2))
    count_fault("NaN/Inf in an input (per config, both paths)", injected * len(CONFIGS))
    for rank, report in enumerate(reports):
        assert not report["mismatches"], f"rank {rank}: " + "\n".join(report["mismatches"])
        nonfinite = report["nonfinite_reference"]
        # The faults reached the averaged gradients: NaN and Inf both present, finite
        # iterations finite.
        for it, (name, faults) in enumerate(INPUTS):
            nans, infs = nonfinite[it]
            if not faults:
                assert nans == infs == 0, (rank, name, nonfinite[it])
            else:
                assert nans + infs > 0, (rank, name, nonfinite[it])
        assert any(n > 0 for n, _ in nonfinite) and any(i > 0 for _, i in nonfinite), nonfinite


def test_the_comparison_tells_nan_inf_and_values_apart():
    nan, inf = math.nan, math.inf
    a = torch.tensor([1.0, nan, inf, -inf])
    assert same_including_nonfinite(a, a.clone())
    assert not torch.equal(a, a.clone())                 # why a NaN-aware comparison
    for other in ([1.0, nan, inf, inf], [1.0, 0.0, inf, -inf], [1.0, nan, nan, -inf],
                  [1.0 + 1e-7, nan, inf, -inf], [1.0, inf, nan, -inf]):
        assert not same_including_nonfinite(a, torch.tensor(other)), other
