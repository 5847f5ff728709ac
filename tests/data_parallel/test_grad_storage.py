"""What lives when: a layer group's gradient memory exists from the backward that writes it
to the update that reads it (``commsched/data_parallel/storage.py``), as plain training's
gradients do, and every loop that keeps gradients keeps them, with DDP's values.

Each scenario trains the same small model with stock DDP (the reference) and with
``commsched.wrap`` on 2 gloo ranks, on the same per-rank batches, and records whether each
group's storage (``untyped_storage().nbytes() > 0``) is there at the points that matter,
beside the largest difference of the parameters (or outputs) from DDP's. One
``run_workers`` call runs every scenario; the tests read its results.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import SmallNet, run_workers

STEPS = 4


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 3, generator=gen)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _pair(opt=_sgd, bf16=False, reads_grads=False, **config):
    """(DDP model, its optimizer, wrapped model, its optimizer), same initial weights."""
    import commsched
    from commsched.config import Config

    torch.manual_seed(0)
    ref = SmallNet()
    torch.manual_seed(0)
    net = SmallNet()
    ddp = DDP(ref)
    if bf16:
        hook = default_hooks.bf16_compress_hook
        ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        config["grad_reduce_dtype"] = "bfloat16"
    model, optimizer = commsched.wrap(net, opt(net.parameters()),
                                      Config(group_bytes=0, **config), reads_grads=reads_grads)
    return ddp, opt(ddp.parameters()), model, optimizer


def _stored(model):
    return [g.buffer.untyped_storage().nbytes() > 0 for g in model._engine.groups]


def _comm_stored(model):
    return [g.comm.untyped_storage().nbytes() > 0 for g in model._engine.groups]


def _diff(model, ddp):
    return max((p - q).abs().max().item()
               for p, q in zip(model.module.parameters(), ddp.module.parameters()))


def _step_both(ddp, ddp_opt, model, opt, rank, step, set_to_none=True, zeroes="optimizer",
               observe=_stored):
    """One step of both; returns ``observe(model)`` after backward. ``zeroes``: whose
    zero_grad() the loop calls, the optimizer's, the model's (DDP's, and the one wrap
    returned) or the plain model's (``module``)."""
    for m in (ddp, model):
        x, y = _batch(rank, step)
        F.mse_loss(m(x), y).backward()
    observed = observe(model)
    ddp_opt.step()
    opt.step()
    zero = {"optimizer": (ddp_opt, opt), "model": (ddp, model),
            "module": (ddp.module, model.module)}[zeroes]
    for z in zero:
        z.zero_grad(set_to_none=set_to_none)
    return observed


def _default(rank):
    ddp, ddp_opt, model, opt = _pair()
    after_backward, after_forward = [], []
    for step in range(STEPS):
        after_backward.append(_step_both(ddp, ddp_opt, model, opt, rank, step))
        with torch.no_grad():
            model(_batch(rank, 99)[0])      # its pre-hooks run whatever update is left
        after_forward.append(_stored(model))
    return {"after_backward": after_backward, "after_forward": after_forward,
            "diff": _diff(model, ddp)}


def _model_zero_grad(rank, zeroes="model", bf16=False, decompose="none"):
    """The loop zeroes gradients with the model's zero_grad(), not the optimizer's."""
    ddp, ddp_opt, model, opt = _pair(_adamw, bf16=bf16, decompose=decompose)
    after_backward, after_forward = [], []
    for step in range(STEPS):
        # (in bfloat16 what backward writes is the copy in that type)
        after_backward.append(_step_both(ddp, ddp_opt, model, opt, rank, step,
                                         zeroes=zeroes,
                                         observe=_comm_stored if bf16 else _stored))
        with torch.no_grad():
            model(_batch(rank, 99)[0])      # its pre-hooks run whatever update is left
        after_forward.append(_stored(model))
    model.drain()
    return {"after_backward": after_backward, "after_forward": after_forward,
            "comm_after_drain": _comm_stored(model) if bf16 else None,
            "diff": _diff(model, ddp)}


