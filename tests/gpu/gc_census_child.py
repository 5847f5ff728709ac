"""Child of tests/gpu/test_gc_census.py: one rank on CUDA + NCCL (gloo on a CPU-only machine,
which checks the plumbing), what an iteration of stock DDP, the DDP hook and the
data-parallel mode leaves to the cycle collector, printed as one JSON line."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gc_census import settled, steady_state  # noqa: E402  (tests/ on the path first)

import commsched  # noqa: E402
import commsched.data_parallel  # noqa: E402
import commsched.hooks  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def net() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(512, 512), nn.GELU())]
    return nn.Sequential(*layers, nn.Linear(512, 8)).to(DEVICE)


def ddp_step(x, config):
    """One iteration of DDP (1 MB buckets), with the commsched hook where ``config`` is
    given; returns it and the hook's state."""
    ddp = DDP(net(), bucket_cap_mb=1)
    state = commsched.hooks.register(ddp, config) if config is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step():
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
    return step, state


def main() -> None:
    if CUDA:
        torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if CUDA else "gloo", store=store, rank=0, world_size=1)
    x = torch.randn(64, 512, device=DEVICE)
    out = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu",
           "torch": torch.__version__}

    step, _ = ddp_step(x, None)
    out["stock_ddp"] = steady_state(step, settled())

    step, state = ddp_step(x, commsched.Config())
    out["hook"] = steady_state(step, settled(state.scheduler))
    out["hook"]["callbacks"] = len(state.results)
    out["hook"]["held_buffers"] = sum(r.tensor is not None for r in state.results)

    module = net()
    model, opt = commsched.data_parallel.wrap(
        module, torch.optim.SGD(module.parameters(), lr=0.01), commsched.Config(),
        group_bytes=1 << 20)

    def dp_step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sync()
    out["data_parallel"] = steady_state(dp_step, settled(model._engine.scheduler))

    for name in ("stock_ddp", "hook", "data_parallel"):
        out[name].pop("deltas", None)
    print(json.dumps(out))
    state.close()
    commsched.data_parallel.drain(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
