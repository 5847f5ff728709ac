"""A loop that zeroes gradients with the model's ``zero_grad()`` (nn.Module's: the one a loop
written for DDP calls on its model, or on the plain model it still holds) trains as it does
with the optimizer's: the call is queued behind the updates still pending, which read their
gradients first.

Against stock DDP with the same loop (DDP's ``model.zero_grad()``), 2 gloo ranks, 20 steps:
bitwise, as the other trajectories (test_trajectories.py says why 2 ranks are bitwise).
The memory each group's gradients take with that loop: test_grad_storage.py.
"""

from copy import deepcopy

import pytest
import torch

import commsched
from commsched.data_parallel import drain, wrap

from tiny_nets import tiny_mlp

from .scenarios import CASES_2

MODEL_ZERO_GRAD = sorted(n for n in CASES_2 if CASES_2[n].zero_grad != "optimizer")


def test_the_scenarios_cover_both_holders_both_set_to_none_and_both_decompositions():
    specs = [CASES_2[n] for n in MODEL_ZERO_GRAD]
    assert {s.zero_grad for s in specs} == {"model", "module"}
    assert {(s.decompose, s.set_to_none) for s in specs} == {
        ("none", True), ("none", False), ("rs_ag", True), ("rs_ag", False)}


@pytest.mark.parametrize("name", MODEL_ZERO_GRAD)
def test_the_model_s_zero_grad_trains_bitwise_as_ddp_with_the_same_loop(two_ranks, name):
    r = two_ranks[name]
    for key in ("loss", "seen", "final", "opt_state"):
        if key in r:
            assert r[key] == 0.0, (name, key, r[key])
    assert r["seen_count"] > 0


@pytest.mark.parametrize("name", MODEL_ZERO_GRAD)
def test_the_model_s_zero_grad_leaves_the_updates_overlapping_the_next_forward(
        two_ranks, name):
    # The comparison above means something only if updates were still pending when the
    # loop zeroed; and keeping zeroed gradients (set_to_none=False) reads no gradient from
    # Python, so nothing waits for the communication and nothing warns.
    r = two_ranks[name]
    assert r["in_flight"] > 0
    assert r["warnings"] == 0


def test_the_plain_model_s_zero_grad_goes_through_the_mode_until_it_is_closed(world1):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=0)
    try:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        net.zero_grad()
        drain(model)
        assert all(p.grad is None for p in net.parameters())
    finally:
        model.close()
    assert net.zero_grad.__func__ is torch.nn.Module.zero_grad
    net(torch.randn(3, 4)).sum().backward()
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    with pytest.raises(commsched.CommschedError,
                       match=r"model.zero_grad\(\) after the wrapped model was closed"):
        model.zero_grad()


def test_a_deep_copy_of_the_plain_model_is_not_wrapped(world1):
    """An EMA copy, say: its zero_grad() is nn.Module's, on its own gradients; the wrapped
    model trains on as the plain model does."""
    net, ref = tiny_mlp(), tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for m, o, holder in ((model, opt, net), (ref, ref_opt, ref)):
                m(x).square().sum().backward()
                o.step()
                holder.zero_grad()
            if step == 0:
                drain(model)
                copy = deepcopy(net)
                copy(x).sum().backward()
                copy.zero_grad()
                assert all(p.grad is None for p in copy.parameters())
        drain(model)
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    finally:
        model.close()


def test_a_model_class_with_its_own_zero_grad_keeps_it(world1):
    class Own(torch.nn.Sequential):
        def zero_grad(self, set_to_none=True):
            self.calls = getattr(self, "calls", 0) + 1
            super().zero_grad(set_to_none)

    torch.manual_seed(0)
    net = Own(torch.nn.Linear(4, 2))
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        assert net.zero_grad.__func__ is Own.zero_grad
        net.zero_grad()
        assert net.calls == 1
    finally:
        model.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_model_s_zero_grad_takes_parameters_the_optimizer_does_not_hold(
        world1, set_to_none):
    """As nn.Module's: every parameter of the model, in a layer group or frozen, whether or
    not the optimizer holds it; the optimizer's zero_grad() takes only those it holds. The
    reference is the plain model under the same calls (one rank: the averaged gradient is
    the local one)."""
    def build():
        net = tiny_mlp()
        net[0].bias.requires_grad_(False)       # frozen: in no layer group
        net[0].bias.grad = torch.ones(8)
        return net

    ref, net = build(), build()
    # the optimizer holds the first layer's weight only: both layer groups hold others
    ref_opt = torch.optim.SGD([ref[0].weight], lr=0.1)
    model, opt = wrap(net, torch.optim.SGD([net[0].weight], lr=0.1), group_bytes=0)
    try:
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for m, o in ((ref, ref_opt), (model, opt)):
                m(x).square().sum().backward()
                o.step()
                o.zero_grad(set_to_none=set_to_none)
        drain(model)
        # the optimizer's zero_grad() left the others' gradients accumulating
        for p, q in zip(net.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad)
        assert net[2].weight.grad is not None
        for m in (ref, model):
            m.zero_grad(set_to_none=set_to_none)
        drain(model)
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.equal(p, q)
            if set_to_none:
                assert p.grad is None and q.grad is None
            else:
                assert torch.equal(p.grad, torch.zeros_like(p)) and torch.equal(q.grad, p.grad)
        if set_to_none:
            # no gradient left in either group: their memory went (storage.py)
            assert [g.buffer.untyped_storage().nbytes() for g in model._engine.groups] == [0, 0]
    finally:
        model.close()