def _bf16(rank):
    ddp, ddp_opt, model, opt = _pair(bf16=True)
    comm_after_backward = []
    for step in range(STEPS):
        _step_both(ddp, ddp_opt, model, opt, rank, step)
        comm_after_backward.append(_comm_stored(model))
    # (the last step's comm copies are cast back by drain)
    model.drain()
    return {"comm_after_drain": _comm_stored(model), "after_drain": _stored(model),
            "diff": _diff(model, ddp)}


def _keep_zeroed(rank, bf16=False, zeroes="optimizer"):
    ddp, ddp_opt, model, opt = _pair(bf16=bf16)
    for step in range(STEPS):
        _step_both(ddp, ddp_opt, model, opt, rank, step, set_to_none=False, zeroes=zeroes)
    model.drain()
    grads = [p.grad for p in model.module.parameters()]
    return {"after_drain": _stored(model), "diff": _diff(model, ddp),
            "grads_zero": all(g is not None and not g.any() for g in grads)}


def _no_sync(rank, bf16=False):
    ddp, ddp_opt, model, opt = _pair(bf16=bf16)
    under_no_sync = []
    for step in range(STEPS):
        for m in (ddp, model):
            with m.no_sync():
                x, y = _batch(rank, 50 + step)
                F.mse_loss(m(x), y).backward()
        under_no_sync.append(_stored(model))
        _step_both(ddp, ddp_opt, model, opt, rank, step)
    model.drain()
    return {"under_no_sync": under_no_sync, "after_drain": _stored(model),
            "diff": _diff(model, ddp)}


def _clip_and_scaler(rank, bf16=False):
    ddp, ddp_opt, model, opt = _pair(reads_grads=True, bf16=bf16)
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0) for _ in range(2)]
    read = []
    for step in range(STEPS):
        for m, o, scaler in ((ddp, ddp_opt, scalers[0]), (model, opt, scalers[1])):
            x, y = _batch(rank, step)
            scaler.scale(F.mse_loss(m(x), y)).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            if m is model:
                read.append(_stored(model))
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    model.drain()
    return {"read": read, "after_drain": _stored(model), "diff": _diff(model, ddp)}


def _drain_then_eval(rank):
    ddp, ddp_opt, model, opt = _pair(_adamw)
    for step in range(STEPS):
        _step_both(ddp, ddp_opt, model, opt, rank, step)
    model.drain()
    during_eval = _stored(model)
    with torch.no_grad():
        x = _batch(rank, 77)[0]
        out = (model(x) - ddp(x)).abs().max().item()
    return {"during_eval": during_eval, "eval_diff": out, "diff": _diff(model, ddp)}


def _checkpoint(rank):
    ddp, ddp_opt, model, opt = _pair(_adamw)
    at_checkpoint = None
    for step in range(STEPS):
        _step_both(ddp, ddp_opt, model, opt, rank, step)
        if step == 1:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state = opt.state_dict()
            at_checkpoint = _stored(model)
            model.load_state_dict(state)
            opt.load_state_dict(opt_state)
    model.drain()
    return {"at_checkpoint": at_checkpoint, "diff": _diff(model, ddp)}


def _kept_grad(rank):
    """The loop keeps the first layer's weight gradient past zero_grad()."""
    ddp, ddp_opt, model, opt = _pair()
    for m in (ddp, model):
        x, y = _batch(rank, 0)
        F.mse_loss(m(x), y).backward()
    kept = model.module.layers[0].weight.grad
    expected = ddp.module.layers[0].weight.grad.clone()
    ddp_opt.step()
    opt.step()
    ddp_opt.zero_grad()
    opt.zero_grad()
    model.drain()
    stored = _stored(model)
    kept_diff = (kept - expected).abs().max().item()
    for step in range(1, STEPS):
        _step_both(ddp, ddp_opt, model, opt, rank, step)
    model.drain()
    return {"after_drain": stored, "kept_diff": kept_diff, "diff": _diff(model, ddp)}


