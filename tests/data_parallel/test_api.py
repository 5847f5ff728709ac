"""wrap()/drain() on one process (gloo, world size 1): API contract and clear errors."""

import copy

import pytest
import torch

import commsched
from commsched.data_parallel import DataParallelOptimizer, drain, wrap

from tiny_nets import tiny_mlp


def test_wrapped_optimizer_drives_lr_schedulers_on_the_real_param_groups(world1):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=0)
    try:
        assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, DataParallelOptimizer)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        assert opt.optimizer.param_groups[0]["lr"] == 0.05
    finally:
        model.close()


def test_wrap_rejects_ddp_models_rewrapping_and_lbfgs(world1):
    net = tiny_mlp()
    with pytest.raises(TypeError, match="LBFGS"):
        wrap(net, torch.optim.LBFGS(net.parameters()))
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        with pytest.raises(TypeError, match="already wrapped"):
            wrap(model, opt)
    finally:
        model.close()
    with pytest.raises(TypeError, match="commsched.drain"):
        drain(net)


def test_layer_group_size_comes_from_the_config_unless_passed(world1):
    def groups(config=None, **kwargs):
        net = tiny_mlp()
        model, _ = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), config, **kwargs)
        try:
            return len(model._engine.groups)
        finally:
            model.close()
    # Two Linear layers: 0 bytes per group closes one group per module, the default one.
    assert groups() == 1
    assert groups(commsched.Config(group_bytes=0)) == 2
    assert groups(commsched.Config(group_bytes=0), group_bytes=1 << 20) == 1
    assert groups(commsched.Config(), group_bytes=0) == 2
    # A first group of 1 byte closes after the first module; the next may hold 2 bytes.
    assert groups(commsched.Config(first_group_bytes=1)) == 2
    assert groups(commsched.Config(first_group_bytes=1), group_bytes=1 << 20) == 2
    net = tiny_mlp()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"group_bytes={bad!r}"):
            wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=bad)
    assert all(not m._forward_pre_hooks for m in net.modules())      # nothing half-applied


@pytest.mark.parametrize("decompose", ["hier", "leader"])
def test_topology_decompositions_are_refused_naming_the_variable(world1, decompose):
    net = tiny_mlp()
    with pytest.raises(ValueError, match=f"decompose='{decompose}'.*COMMSCHED_DECOMPOSE"):
        wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
             commsched.Config(decompose=decompose))
    assert all(not m._forward_pre_hooks for m in net.modules())      # nothing half-applied


def test_rs_ag_rejects_optimizers_that_are_not_elementwise(world1):
    net = tiny_mlp()
    with pytest.raises(TypeError, match="Adafactor"):
        wrap(net, torch.optim.Adafactor(net.parameters()), commsched.Config(decompose="rs_ag"))


def test_rs_ag_second_synchronised_backward_without_zero_grad_is_an_error(world1):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
                      commsched.Config(decompose="rs_ag"), group_bytes=0)
    try:
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            model(torch.randn(3, 4)).sum().backward()
    finally:
        model.close()


def test_non_reentrant_checkpointing_trains_like_the_plain_model(world1):
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
                                      torch.nn.Linear(8, 2))

        def forward(self, x):
            h = checkpoint(lambda t: torch.relu(self.b(torch.relu(self.a(t)))), x,
                           use_reentrant=False)
            return self.c(h)

    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    net = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    model, opt = wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), group_bytes=0)
    try:
        for step in range(5):
            x = torch.randn(6, 4)
            for m, o in ((ref, ref_opt), (model, opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        drain(model)
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.equal(a, b)
    finally:
        model.close()


def test_zero_grad_sets_grads_to_none_and_reading_them_waits(world1):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=0,
                      reads_grads=True)
    try:
        model(torch.ones(3, 4)).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]   # averaged over 1 rank: as is
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
        opt.step()
        opt.zero_grad()
        drain(model)
        assert all(p.grad is None for p in net.parameters())
    finally:
        model.close()


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_checkpoint_round_trip_continues_identically(world1, decompose):
    config = commsched.Config(decompose=decompose)

    def run(model, opt, steps, seed):
        torch.manual_seed(seed)
        for _ in range(steps):
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    a_net = tiny_mlp()
    a, a_opt = wrap(a_net, torch.optim.AdamW(a_net.parameters(), lr=0.01), config,
                    group_bytes=0)
    b_net = tiny_mlp()
    b, b_opt = wrap(b_net, torch.optim.AdamW(b_net.parameters(), lr=0.01), config,
                    group_bytes=0)
    try:
        run(a, a_opt, 3, seed=1)
        b.load_state_dict(a.state_dict())                 # both drain first
        # torch's optimizer state dicts hold references to the live state: copy
        b_opt.load_state_dict(copy.deepcopy(a_opt.state_dict()))
        run(a, a_opt, 2, seed=2)
        run(b, b_opt, 2, seed=2)
        drain(a)
        drain(b)
        for p, q in zip(a_net.parameters(), b_net.parameters()):
            assert torch.equal(p, q)
    finally:
        a.close()
        b.close()


