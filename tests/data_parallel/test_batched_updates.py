"""Pending per-group updates whose gradients already arrived run as one optimizer step.

Reference: the plain optimizer stepping the plain model (one process, so the averaged
gradient is the local one). Under test: the data-parallel mode with one layer group per module,
counting the real optimizer's step() calls. Single process (gloo, world size 1), bitwise.
"""

import contextlib

import pytest
import torch

from commsched.data_parallel import drain, wrap


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


def _backward_both(ref, ref_opt, model, x):
    """A whole reference step, then the model's forward and backward on the same batch."""
    ref(x).square().sum().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    model(x).square().sum().backward()


def _assert_same(ref, net):
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)


@contextlib.contextmanager
def _ends_like_the_reference(ref, net, model):
    """Run the block; then every update drained, the model's parameters must equal the
    reference's. The wrapped model is closed either way."""
    try:
        yield
        drain(model)
        _assert_same(ref, net)
    finally:
        model.close()


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

    def finished(self):
        return self.released and self.request.finished()

    def __getattr__(self, name):
        return getattr(self.request, name)

    def release(self):
        self.request.wait()
        self.released = True

    def wait(self):
        self.release()
        return self.request.tensor


def _step_pending(ref, ref_opt, model, opt, x):
    """A reference step on ``x``; then the model's backward and step(), with every group's
    request read as in flight at step() (no update runs there), released afterwards: the
    updates are pending for the next forward."""
    ref(x).square().sum().backward()
    ref_opt.step()
    model(x).square().sum().backward()
    groups = model._engine.groups
    held = [_Held(g.request) for g in groups]
    for g, h in zip(groups, held):
        g.request = h
    opt.step()
    for h in held:
        h.release()


def test_step_after_every_gradient_arrived_is_one_optimizer_step(world1):
    ref, net = _mlp(), _mlp()
    ref_opt, inner = _adamw(ref.parameters()), _adamw(net.parameters())
    calls = _counted(inner)
    model, opt = wrap(net, inner, group_bytes=0)
    with _ends_like_the_reference(ref, net, model):
        assert len(model._engine.groups) == 3
        for step in range(3):
            _backward_both(ref, ref_opt, model, torch.randn(5, 4))
            _wait_for_gradients(model)
            before = calls[0]
            opt.step()
            assert calls[0] - before == 1
            opt.zero_grad()
            assert calls[0] - before == 1


def test_updates_pending_at_step_all_run_before_the_first_module_runs(world1):
    ref, net = _mlp(), _mlp()
    ref_opt, inner = _adamw(ref.parameters()), _adamw(net.parameters())
    calls = _counted(inner)
    model, opt = wrap(net, inner, group_bytes=0)
    pending_at_first_module = []
    net[0].register_forward_pre_hook(lambda m, args: pending_at_first_module.append(
        sum(1 for g in model._engine.groups if g.actions)))
    with _ends_like_the_reference(ref, net, model):
        x = torch.randn(5, 4)
        _step_pending(ref, ref_opt, model, opt, x)
        assert calls[0] == 0 and all(g.actions for g in model._engine.groups)
        model(x)
        assert calls[0] == 1
        assert pending_at_first_module[-1] == 0


class _Running:
    """A request issued but still running on the device, as a CUDA request reads between
    its issue and its end: done (CUDA stream semantics), not finished."""

    def __init__(self, request):
        self.request = request
        self.future = self

    def done(self):
        return True

    def finished(self):
        return False

    def wait(self):
        return self.request.wait()

    def __getattr__(self, name):
        return getattr(self.request, name)


def _stepped(optimizer):
    """The parameters of each step() call, as sets of ids."""
    steps = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: steps.append(
        {id(p) for group in opt.param_groups for p in group["params"]}))
    return steps


def _ids(groups):
    return {id(p) for g in groups for p in g.params}


def _stepped_pair():
    """The reference MLP and optimizer, and the wrapped ones (one layer group per Linear)
    with the parameters of each of the optimizer's step() calls (see _stepped)."""
    ref, net = _mlp(), _mlp()
    ref_opt, inner = _adamw(ref.parameters()), _adamw(net.parameters())
    steps = _stepped(inner)
    model, opt = wrap(net, inner, group_bytes=0)
    return ref, ref_opt, net, model, opt, steps


def _issued_after_the_first(groups, first, later):
    """groups[0]'s request ``first`` and groups[1]'s ``later`` read as still running, with
    ``later`` issued right after ``first``."""
    first, later = _Running(first), _Running(later)
    later.issue_seq = first.issue_seq + 1
    groups[0].request, groups[1].request = first, later


def test_updates_issued_before_a_running_collective_go_in_a_step_before_it(world1):
    # At step(): the last issued request (inline dispatch: the first layer's group, whose
    # gradient came last) still runs; the others' updates must not queue behind it.
    ref, ref_opt, net, model, opt, steps = _stepped_pair()
    groups = model._engine.groups
    with _ends_like_the_reference(ref, net, model):
        for step in range(3):
            _backward_both(ref, ref_opt, model, torch.randn(5, 4))
            _wait_for_gradients(model)
            running = max(groups, key=lambda g: g.request.issue_seq)
            assert running is groups[0]
            running.request = _Running(running.request)
            del steps[:]
            opt.step()
            assert steps == [_ids(groups[1:]), _ids(groups[:1])]
            opt.zero_grad()


