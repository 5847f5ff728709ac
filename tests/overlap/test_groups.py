"""Layer groups: fixed at wrap time from the module tree alone (identical on every rank)."""

import torch

from commsched.overlap.groups import build_groups


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)          # 80 bytes of gradient
        self.b = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.c = torch.nn.Linear(4, 4, bias=False)
        self.c.weight = self.a.weight           # shared with a


def test_one_group_per_parameter_owning_module_in_registration_order():
    net = Net()
    groups, _ = build_groups(net, group_bytes=0)
    assert [g.names for g in groups] == [["a.weight", "a.bias"], ["b.weight", "b.bias"]]
    assert [g.first for g in groups] == [0, 2]
    assert [g.numel for g in groups] == [20, 20]


def test_shared_parameter_counted_once_and_waited_for_by_every_owner():
    net = Net()
    groups, module_groups = build_groups(net, group_bytes=0)
    assert sum(len(g.params) for g in groups) == 4
    assert module_groups[net.c] == [0]          # c's forward waits for a's group
    assert net.frozen not in module_groups


def test_small_modules_merge_until_group_bytes_at_module_boundaries():
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])   # 80 B each
    groups, _ = build_groups(net, group_bytes=150)
    assert [len(g.params) for g in groups] == [4, 4, 2]


def test_dtype_change_closes_a_group():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double())
    groups, _ = build_groups(net, group_bytes=1 << 20)
    assert [g.dtype for g in groups] == [torch.float32, torch.float64]
