"""The rs_ag variant (ZeRO-1: reduce-scatter, sharded update, all-gather in the next
forward) trains exactly like DDP, with optimizer state divided among the ranks."""

import pytest

from .scenarios import CASES_2

RS_AG_2 = sorted(n for n in CASES_2 if n.startswith("rs_ag"))


@pytest.mark.parametrize("name", RS_AG_2)
def test_rs_ag_two_ranks_bitwise_equal_to_ddp(two_ranks, name):
    r = two_ranks[name]
    for key in ("loss", "seen", "final", "eval", "state_dict"):
        if key in r:
            assert r[key] == 0.0, (name, key, r[key])


def test_rs_ag_overlaps_all_gathers_with_the_next_forward(two_ranks):
    assert two_ranks["rs_ag_adamw_onecycle"]["in_flight"] > 0


def test_rs_ag_divides_optimizer_state_among_ranks(two_ranks):
    # AdamW state: exp_avg + exp_avg_sq per element (+ a step scalar per shard piece)
    for row in two_ranks["rs_ag_adamw_onecycle"]["ranks"]:
        full, shard = row["ref_state_bytes"], row["state_bytes"]
        assert shard < 0.55 * full, (shard, full)


def test_rs_ag_four_ranks_equal_to_ddp_within_rounding(four_ranks):
    r = four_ranks["rs_ag_adamw_timing"]
    for key in ("loss", "seen", "final"):
        assert r[key] <= 1e-6, (key, r[key])
    for row in r["ranks"]:
        assert row["state_bytes"] < 0.3 * row["ref_state_bytes"]


def test_rs_ag_clip_and_scaler_warn_once(two_ranks):
    for name in ("rs_ag_clip", "rs_ag_grad_scaler"):
        assert [row["warnings"] for row in two_ranks[name]["ranks"]] == [1, 1]


def test_rs_ag_collectives_go_whole_in_the_single_tensor_form(world1, monkeypatch):
    """Whatever the partition size, each layer group's reduce-scatter and all-gather is one
    chunk, issued in the single-tensor form: a partitioned one would take the list form
    (a flat copy of the chunk inside NCCL). Counted at the collectives module."""
    import torch
    import torch.nn as nn

    import commsched
    import commsched.collectives as collectives
    from commsched.data_parallel import drain, wrap
    from commsched.scheduler import Scheduler

    calls = {"list": 0, "single": 0}

    def counting(fn, form):
        def wrapper(*args, **kwargs):
            calls[form] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_gather", "reduce_scatter"):
        monkeypatch.setattr(collectives.dist, name, counting(getattr(collectives.dist, name),
                                                             "list"))
    for name in ("_pg_all_gather", "_pg_reduce_scatter"):
        monkeypatch.setattr(collectives, name, counting(getattr(collectives, name), "single"))

    chunks = []

    class Recording(Scheduler):
        def submit(self, tensor, **kwargs):
            req = super().submit(tensor, **kwargs)
            if kwargs.get("op") in ("reduce_scatter", "all_gather"):
                chunks.append(len(req.chunks))
            return req

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = commsched.Config(decompose="rs_ag", partition_bytes=256, credit_bytes=1024)
    model, opt = wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), config,
                      group_bytes=0, scheduler=Recording(config))
    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        drain(model)
    finally:
        model.close()
    # 2 layer groups (2 KiB and 0.5 KiB of fp32): 3 reduce-scatters and 3 all-gathers each
    assert chunks == [1] * 12, chunks
    assert calls == {"list": 0, "single": 12}, calls