def test_step_leaves_running_groups_issued_after_the_first_layers_to_their_forward(world1):
    # A plan issued the first layer's request (groups[0]) before groups[1]'s, and both
    # still run. At step(), groups[1]'s update must not join: on a GPU the stream would
    # wait for its collective before the next forward's first layer. It runs at its own
    # module's forward pre-hook instead.
    ref, ref_opt, net, model, opt, steps = _stepped_pair()
    groups = model._engine.groups
    with _ends_like_the_reference(ref, net, model):
        for step in range(3):
            x = torch.randn(5, 4)
            _backward_both(ref, ref_opt, model, x)
            _wait_for_gradients(model)
            _issued_after_the_first(groups, groups[0].request, groups[1].request)
            del steps[:]
            opt.step()
            opt.zero_grad()
            assert steps == [_ids(groups[2:]), _ids(groups[:1])]
            assert groups[1].actions and not groups[0].actions and not groups[2].actions
            model(x)          # the forward pre-hook of groups[1]'s module
            assert steps[2:] == [_ids(groups[1:2])] and not groups[1].actions


def test_first_forward_hook_leaves_running_groups_issued_after_its_own(world1):
    ref, ref_opt, net, model, opt, steps = _stepped_pair()
    groups = model._engine.groups
    seen = []
    net[1].register_forward_pre_hook(lambda m, args: seen.append(list(steps)))
    with _ends_like_the_reference(ref, net, model):
        x = torch.randn(5, 4)
        _step_pending(ref, ref_opt, model, opt, x)
        _issued_after_the_first(groups, groups[0].request.request, groups[1].request.request)
        del seen[:]
        model(x)
        # After the first module: groups[2] (issued before groups[0]), then groups[0];
        # groups[1] only when its own module runs.
        assert seen == [[_ids(groups[2:]), _ids(groups[:1])]]
        assert steps == [_ids(groups[2:]), _ids(groups[:1]), _ids(groups[1:2])]


def test_first_forward_hook_updates_groups_issued_before_its_running_one_first(world1):
    ref, ref_opt, net, model, opt, steps = _stepped_pair()
    groups = model._engine.groups
    with _ends_like_the_reference(ref, net, model):
        x = torch.randn(5, 4)
        _step_pending(ref, ref_opt, model, opt, x)
        assert steps == []
        groups[0].request = _Running(groups[0].request.request)
        # One all-done group issued after the running one joins its step.
        groups[2].request.request.issue_seq = groups[0].request.issue_seq + 1
        model(x)
        assert steps == [_ids(groups[1:2]), _ids(groups[0:1] + groups[2:])]


def test_sparse_gradients_match_the_plain_optimizer(world1):
    # A sparse gradient cannot be handed over to the dense slot: it is added to it.
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True),
                                   torch.nn.Linear(4, 2))
    ref, inner_net = net(), net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = wrap(inner_net, torch.optim.SGD(inner_net.parameters(), lr=0.1),
                      group_bytes=0)
    try:
        for step in range(3):
            idx = torch.randperm(10)[:4]       # no index twice: sums in one order
            ref(idx).square().sum().backward()
            assert ref[0].weight.grad.is_sparse
            ref_opt.step()
            ref_opt.zero_grad()
            model(idx).square().sum().backward()
            opt.step()
            opt.zero_grad()
        drain(model)
        _assert_same(ref, inner_net)
    finally:
        model.close()


def test_a_group_waiting_behind_an_unused_parameter_holds_no_handed_over_gradient(world1):
    # The last layer is unused: its group is submitted only at the end of backward, and
    # the groups below it wait. Their gradients, handed over by autograd, must already
    # be in their slots meanwhile (no second copy of the gradients held).
    from commsched.data_parallel.groups import GradView

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = (torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    net = Net()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), group_bytes=0)
    seen = []
    net.a.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append([type(q.grad) for q in net.b.parameters()]))
    try:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert len(seen) == 2
        assert all(issubclass(t, GradView) for types in seen for t in types), seen
    finally:
        model.close()


class _SideUse(torch.nn.Module):
    """``head`` is called in forward, or (``side=True``) its weights are used directly,
    outside its forward: then no forward pre-hook settles its layer group."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x, side=False):
        h = torch.tanh(self.a(x))
        if side:
            return torch.nn.functional.linear(h, self.head.weight, self.head.bias)
        return self.head(h)


def test_a_parameter_used_outside_its_module_before_its_update_is_an_error(world1):
    ref, net = _SideUse(), _SideUse()
    ref_opt = _adamw(ref.parameters())
    model, opt = wrap(net, _adamw(net.parameters()), group_bytes=0)
    try:
        _step_pending(ref, ref_opt, model, opt, torch.randn(5, 4))
        model._engine.groups[1].request.released = False    # head's: not due at a's hook
        loss = model(torch.randn(5, 4), side=True).square().sum()
        with pytest.raises(RuntimeError, match="'head.(weight|bias)' was used in forward before"):
            loss.backward()
    finally:
        model.close()


def test_a_parameter_reached_again_after_its_group_was_submitted_is_an_error(world1):
    # Reentrant checkpointing runs its own backward: ``a`` used inside and outside the
    # checkpoint gets its gradient in two passes, after its group went in the first.
    from torch.utils.checkpoint import checkpoint

    class Twice(_SideUse):
        def forward(self, x, side=False):
            h = torch.tanh(self.a(x))
            h = checkpoint(lambda t: torch.tanh(self.a(t[:, :4])), h, use_reentrant=True)
            return self.head(h)

    net = Twice()
    model, opt = wrap(net, _adamw(net.parameters()), group_bytes=0)
    try:
        loss = model(torch.randn(5, 4).requires_grad_()).square().sum()
        with pytest.raises(RuntimeError, match="'a.(weight|bias)' received a gradient after"):
            loss.backward()
    finally:
        model.close()
