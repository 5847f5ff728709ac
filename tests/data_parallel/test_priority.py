"""What the data-parallel mode hands the scheduler: each layer group with priority = its forward
position (lower = needed earlier by the next forward), submitted in backward in descending
order (the last layer first); with rs_ag, the all-gathers in ascending forward order.

Observed through a Scheduler subclass passed as ``wrap(..., scheduler=...)``. Each
submitted tensor is attributed to a layer by memory (the layer's gradients live in a
reduced buffer, its parameters in a gathered one), and the expected order is the order in
which forward pre-hooks, registered by the test on the plain model, saw each layer first:
nothing is read from the engine. Single process (gloo, world size 1), one layer group per
module (group_bytes=0).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import commsched
from commsched.data_parallel import drain, wrap
from commsched.scheduler import Scheduler


class Net(nn.Module):
    """Five parameter-owning layers; ``skip`` is used in even steps only (in odd steps its
    group is submitted at the end of backward, still in order)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.skip = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, step):
        h = F.relu(self.a(F.relu(self.embed(x))))
        h = self.norm(h)
        if step % 2 == 0:
            h = h + self.skip(h)
        return self.head(h)


def _span(t: torch.Tensor):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class RecordingScheduler(Scheduler):
    """Logs (op, priority, layer) of every submission; the layer is found by which layer's
    gradients (reductions) or parameters (all-gathers) lie in the submitted tensor."""

    def __init__(self, config, layers):
        super().__init__(config)
        self.layers = layers
        self.log = []
        # a reduced buffer -> its layer, learnt when it had grads (by the tensor, not its
        # span: a group's memory is given back between steps and may come back elsewhere)
        self.owner = {}

    def submit(self, tensor, *, key, priority=0, op="all_reduce", **kwargs):
        lo, hi = _span(tensor)
        found = set()
        with torch._C.DisableTorchFunctionSubclass():     # reading .grad must not sync
            for name, m in self.layers.items():
                for p in m.parameters(recurse=False):
                    t = p if op == "all_gather" else p.grad
                    if t is not None and lo <= t.data_ptr() < hi:
                        found.add(name)
        assert len(found) <= 1, (op, priority, found)         # group_bytes=0
        layer = found.pop() if found else None
        if layer is not None and op != "all_gather":
            self.owner[id(tensor)] = layer
        self.log.append({"op": op, "priority": priority, "layer": layer, "span": (lo, hi),
                         "key": key, "tensor": id(tensor)})
        return super().submit(tensor, key=key, priority=priority, op=op, **kwargs)

    def resolve(self):
        for e in self.log:
            if e["layer"] is None and e["op"] != "all_gather":
                e["layer"] = self.owner.get(e["tensor"])
        return self.log


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_layer_groups_are_submitted_with_forward_order_priorities(world1, decompose):
    torch.manual_seed(0)
    net = Net()
    layers = {n: m for n, m in net.named_modules()
              if any(True for _ in m.parameters(recurse=False))}
    first_use = []
    for name, m in layers.items():
        m.register_forward_pre_hook(
            lambda mod, args, name=name: first_use.append(name) if name not in first_use
            else None)
    config = commsched.Config(decompose=decompose, partition_bytes=256, credit_bytes=1024)
    sched = RecordingScheduler(config, layers)
    model, opt = wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), config,
                      group_bytes=0, scheduler=sched)
    backward_windows = []
    try:
        for step in range(6):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x, step).square().mean()
            start = len(sched.log)
            loss.backward()
            backward_windows.append((start, len(sched.log)))
            opt.step()
            opt.zero_grad()
        drain(model)
    finally:
        model.close()
    log = sched.resolve()

    # the expectation, from the model alone: the order forward first used each layer
    assert sorted(first_use) == sorted(layers)
    position = {name: i for i, name in enumerate(first_use)}
    reduce_op = "all_reduce" if decompose == "none" else "reduce_scatter"
    reductions = [e for e in log if e["op"] == reduce_op and e["key"] != "used"]
    assert all(e["layer"] is not None for e in reductions), reductions

    # one priority per layer, the same every iteration, increasing in forward order
    priority = {}
    for e in reductions:
        assert priority.setdefault(e["layer"], e["priority"]) == e["priority"], e
    in_forward_order = [priority[name] for name in first_use]
    assert all(a < b for a, b in zip(in_forward_order, in_forward_order[1:])), \
        (first_use, in_forward_order)

    # every backward submits every layer once, the last layer first
    for start, end in backward_windows:
        got = [position[e["layer"]] for e in log[start:end]
               if e["op"] == reduce_op and e["key"] != "used"]
        assert got == list(range(len(layers)))[::-1], (start, got)

    if decompose == "rs_ag":
        # the updated parameters are gathered in forward order, with the same priorities
        gathers = [e for e in log if e["op"] == "all_gather"]
        assert len(gathers) == 6 * len(layers)
        for k in range(0, len(gathers), len(layers)):
            round_ = gathers[k:k + len(layers)]
            assert [position[e["layer"]] for e in round_] == list(range(len(layers)))
            assert [e["priority"] for e in round_] == in_forward_order
