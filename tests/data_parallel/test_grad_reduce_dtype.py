"""COMMSCHED_GRAD_REDUCE_DTYPE: the data-parallel mode's all-reduces in bfloat16 or float16
train as DDP with PyTorch's own compression hook does.

PyTorch's ``bf16_compress_hook`` / ``fp16_compress_hook`` cast each bucket to the narrow
type, divide it by the group size, sum it across ranks and copy the sum back; the
data-parallel mode casts each layer group and averages it the same way. On 2 gloo ranks
every element is then one rounding of a / 2 + b / 2, whatever the layout: the parameters
must equal the hooked DDP's exactly, and differ from float32 DDP's (or the cast would not
have happened).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers

STEPS = 6
HOOKS = {"bfloat16": default_hooks.bf16_compress_hook,
         "float16": default_hooks.fp16_compress_hook}


def _hook(dtype):
    """PyTorch's compression hook, called through a function of another name: DDP refuses
    ``bf16_compress_hook`` by name off CUDA/NCCL, though gloo sums bfloat16 on CPU."""
    hook = HOOKS[dtype]
    return lambda state, bucket: hook(state, bucket)


def _net():
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def _train(model, opt, rank):
    for step in range(STEPS):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _worst(params, ref):
    return max(((p - q).abs().max() / q.abs().max().clamp(min=1)).item()
               for p, q in zip(params, ref))


def _equal_to_the_compression_hook(rank, world, dtype, cuda_paths=False):
    from commsched import Config
    from commsched.data_parallel import drain, wrap

    torch.manual_seed(0)
    nets = [_net() for _ in range(3)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    hooked, plain, ours = nets
    ddp = DDP(hooked)
    ddp.register_comm_hook(None, _hook(dtype))
    _train(ddp, _sgd(ddp.parameters()), rank)
    _train(DDP(plain), _sgd(plain.parameters()), rank)
    model, opt = wrap(ours, _sgd(ours.parameters()),
                      Config(grad_reduce_dtype=dtype, group_bytes=0, groups_in_flight=2))
    engine = model._engine
    assert [g.comm.dtype for g in engine.groups] == [getattr(torch, dtype)] * 3
    # a window of two groups in flight counts the bytes sent: 2 per element
    assert engine.scheduler.config.credit_bytes == 2 * max(g.comm.numel() * 2
                                                           for g in engine.groups)
    sent = []
    submit = engine.scheduler.submit
    engine.scheduler.submit = lambda t, **kw: sent.append(t.dtype) or submit(t, **kw)
    _train(model, opt, rank)
    drain(model)
    assert sent == [getattr(torch, dtype)] * 3 * STEPS
    assert _worst(ours.parameters(), hooked.parameters()) == 0.0
    assert _worst(ours.parameters(), plain.parameters()) > 1e-6
    assert engine.scheduler._lanes[engine.reduce_group].cuda == cuda_paths
    engine.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_all_reduces_equal_ddp_with_the_compression_hook(dtype):
    run_workers(_equal_to_the_compression_hook, 2, dtype, timeout=120)


def _on_cuda_paths(rank, world, dtype):
    import fake_cuda
    fake_cuda.install()
    _equal_to_the_compression_hook(rank, world, dtype, cuda_paths=True)


def test_narrow_all_reduces_on_the_schedulers_cuda_paths():
    # (fake_cuda.py: the lanes' CUDA bookkeeping, the held requests' events; gloo's sums)
    run_workers(_on_cuda_paths, 2, "bfloat16", timeout=120)


class _Branchy(nn.Module):
    """``c`` is used on one rank at each step, ``d`` on none."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 32)
        self.b, self.c, self.d = nn.Linear(32, 5), nn.Linear(32, 5), nn.Linear(32, 5)

    def forward(self, x, use_c):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def _unused_equal_to_the_compression_hook(rank, world):
    from commsched import Config
    from commsched.data_parallel import drain, wrap

    torch.manual_seed(0)
    hooked, ours = _Branchy(), _Branchy()
    ours.load_state_dict(hooked.state_dict())
    ddp = DDP(hooked, find_unused_parameters=True)
    ddp.register_comm_hook(None, _hook("bfloat16"))
    model, opt = wrap(ours, _sgd(ours.parameters()),
                      Config(grad_reduce_dtype="bfloat16", group_bytes=0))
    for m, o in ((ddp, _sgd(ddp.parameters())), (model, opt)):
        for step in range(STEPS):
            x, y = _batch(rank, step)
            # Groups of b (ready first) wait behind c and d, submitted at the end of
            # backward: b's gradients are held in its slots, c's and d's are missing on
            # a rank, and the narrow copy must hold 0 for them, not the last step's.
            nn.functional.cross_entropy(m(x, (rank + step) % 2 == 0), y).backward()
            o.step()
            o.zero_grad()
    drain(model)
    assert ours.d.weight.grad is None and torch.equal(ours.d.weight, hooked.d.weight)
    assert _worst(ours.parameters(), hooked.parameters()) == 0.0
    model.close()


