"""The data-parallel mode's dispatch plan: built for the next forward where its layer
groups go whole, followed on every rank, and free to hold a ready group back.

Read from the 2-rank scenarios (see scenarios.py): each records the plans its scheduler
lanes built (whether the lane feeds the next forward, the order) and, per iteration, the
order in which the layer groups' collectives were issued (the lane's dispatch log).
Iterations 0 to 2 are the warm-up in submission order (the lane's first iteration, then
the two profiled ones); the plan built from their profile is in force from iteration 3 on.
"""

import pytest

from .scenarios import CASES_2

WHOLE = ["group_window_timing", "group_window_tied_accumulation",
         "plan_holds_first_group_timing", "plan_holds_first_group_unused",
         "plan_no_window_timing"]
WARMUP = 3      # the lane's first iteration and Config.profile_iters


def _forward_plans(row):
    return [order for feeds_forward, order in row["plans"] if feeds_forward]


@pytest.mark.parametrize("name", WHOLE)
def test_whole_groups_are_dispatched_by_one_plan_for_the_next_forward_on_every_rank(
        two_ranks, name):
    r = two_ranks[name]
    rows = r["ranks"]
    plans = [_forward_plans(row) for row in rows]
    assert len(plans[0]) == 1, rows[0]["plans"]           # one layout, one plan
    assert plans[0] == plans[1]                           # the same plan on every rank
    dispatch = [row["dispatch"] for row in rows]
    assert dispatch[0] == dispatch[1]                     # the same sequence on every rank
    steps = CASES_2[name].steps
    assert len(dispatch[0]) == steps
    submitted = dispatch[0][0]
    assert submitted == sorted(submitted, reverse=True)   # warm-up: backward's order
    for order in dispatch[0][WARMUP:]:
        assert order == plans[0][0]


@pytest.mark.parametrize("name", ["plan_holds_first_group_timing",
                                  "plan_holds_first_group_unused"])
def test_a_group_held_back_until_every_other_went_keeps_results_equal_to_ddp(
        two_ranks, name):
    # The plan sends the group submitted first (the last layers') after all the others:
    # it waits in the lane for the whole backward, ready, while later groups overtake it.
    r = two_ranks[name]
    dispatch = r["ranks"][0]["dispatch"]
    first = dispatch[0][0]
    assert all(order[-1] == first for order in dispatch[WARMUP:]), dispatch
    for key in ("loss", "seen", "final", "opt_state"):
        assert r[key] == 0.0, (name, key, r[key])
    assert r["seen_count"] > 0
    assert r["in_flight"] > 0


def test_chunked_groups_keep_the_greedy_replay(two_ranks):
    # Under a byte window the groups go in chunks: the plan stays the greedy replay over
    # chunks (build_forward_plan, one entry per whole group, declines them).
    for row in two_ranks["adamw_foreach"]["ranks"]:
        plans = _forward_plans(row)
        assert len(plans) == 1
        assert len(plans[0]) > len(set(plans[0]))         # a group's several chunks
