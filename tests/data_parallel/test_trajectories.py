"""The data-parallel mode trains exactly like DistributedDataParallel with the same optimizer.

Each scenario trains the same tiny model from the same seed on the same per-rank data,
once with stock DDP (the reference) and once with commsched.data_parallel.wrap, for 20 steps.
Compared: the loss of every step, the parameters every module saw at its forward
pre-hook (against DDP's parameters after the previous step: the forward that starts
while communication is in flight must see every layer updated), and the final parameters
and optimizer state after drain().

2 ranks: bitwise. Averaging divides by 2 before the sum (exact, as DDP's multiply by 1/2)
and a two-term sum does not depend on the order, so the math is identical.
4 ranks: gloo's ring all-reduce adds the four terms in an order that depends on where an
element sits in the buffer; the data-parallel mode's layer-group buffers are not DDP's buckets, so
sums differ in the last bit: compared within 1e-6, relative to max(1, |DDP's value|)
(float32, 20 steps).
"""

import pytest

from .scenarios import CASES_2, CASES_4

BITWISE = ("loss", "seen", "final", "opt_state")

TRAJECTORY_CASES_2 = ["sgd_momentum", "sgd_nesterov_lambda_lr", "adamw_foreach",
                      "adamw_foreach_step_lr", "adamw_single_onecycle", "rmsprop",
                      "adagrad_step_lr"]


@pytest.mark.parametrize("name", TRAJECTORY_CASES_2)
def test_two_ranks_bitwise_equal_to_ddp(two_ranks, name):
    r = two_ranks[name]
    for key in BITWISE:
        assert r[key] == 0.0, (name, key, r[key])
    # every module's parameters were checked at every forward after the first step
    assert r["seen_count"] == (CASES_2[name].steps - 1) * 6


@pytest.mark.parametrize("name", TRAJECTORY_CASES_2)
def test_next_forward_starts_while_communication_is_in_flight(two_ranks, name):
    # The comparison above is only meaningful if updates really were pending when the
    # forward began: count the layer groups still communicating at forward start.
    assert two_ranks[name]["in_flight"] > 0


@pytest.mark.parametrize("name", sorted(n for n in CASES_4 if not CASES_4[n].subgroups))
def test_four_ranks_equal_to_ddp_within_rounding(four_ranks, name):
    r = four_ranks[name]
    for key in ("loss", "seen", "final"):
        assert r[key] <= 1e-6, (name, key, r[key])
    # RMSprop's momentum buffer divides by sqrt of a small running average, which
    # magnifies last-bit differences of the gradients
    assert r.get("opt_state", 0.0) <= 1e-5, (name, r.get("opt_state"))
    assert r["seen_count"] > 0
    assert r["in_flight"] > 0


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_single"])
def test_four_ranks_sgd_momentum_and_single_tensor_adamw_track_ddp(four_ranks, name):
    # plain all-reduce (default decompose), 20 steps; every module checked at every
    # forward after the first step; optimizer state within 1e-6 too
    spec = CASES_4[name]
    assert spec.decompose == "none" and spec.steps >= 20 and spec.accum == 1
    r = four_ranks[name]
    for key in ("loss", "seen", "final", "opt_state"):
        assert r[key] <= 1e-6, (name, key, r[key])
    assert r["seen_count"] == (spec.steps - 1) * 6
    assert r["in_flight"] > 0


def test_a_coupled_optimizer_is_stepped_once_over_the_whole_model(two_ranks):
    # FusedLAMB (scenarios.py): a class name the data-parallel mode steps synchronously over the
    # whole model; its learning rate depends on the norm of all gradients, so per-group
    # steps would diverge from DDP's
    r = two_ranks["whole_model_fused_lamb"]
    for key in BITWISE:
        assert r[key] == 0.0, (key, r[key])
    assert r["seen_count"] == (CASES_2["whole_model_fused_lamb"].steps - 1) * 6
    for row in r["ranks"]:
        assert row["opt_steps"] == CASES_2["whole_model_fused_lamb"].steps   # one per step()
    assert r["in_flight"] == 0          # synchronous: nothing left for the next forward


def test_fused_adamw_on_cpu_is_bitwise_equal_to_ddp(two_ranks):
    r = two_ranks["adamw_fused"]
    for key in BITWISE:
        assert r[key] == 0.0, (key, r[key])
    assert r["seen_count"] == (CASES_2["adamw_fused"].steps - 1) * 6
    assert r["in_flight"] > 0


def test_a_process_group_argument_trains_like_ddp_on_that_group(four_ranks):
    # ranks {0, 1} and {2, 3} each train their own replica (BatchNorm buffers broadcast
    # from the group's first rank, rs_ag) through wrap(..., group): two-rank groups,
    # hence bitwise
    name = "subgroups_rs_ag_adamw"
    r = four_ranks[name]
    for key in ("loss", "seen", "final"):
        assert r[key] == 0.0, (name, key, r[key])