def test_narrow_all_reduces_with_unused_parameters_equal_ddp_with_the_hook():
    run_workers(_unused_equal_to_the_compression_hook, 2, timeout=120)


def _with_tied_rows(rank, world):
    from commsched import Config
    from commsched.data_parallel import drain, wrap
    from data_parallel.test_sparse_embeddings import STEPS as ROW_STEPS
    from data_parallel.test_sparse_embeddings import TinyLM, _batch as row_batch, _loss

    torch.manual_seed(0)
    ref, net = TinyLM(True), TinyLM(True)
    net.load_state_dict(ref.state_dict())
    ddp = DDP(ref)
    ref_opt = _sgd(ddp.parameters())
    model, opt = wrap(net, _sgd(net.parameters()),
                      Config(grad_reduce_dtype="bfloat16", sparse_embedding_rows=1,
                             group_bytes=0))
    # The tied weight's dense all-reduce (the output layer's gradient) goes in bfloat16,
    # its rows in float32, added after the dense part came back.
    assert model._engine.sparse_groups[0].comm is not None
    for step in range(ROW_STEPS):
        ids, target = row_batch(rank, step)
        for m, o in ((ddp, ref_opt), (model, opt)):
            _loss(m, ids, target).backward()
            o.step()
            o.zero_grad()
    drain(model)
    worst = _worst(net.parameters(), ref.parameters())
    # float32 DDP within bfloat16's rounding: rows overwritten by the dense part's copy
    # back (or never added) would leave the looked-up rows' updates out
    assert 1e-6 < worst < 1e-2, worst
    model.close()


def test_narrow_all_reduce_of_a_tied_weight_keeps_its_rows():
    run_workers(_with_tied_rows, 2, timeout=120)


def _refused_with_rs_ag(rank, world):
    from commsched import Config
    from commsched.data_parallel import wrap

    net = _net()
    with pytest.raises(ValueError, match=r"grad_reduce_dtype='bfloat16' "
                       r"\(COMMSCHED_GRAD_REDUCE_DTYPE\) needs decompose='none', not 'rs_ag'"):
        wrap(net, _sgd(net.parameters()),
             Config(grad_reduce_dtype="bfloat16", decompose="rs_ag"))


def test_narrow_all_reduces_are_refused_with_rs_ag():
    run_workers(_refused_with_rs_ag, 2, timeout=60)


def test_an_untied_row_gradient_weight_gets_no_narrow_copy(world1):
    # (its gradient goes as rows only: no all-reduce to send it in)
    from commsched import Config
    from commsched.data_parallel import wrap
    from data_parallel.test_sparse_embeddings import TinyLM

    net = TinyLM(False)
    model, _ = wrap(net, _sgd(net.parameters()),
                    Config(grad_reduce_dtype="bfloat16", sparse_embedding_rows=1,
                           group_bytes=0))
    engine = model._engine
    rows = engine.sparse_groups[0]
    assert rows.comm is None
    assert all(g.comm is not None and g.comm.dtype is torch.bfloat16
               for g in engine.groups if g is not rows)
    model.close()
