"""Layer groups: fixed at wrap time from the module tree alone (identical on every rank)."""

import torch

from commsched.data_parallel.groups import build_groups


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


def test_first_groups_grow_from_first_bytes_to_group_bytes():
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(9)])   # 80 B each
    groups, _ = build_groups(net, group_bytes=320, first_bytes=80)
    # caps 80, 160, 320, 320: the group backward ends with (the first) is the smallest
    assert [len(g.params) // 2 for g in groups] == [1, 2, 4, 2]
    assert [g.first for g in groups] == [0, 2, 6, 14]
    same, _ = build_groups(net, group_bytes=320, first_bytes=0)
    assert [len(g.params) // 2 for g in same] == [4, 4, 1]
    # at or above the group size, or with one group per module, nothing changes
    for first in (320, 1 << 40):
        assert ([g.names for g in build_groups(net, 320, first_bytes=first)[0]]
                == [g.names for g in same])
    assert len(build_groups(net, 0, first_bytes=80)[0]) == 9


def test_a_group_of_its_own_does_not_count_towards_the_first_groups():
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    net[0].weight.requires_grad_(False)
    embed = torch.nn.Embedding(5, 4)                                        # 80 B
    net.insert(0, embed)
    groups, _ = build_groups(net, group_bytes=320, first_bytes=80,
                             alone={id(embed.weight): False})
    # the embedding alone, then caps 80, 160, 320 for the others
    assert [g.names for g in groups] == [["0.weight"], ["1.bias", "2.weight", "2.bias"],
                                         ["3.weight", "3.bias", "4.weight", "4.bias"]]
