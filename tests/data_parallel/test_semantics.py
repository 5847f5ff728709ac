"""DDP semantics that the data-parallel mode keeps: accumulation, unused and shared parameters,
buffers, evaluation, state dicts, gradient clipping, GradScaler — each checked against
stock DDP on 2 ranks, bitwise (see test_trajectories.py for why 2 ranks are bitwise)."""

import pytest

from .scenarios import CASES_2


def _equal_to_ddp(r, keys=("loss", "seen", "final")):
    for key in keys:
        assert r[key] == 0.0, (key, r[key])


def test_no_sync_accumulation_equals_ddp_no_sync(two_ranks):
    _equal_to_ddp(two_ranks["accumulation"], ("loss", "seen", "final", "opt_state"))


def test_unused_parameters_match_ddp_find_unused_parameters(two_ranks):
    # layer b: used by rank 0 only in odd steps (zero contribution from rank 1);
    # layer c: used by no rank in 2 steps of 3 (its gradient stays None: AdamW neither
    # decays nor moves it, as with DDP(find_unused_parameters=True)).
    _equal_to_ddp(two_ranks["unused"], ("loss", "seen", "final", "opt_state"))


def test_zero_grad_keeping_zeroed_gradients_matches_ddp(two_ranks):
    # zero_grad(set_to_none=False): gradients stay tensors, zeroed, so AdamW also steps
    # the parameters no rank used; with unused parameters and accumulation under no_sync.
    _equal_to_ddp(two_ranks["unused_accumulation_zeroed_grads"],
                  ("loss", "seen", "final", "opt_state"))


@pytest.mark.parametrize("name", ["adversarial_timing", "branchy_adamw_timing"])
def test_adversarial_timing_neither_hangs_nor_changes_results(two_ranks, name):
    # random per-rank sleeps in forward pre-hooks, gradient hooks and before step(), on
    # two models and optimizers
    r = two_ranks[name]
    _equal_to_ddp(r)
    assert r["in_flight"] > 0


@pytest.mark.parametrize("name", ["user_collective_timing",
                                  "rs_ag_user_collective_timing"])
def test_the_applications_own_collectives_on_the_group_keep_ranks_in_step(two_ranks, name):
    # an all-reduce of the loss on the training group after every step, while the step's
    # last chunks may still wait for credit (scenarios run a bounded window)
    _equal_to_ddp(two_ranks[name])


def test_eval_under_no_grad_sees_updated_parameters(two_ranks):
    # a no_grad eval forward right after step()/zero_grad() applies the pending updates
    _equal_to_ddp(two_ranks["eval_and_state_dict"], ("eval",))


def test_state_dicts_drain_first(two_ranks):
    # model.state_dict() and optimizer.state_dict() right after the last step()
    _equal_to_ddp(two_ranks["eval_and_state_dict"], ("state_dict", "opt_state"))


def test_shared_parameters_are_counted_once(two_ranks):
    _equal_to_ddp(two_ranks["tied"], ("loss", "seen", "final", "opt_state"))


def test_buffers_broadcast_from_rank0_like_ddp(two_ranks):
    _equal_to_ddp(two_ranks["buffers"], ("loss", "seen", "final", "eval", "state_dict"))


@pytest.mark.parametrize("name", ["per_rank_init", "rs_ag_per_rank_init"])
def test_initial_parameters_and_buffers_are_broadcast_from_rank0(two_ranks, name):
    # each rank seeds its model differently and rank 1 perturbs its BatchNorm buffers;
    # right after wrap() (before any forward) every rank holds rank 0's initial
    # parameters and buffers, and trains like DDP (which broadcasts from rank 0 too)
    r = two_ranks[name]
    assert [row["init_before"] > 0 for row in r["ranks"]] == [False, True]   # premise
    assert r["init"] == 0.0, r["init"]
    _equal_to_ddp(r, [k for k in ("loss", "seen", "final", "eval", "state_dict") if k in r])
    assert r["seen_count"] == (CASES_2[name].steps - 1) * 6


def test_clip_grad_norm_falls_back_to_a_synchronous_step_with_one_warning(two_ranks):
    r = two_ranks["clip"]
    _equal_to_ddp(r, ("loss", "seen", "final", "opt_state"))
    assert [row["warnings"] for row in r["ranks"]] == [1, 1]      # once in 20 steps
    assert r["in_flight"] == 0                                    # synchronous: nothing left


def test_reads_grads_declared_gives_the_same_result_without_warning(two_ranks):
    r = two_ranks["clip_declared"]
    _equal_to_ddp(r, ("loss", "seen", "final"))
    assert r["warnings"] == 0


def test_grad_scaler_skips_the_same_steps_as_ddp(two_ranks):
    # rank 1's loss is inf at step 7: both skip step 7 and halve the scale
    r = two_ranks["grad_scaler"]
    _equal_to_ddp(r, ("loss", "seen", "final", "opt_state"))
    for row in r["ranks"]:
        assert row["skipped"] == row["skipped_ref"] == [7]


@pytest.mark.parametrize("name", ["group_window_timing",
                                  "group_window_tied_accumulation"])
def test_windows_of_whole_layer_groups_keep_results_equal_to_ddp(two_ranks, name):
    # credit_bytes unset: one (groups_in_flight=1) or two (the default) whole layer groups
    # in flight, the others queued and dispatched by priority; with random sleeps, or with
    # shared parameters and no_sync accumulation
    r = two_ranks[name]
    _equal_to_ddp(r, ("loss", "seen", "final", "opt_state"))
    assert r["in_flight"] > 0


@pytest.mark.parametrize("name", ["plan_no_window_timing", "plan_no_window_chunks_unused"])
def test_without_a_window_the_plan_s_order_keeps_results_equal_to_ddp(two_ranks, name):
    # no window of groups nor of bytes (the default): the plan alone orders whole layer
    # groups (with random sleeps) or their chunks (with unused parameters) on the link
    r = two_ranks[name]
    _equal_to_ddp(r, ("loss", "seen", "final", "opt_state"))
    assert r["in_flight"] > 0