def _rs_ag(rank):
    ddp, ddp_opt, model, opt = _pair(_adamw, decompose="rs_ag")
    after_backward = []
    for step in range(STEPS):
        after_backward.append(_step_both(ddp, ddp_opt, model, opt, rank, step))
    model.drain()
    groups = model._engine.groups
    return {"after_backward": after_backward, "after_drain": _stored(model),
            "params_stored": [g.param_buffer.untyped_storage().nbytes() > 0 for g in groups],
            "diff": _diff(model, ddp)}


SCENARIOS = {"default": _default, "bf16": _bf16, "keep_zeroed": _keep_zeroed,
             "no_sync": _no_sync, "clip_and_scaler": _clip_and_scaler,
             "drain_then_eval": _drain_then_eval, "checkpoint": _checkpoint,
             "kept_grad": _kept_grad, "rs_ag": _rs_ag,
             # the loops that keep gradients, with bfloat16 all-reduces (against DDP with
             # PyTorch's bf16_compress_hook)
             "bf16_keep_zeroed": functools.partial(_keep_zeroed, bf16=True),
             "bf16_no_sync": functools.partial(_no_sync, bf16=True),
             "bf16_clip_and_scaler": functools.partial(_clip_and_scaler, bf16=True),
             # the model's zero_grad() in the loop: the one wrap returned, the plain
             # model's, with bfloat16 all-reduces, with rs_ag, keeping zeroed gradients
             "model_zero_grad": _model_zero_grad,
             "module_zero_grad": functools.partial(_model_zero_grad, zeroes="module"),
             "bf16_model_zero_grad": functools.partial(_model_zero_grad, bf16=True),
             "rs_ag_model_zero_grad": functools.partial(_model_zero_grad,
                                                        decompose="rs_ag"),
             "model_keep_zeroed": functools.partial(_keep_zeroed, zeroes="model"),
             "bf16_model_keep_zeroed": functools.partial(_keep_zeroed, bf16=True,
                                                         zeroes="model")}


def _worker(rank, world_size, out_dir):
    results = {}
    for name, scenario in SCENARIOS.items():
        results[name] = scenario(rank)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_storage")
    run_workers(_worker, 2, str(out), timeout=240)
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


def _all(ranks, name):
    return [r[name] for r in ranks]


def test_a_groups_memory_is_given_back_once_its_update_ran(ranks):
    for r in _all(ranks, "default"):
        # after step() + zero_grad() and the next forward, every update ran
        assert r["after_forward"] == [[False] * 3] * STEPS


def test_the_next_backward_restores_it_and_training_equals_ddp(ranks):
    for r in _all(ranks, "default"):
        assert r["after_backward"] == [[True] * 3] * STEPS
        assert r["diff"] == 0.0


def test_bfloat16_copies_live_from_backward_to_the_cast_back(ranks):
    for r in _all(ranks, "bf16"):
        assert r["comm_after_drain"] == [False] * 3
        assert r["after_drain"] == [False] * 3
        assert r["diff"] == 0.0       # DDP with PyTorch's bf16_compress_hook


@pytest.mark.parametrize("name", ["keep_zeroed", "bf16_keep_zeroed", "model_keep_zeroed",
                                  "bf16_model_keep_zeroed"])
def test_zero_grad_keeping_tensors_keeps_the_memory_and_zeroes_it(ranks, name):
    for r in _all(ranks, name):
        assert r["after_drain"] == [True] * 3
        assert r["grads_zero"]
        assert r["diff"] == 0.0


@pytest.mark.parametrize("name", ["no_sync", "bf16_no_sync"])
def test_no_sync_accumulation_restores_at_the_first_micro_batch(ranks, name):
    for r in _all(ranks, name):
        assert r["under_no_sync"] == [[True] * 3] * STEPS
        assert r["after_drain"] == [False] * 3
        assert r["diff"] == 0.0


@pytest.mark.parametrize("name", ["clip_and_scaler", "bf16_clip_and_scaler"])
def test_clip_grad_norm_and_grad_scaler_read_gradients_that_are_there(ranks, name):
    for r in _all(ranks, name):
        assert r["read"] == [[True] * 3] * STEPS
        assert r["after_drain"] == [False] * 3
        assert r["diff"] == 0.0