def _engine_pre_hooks(module):
    return [h for h in module._forward_pre_hooks.values()
            if getattr(getattr(h, "func", None), "__name__", "") == "_forward_pre_hook"]


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_forward_pre_hooks_only_while_a_group_is_pending(world1, decompose):
    """A module carries the engine's forward pre-hook only while one of its layer groups
    has a request or actions pending (rs_ag: always, its first pre-hook runs the round),
    first among the module's pre-hooks; a forward without one takes nn.Module's plain
    call path. The updates still land before each module's forward: the parameters
    follow plain SGD on the same batches."""
    net, ref = tiny_mlp(), tiny_mlp()
    user_calls = []
    linears = [net[0], net[2]]
    linears[0].register_forward_pre_hook(lambda m, args: user_calls.append(1))
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
                      commsched.Config(decompose=decompose), group_bytes=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    always = decompose == "rs_ag"
    hooked = lambda: [len(_engine_pre_hooks(m)) for m in linears]  # noqa: E731
    try:
        assert hooked() == ([1, 1] if always else [0, 0])
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            ref(x).sum().backward()
            # Both groups were submitted: pending until settled.
            assert hooked() == [1, 1]
            first = list(linears[0]._forward_pre_hooks.values())[0]
            assert first.func.__name__ == "_forward_pre_hook"
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 1:
                drain(model)
                assert hooked() == ([1, 1] if always else [0, 0])
        model(torch.randn(3, 4))            # settles whatever the last step left
        assert hooked() == ([1, 1] if always else [0, 0])
        assert len(user_calls) == 4
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    finally:
        model.close()
    assert hooked() == [0, 0]
    assert len(linears[0]._forward_pre_hooks) == 1       # the user's own stays


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_a_dropped_model_and_optimizer_are_freed_with_the_scheduler_s_threads(
        world1, decompose):
    """As with DDP, dropping what wrap() returned frees the model, its optimizer state and
    the scheduler's threads: no close() needed."""
    import gc
    import threading
    import weakref

    before = {t.name for t in threading.enumerate()}
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.AdamW(net.parameters()),
                      commsched.Config(decompose=decompose), group_bytes=0)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    drain(model)
    param = weakref.ref(net[0].weight)
    state = weakref.ref(opt.state[net[0].weight]["exp_avg"] if decompose == "none"
                        else next(iter(opt.state.values()))["exp_avg"])
    assert {t.name for t in threading.enumerate()} - before     # (the lanes' threads)
    del model, opt, net
    gc.collect()
    assert param() is None and state() is None
    assert {t.name for t in threading.enumerate()} <= before


def test_close_still_works_and_a_closed_model_refuses_to_step(world1):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(3, 4)).sum().backward()
    model.close()
    assert all(not m._forward_pre_hooks for m in net.modules())
    with pytest.raises(commsched.CommschedError, match="optimizer.step\\(\\) after the wrapped "
                                                      "model was closed"):
        opt.step()
    with pytest.raises(commsched.CommschedError, match="a forward after"):
        model(torch.randn(3, 4))
