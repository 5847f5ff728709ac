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