def test_drain_then_evaluation_runs_without_gradient_memory(ranks):
    for r in _all(ranks, "drain_then_eval"):
        assert r["during_eval"] == [False] * 3
        assert r["eval_diff"] == 0.0
        assert r["diff"] == 0.0


def test_a_checkpoint_between_steps_sees_no_gradient_memory_and_training_goes_on(ranks):
    for r in _all(ranks, "checkpoint"):
        assert r["at_checkpoint"] == [False] * 3
        assert r["diff"] == 0.0


def test_a_gradient_the_loop_keeps_keeps_its_group_and_its_values(ranks):
    for r in _all(ranks, "kept_grad"):
        assert r["after_drain"] == [True, False, False]
        assert r["kept_diff"] == 0.0
        assert r["diff"] == 0.0


@pytest.mark.parametrize("name", ["model_zero_grad", "module_zero_grad",
                                  "bf16_model_zero_grad", "rs_ag_model_zero_grad"])
def test_the_model_s_zero_grad_gives_the_memory_back_as_the_optimizer_s_does(ranks, name):
    """nn.Module's zero_grad() in the loop, of the wrapped model or of the plain one
    passed to wrap: queued behind the pending updates like the optimizer's, so the
    updates read their gradients (the parameters are DDP's, whose loop calls DDP's
    model.zero_grad()) and each group's memory goes after its update."""
    for r in _all(ranks, name):
        assert r["after_backward"] == [[True] * 3] * STEPS
        assert r["after_forward"] == [[False] * 3] * STEPS
        if r["comm_after_drain"] is not None:
            assert r["comm_after_drain"] == [False] * 3
        # (rs_ag: the tolerance of its other scenario here)
        assert r["diff"] == 0.0 if not name.startswith("rs_ag") else r["diff"] < 1e-6


def test_rs_ag_releases_gradients_never_the_parameters(ranks):
    for r in _all(ranks, "rs_ag"):
        assert r["after_backward"] == [[True] * 3] * STEPS
        assert r["after_drain"] == [False] * 3
        assert r["params_stored"] == [True] * 3
        assert r["diff"] < 1e-6


@pytest.mark.parametrize("config", [{}, {"grad_reduce_dtype": "bfloat16"},
                                    {"decompose": "rs_ag"}], ids=["fp32", "bf16", "rs_ag"])
def test_world_size_1_issues_every_collective_of_two_ranks(world1, monkeypatch, config):
    """One rank takes the path of two: every layer group's collectives are issued every
    iteration (nothing is skipped because the group has one rank), and the memory comes
    and goes as it does there. Counted where the lane issues each collective."""
    import commsched
    import commsched.issue as issue
    from commsched.config import Config

    issued = []
    issue_step = issue.issue_step

    def counting(chunk, step):
        issued.append((chunk.request.steps[step], chunk.request.key))
        return issue_step(chunk, step)

    monkeypatch.setattr(issue, "issue_step", counting)
    torch.manual_seed(0)
    net = SmallNet()
    model, opt = commsched.wrap(net, _adamw(net.parameters()), Config(group_bytes=0, **config))
    stored = []
    for step in range(STEPS):
        x, y = _batch(0, step)
        F.mse_loss(model(x), y).backward()
        # in bfloat16 what backward writes is the copy in that type
        stored.append(_comm_stored(model) if "grad_reduce_dtype" in config else _stored(model))
        opt.step()
        opt.zero_grad()
    model.drain()
    released = _stored(model)
    model.close()
    groups = [0, 1, 2]
    if config.get("decompose") == "rs_ag":
        # per iteration: the reduce-scatters, the usage flags' all-reduce, the all-gathers
        assert sorted(k for op, k in issued if op == "reduce_scatter") == sorted(
            ("rs", g) for g in groups * STEPS)
        assert sorted(k for op, k in issued if op == "all_gather") == sorted(
            ("ag", g) for g in groups * STEPS)
        assert [k for op, k in issued if op == "all_reduce"] == ["used"] * STEPS
    else:
        assert sorted(k for _, k in issued) == sorted(groups * STEPS)
        assert {op for op, _ in issued} == {"all_reduce"}
    assert stored == [[True] * 3] * STEPS
    assert released == [False] * 3
