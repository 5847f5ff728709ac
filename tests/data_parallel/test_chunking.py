"""How the data-parallel mode cuts a layer group's all-reduce into chunks.

A layer group is cut into partition-size chunks, which the plan may interleave with other
groups' (with or without a byte window), unless a window of whole layer groups applies
(``groups_in_flight``): then the queued groups are what overtakes, and each goes as one
collective. Either way the parameters after training equal those of the same optimizer
stepping the plain model (one process, so the all-reduce is the identity). Observed
through the scheduler's dispatch log.
"""

import pytest
import torch
import torch.nn as nn

import commsched
from commsched.data_parallel import wrap
from commsched.scheduler import Scheduler

PARTITION = 4096           # bytes: the 64x64 layer (16.6 KB) is 5 chunks of it (4 + remainder)
STEPS = 4


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g)


def _train(model, opt):
    for step in range(STEPS):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("credit", [0, 3 * PARTITION])
def test_groups_are_cut_by_the_partition_size_with_or_without_a_byte_window(world1, credit):
    reference = _net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    _train(reference, ref_opt)

    net = _net()
    config = commsched.Config(partition_bytes=PARTITION, credit_bytes=credit)
    scheduler = Scheduler(config, trace_dispatch=True)
    model, opt = wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), config,
                      group_bytes=0, scheduler=scheduler)
    try:
        _train(model, opt)
        model.drain()
        log = scheduler.dispatch_log(model._engine.reduce_group)
        groups = model._engine.groups
        assert not model._engine.whole_groups
    finally:
        model.close()

    chunks = {}
    for entry in log:
        if entry[0] == "plan":          # (a plan was built: not a dispatch)
            continue
        iteration, key, chunk, _ = entry
        chunks.setdefault((iteration, key), set()).add(chunk)
    assert len(chunks) == STEPS * len(groups) == STEPS * 3
    for g in groups:
        nbytes = g.buffer.numel() * g.buffer.element_size()
        # the partition's count: the remainder under 1/8 rides along
        expected = max(1, nbytes // PARTITION)
        for it in range(STEPS):
            assert len(chunks[(it, g.index)]) == expected, (g.index, nbytes, chunks)
    assert any(len(c) > 1 for c in chunks.values())
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("settings, groups", [({"groups_in_flight": 2}, 2),
                                              ({"groups_in_flight": 1}, 1)])
def test_without_a_byte_window_whole_groups_go_under_a_window_of_layer_groups(
        world1, settings, groups):
    # The engine's own lane gets groups_in_flight times the largest group's buffer (its
    # gradients and usage flags) as its credit window; the groups go whole.
    net = _net()
    config = commsched.Config(partition_bytes=PARTITION, **settings)
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), config, group_bytes=0)
    try:
        engine = model._engine
        largest = max(g.buffer.numel() * 4 for g in engine.groups)
        assert largest == (64 * 64 + 64 + 2) * 4          # the 64x64 layer and its 2 flags
        assert engine.scheduler.config.credit_bytes == groups * largest
        assert engine.whole_groups
        _train(model, opt)
    finally:
        model.close()


@pytest.mark.parametrize("settings", [{}, {"credit_bytes": 3 * PARTITION},
                                      {"decompose": "rs_ag"}, {"autotune": True}])
def test_the_defaults_a_byte_window_autotune_or_rs_ag_leave_the_window_of_groups_out(
        world1, settings):
    net = _net()
    config = commsched.Config(partition_bytes=PARTITION, **settings)
    model, _ = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), config, group_bytes=0)
    try:
        assert model._engine.scheduler.config.credit_bytes == settings.get("credit_bytes", 0)
    finally:
        model.close()
