"""Pending per-group updates whose gradients already arrived run as one optimizer step.

Reference: the plain optimizer stepping the plain model (one process, so the averaged
gradient is the local one). Under test: overlap mode with one layer group per module,
counting the real optimizer's step() calls. Single process (gloo, world size 1), bitwise.
"""

import pytest
import torch

from commsched.overlap import drain, wrap


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)


def _counted(optimizer):
    calls = [0]
    optimizer.register_step_pre_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def _wait_for_gradients(model):
    for g in model._engine.groups:
        if g.request is not None:
            g.request.wait()


class _Held:
    """A request that reads as still in flight until ``release()``: its group's update
    cannot run at step()."""

    def __init__(self, request):
        self.request = request
        self.future = self
        self.released = False

    def done(self):
        return self.released

    def release(self):
        self.request.wait()
        self.released = True

    def wait(self):
        self.release()
        return self.request.tensor


def test_step_after_every_gradient_arrived_is_one_optimizer_step(world1):
    ref, net = _mlp(), _mlp()
    ref_opt, inner = _adamw(ref.parameters()), _adamw(net.parameters())
    calls = _counted(inner)
    model, opt = wrap(net, inner, group_bytes=0)
    try:
        assert len(model._engine.groups) == 3
        for step in range(3):
            x = torch.randn(5, 4)
            ref(x).square().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(x).square().sum().backward()
            _wait_for_gradients(model)
            before = calls[0]
            opt.step()
            assert calls[0] - before == 1
            opt.zero_grad()
            assert calls[0] - before == 1
        drain(model)
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.equal(a, b)
    finally:
        model.close()


def test_updates_pending_at_step_all_run_before_the_first_module_runs(world1):
    ref, net = _mlp(), _mlp()
    ref_opt, inner = _adamw(ref.parameters()), _adamw(net.parameters())
    calls = _counted(inner)
    model, opt = wrap(net, inner, group_bytes=0)
    pending_at_first_module = []
    net[0].register_forward_pre_hook(lambda m, args: pending_at_first_module.append(
        sum(1 for g in model._engine.groups if g.actions)))
    try:
        x = torch.randn(5, 4)
        ref(x).square().sum().backward()
        ref_opt.step()
        model(x).square().sum().backward()
        held = [_Held(g.request) for g in model._engine.groups]
        for g, h in zip(model._engine.groups, held):
            g.request = h
        opt.step()
        assert calls[0] == 0 and all(g.actions for g in model._engine.groups)
        for h in held:
            h.release()
        model(x)
        assert calls[0] == 1
        assert pending_at_first_module[-1] == 0
        drain(model)
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.equal(a, b)
    finally:
        model.close()
