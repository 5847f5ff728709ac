"""Config.sparse_embedding_rows: an embedding's lookup gradient sent as rows trains as
DistributedDataParallel does.

A tiny language model (embedding, two blocks, an output layer tied to the embedding or
not; a padding token among the inputs) trains for 6 steps with SGD and momentum (its
update scales with the gradient, so a wrong scale shows), once under DDP (the reference)
and once under ``commsched.data_parallel.wrap`` with row gradients for the embedding, on 2 (and
4) gloo ranks with different tokens per rank. The rows are summed in another order than
DDP's dense gradient, so values are compared within float32 rounding (1e-5 relative).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers

VOCAB, WIDTH, TOKENS, STEPS, PAD = 97, 16, 24, 6, 3


class TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                    nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def _batch(rank: int, step: int, tokens: int = TOKENS):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, VOCAB, (2, tokens // 2), generator=gen)
    ids[0, 0] = PAD
    return ids, torch.randint(0, VOCAB, (2, tokens // 2), generator=gen)


def _loss(model, ids, target):
    return nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), target.reshape(-1))


def _wrapped(net):
    """``net`` under the data-parallel mode with row gradients for every embedding, SGD."""
    from commsched import Config
    from commsched.data_parallel import wrap

    return wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
                Config(sparse_embedding_rows=1))


def _train_both(rank, world, tied, min_rows, accum=1, clip=None):
    from commsched import Config
    from commsched.data_parallel import drain, wrap

    torch.manual_seed(0)
    ref = TinyLM(tied)
    net = TinyLM(tied)
    net.load_state_dict(ref.state_dict())
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    model, opt = wrap(net, opt, Config(sparse_embedding_rows=min_rows, group_bytes=0),
                      reads_grads=clip is not None)
    engine = model._engine
    keys = []
    submit = engine.scheduler.submit
    engine.scheduler.submit = lambda *a, **kw: keys.append(kw["key"]) or submit(*a, **kw)
    for step in range(STEPS):
        keys.clear()
        for micro in range(accum):
            ids, target = _batch(rank, step * accum + micro)
            last = micro == accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                _loss(ddp, ids, target).backward()
            with contextlib.nullcontext() if last else model.no_sync():
                _loss(model, ids, target).backward()
        if clip is not None:
            norms = (nn.utils.clip_grad_norm_(ddp.parameters(), clip),
                     nn.utils.clip_grad_norm_(net.parameters(), clip))
            assert torch.allclose(*norms, rtol=1e-5) and norms[0] > clip, norms
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    drain(model)
    worst = max(((p - q).abs().max() / q.abs().max().clamp(min=1)).item()
                for p, q in zip(net.parameters(), ref.parameters()))
    return worst, engine, keys


def _rows_train_like_ddp(rank, world, tied, cuda_paths=False):
    worst, engine, keys = _train_both(rank, world, tied, min_rows=VOCAB)
    assert engine.scheduler._lanes[engine.reduce_group].cuda == cuda_paths
    assert [g.sparse.tied for g in engine.sparse_groups] == [tied]
    g = engine.sparse_groups[0]
    assert g.params == [engine.module.embed.weight]
    # tied: the weight's group comes last, and its dense all-reduce (the output layer's
    # gradient) goes first in backward; untied: in place, with no dense all-reduce; the
    # rows go at the end of backward
    others = [h.index for h in reversed(engine.groups) if h is not g]
    if tied:
        assert g.index == len(engine.groups) - 1
        assert keys == [g.index] + others + [("ids", g.index), ("rows", g.index)]
    else:
        assert g.index == 0
        assert keys == others + [("ids", g.index), ("rows", g.index)]
    assert g.sparse.tokens == TOKENS and g.sparse.ids_all.numel() == world * TOKENS
    print(f"rank {rank} tied {tied}: worst {worst:.2e}")
    assert worst <= 1e-5, (rank, tied, worst)
    engine.close()


@pytest.mark.parametrize("tied", [False, True])
def test_row_gradients_train_like_ddp(tied):
    run_workers(_rows_train_like_ddp, 2, tied, timeout=120)


def _rows_on_cuda_paths(rank, world, tied):
    import fake_cuda
    fake_cuda.install()
    _rows_train_like_ddp(rank, world, tied, cuda_paths=True)


@pytest.mark.parametrize("tied", [False, True])
def test_row_gradients_on_the_schedulers_cuda_paths_train_like_ddp(tied):
    # (fake_cuda.py: the lanes' CUDA bookkeeping, collectives still gloo's)
    run_workers(_rows_on_cuda_paths, 2, tied, timeout=120)


def test_row_gradients_train_like_ddp_on_four_ranks():
    # (each rank's rows at its own offset of the gathered buffers)
    run_workers(_rows_train_like_ddp, 4, True, timeout=180)


def _accumulated(rank, world):
    worst, engine, keys = _train_both(rank, world, True, min_rows=VOCAB, accum=2)
    # one gather of both micro-batches' rows per synchronised backward
    assert engine.sparse_groups[0].sparse.tokens == 2 * TOKENS
    assert keys.count(("rows", engine.sparse_groups[0].index)) == 1
    assert worst <= 1e-5, (rank, worst)
    engine.close()


def test_accumulated_micro_batches_send_their_rows_at_the_synchronised_backward():
    run_workers(_accumulated, 2, timeout=120)


def _clipped(rank, world):
    # the norm reads every gradient: the rows are added before it (reads_grads)
    worst, engine, _ = _train_both(rank, world, True, min_rows=VOCAB, clip=0.05)
    assert worst <= 1e-5, (rank, worst)
    engine.close()


def test_clipping_reads_gradients_with_their_rows():
    run_workers(_clipped, 2, timeout=120)


def _off_below_the_row_count(rank, world):
    worst, engine, _ = _train_both(rank, world, True, min_rows=VOCAB + 1)
    assert engine.sparse_groups == []
    assert type(engine.module.embed).forward is nn.Embedding.forward
    assert worst <= 1e-6
    engine.close()


def test_embeddings_below_the_row_count_go_dense():
    run_workers(_off_below_the_row_count, 2, timeout=120)


def _more_rows_than_the_weight(rank, world):
    import warnings

    from commsched.data_parallel import DataParallelWarning

    model, opt = _wrapped(TinyLM(False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(model, *_batch(rank, 0, tokens=50)).backward()     # 2 x 50 >= 97 rows
    assert [str(w.message) for w in caught if w.category is DataParallelWarning] == [
        "commsched data-parallel: embedding 'embed' sends 2 x 50 gradient rows per backward, at "
        "least its 97 rows: the dense all-reduce would send about as much or less; raise "
        "sparse_embedding_rows above its rows or set it to 0"]
    opt.step()
    model.close()


def test_gathering_as_many_rows_as_the_weight_has_warns_at_the_first_backward():
    run_workers(_more_rows_than_the_weight, 2, timeout=120)


def _unequal_tokens(rank, world):
    net = TinyLM(False)
    model, _ = _wrapped(net)
    ids, target = _batch(rank, 0, tokens=TOKENS + 2 * rank)
    with pytest.raises(RuntimeError, match=r"looked up \[24, 26\] tokens"):
        _loss(model, ids, target).backward()
    model._engine.remove_hooks()
    assert "forward" not in net.embed.__dict__


def test_ranks_that_look_up_different_token_counts_get_an_error_naming_them():
    run_workers(_unequal_tokens, 2, timeout=120)


def _changed_tokens(rank, world):
    model, opt = _wrapped(TinyLM(True))
    _loss(model, *_batch(rank, 0)).backward()
    opt.step()
    opt.zero_grad()
    # (every rank changes: each stops before its all-gather, none waits for another)
    with pytest.raises(RuntimeError, match=r"'embed' looked up 28 tokens in this backward, "
                                           r"24 in the first"):
        _loss(model, *_batch(rank, 1, tokens=TOKENS + 4)).backward()


def test_a_token_count_that_changes_after_the_first_backward_is_an_error():
    run_workers(_changed_tokens, 2, timeout=120)


class _FunctionalTie(TinyLM):
    def forward(self, ids):
        return nn.functional.linear(self.blocks(self.embed(ids)), self.embed.weight)


def _functional_tie(rank, world):
    model, _ = _wrapped(_FunctionalTie(False))
    ids, target = _batch(rank, 0)
    with pytest.raises(RuntimeError, match="embed.weight.*dense gradient"):
        _loss(model, ids, target).backward()
    dist.barrier()


def test_a_weight_reused_outside_its_module_is_refused_naming_it():
    run_workers(_functional_tie, 2, timeout=120)


def test_rs_ag_refuses_row_gradients(world1):
    from commsched import Config
    from commsched.data_parallel import wrap

    net = TinyLM(False)
    with pytest.raises(ValueError, match="sparse_embedding_rows=1 needs decompose='none'"):
        wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
                               Config(sparse_embedding_rows=1, decompose="rs_ag"))
