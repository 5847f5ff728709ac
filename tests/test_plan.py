"""The dispatch plan: a priority replay of a profiled iteration, checked on timelines
worked out by hand."""

import pytest

from commsched.plan import LinkCost, RequestProfile, build_plan


def test_fifo_when_everything_is_ready_in_priority_order():
    reqs = [RequestProfile("a", 0, 0.0, (10, 10)), RequestProfile("b", 1, 0.0, (10,))]
    assert build_plan(reqs, 0, 1.0).order == (("a", 0), ("a", 1), ("b", 0))


def test_late_urgent_request_overtakes_queued_chunks():
    # Cost 1 s per byte-unit chunk of 1 byte; credit = 1 chunk in flight.
    # t=0: "late"-priority request L (priority 5) is ready with 4 chunks.
    # t=1.5: urgent U (priority 0) ready with 2 chunks.
    # Link: L0 [0,1) L1 [1,2); at t=2 U is ready and more urgent: U0 [2,3) U1 [3,4);
    # then L2, L3.
    reqs = [RequestProfile("L", 5, 0.0, (1, 1, 1, 1)), RequestProfile("U", 0, 1.5, (1, 1))]
    plan = build_plan(reqs, credit_bytes=1, seconds_per_byte=1.0)
    assert plan.order == (("L", 0), ("L", 1), ("U", 0), ("U", 1), ("L", 2), ("L", 3))
    assert plan.layout == {"L": 4, "U": 2}


def test_unbounded_credit_cannot_reorder_what_was_already_dispatched():
    # With no credit limit every ready chunk goes at once, so U arrives too late.
    reqs = [RequestProfile("L", 5, 0.0, (1, 1, 1, 1)), RequestProfile("U", 0, 1.5, (1, 1))]
    plan = build_plan(reqs, credit_bytes=0, seconds_per_byte=1.0)
    assert plan.order == (("L", 0), ("L", 1), ("L", 2), ("L", 3), ("U", 0), ("U", 1))


def test_credit_window_of_two_chunks():
    # credit 2 bytes: L0, L1 go at t=0 (finish 1, 2). At t=1 L0 done -> L2 (finishes 3).
    # U ready at 1.5; at t=2 L1 done -> U0 (finishes 4); t=3 -> U1; t=4 -> L3.
    reqs = [RequestProfile("L", 5, 0.0, (1, 1, 1, 1)), RequestProfile("U", 0, 1.5, (1, 1))]
    plan = build_plan(reqs, credit_bytes=2, seconds_per_byte=1.0)
    assert plan.order == (("L", 0), ("L", 1), ("L", 2), ("U", 0), ("U", 1), ("L", 3))


def test_ties_broken_by_submission_then_chunk_index():
    reqs = [RequestProfile("x", 1, 0.0, (1, 1)), RequestProfile("y", 1, 0.0, (1,))]
    assert build_plan(reqs, 1, 1.0).order == (("x", 0), ("x", 1), ("y", 0))


def test_zero_cost_profile_still_terminates():
    reqs = [RequestProfile(i, 3 - i, 0.0, (4, 4)) for i in range(4)]
    order = build_plan(reqs, 4, 0.0).order
    assert sorted(order) == sorted((i, c) for i in range(4) for c in range(2))


def test_link_cost_counts_busy_time_not_queueing():
    # Four 1 MB collectives dispatched together at t=0 finish 1 ms apart: the link moved
    # 4 MB in 4 ms. Timed from their dispatch they would add up to 1+2+3+4 = 10 ms.
    cost = LinkCost()
    for k in range(4):
        cost.add(0, (k + 1) * 1_000_000, 1_000_000)
    assert cost.seconds_per_byte == pytest.approx(1e-9)


def test_link_cost_skips_idle_link_and_counts_steps_once_per_chunk():
    cost = LinkCost()
    cost.add(0, 2_000_000, 2_000_000)              # busy 0-2 ms
    cost.add(5_000_000, 6_000_000)                 # idle 2-5 ms, then a first step 5-6 ms
    cost.add(5_500_000, 7_000_000, 1_000_000)      # its second step, queued behind: 6-7 ms
    assert cost.busy_ns == 4_000_000 and cost.nbytes == 3_000_000
    # An end before the previous one (a batch seen at once) adds nothing.
    cost.add(0, 6_500_000, 0)
    assert cost.busy_ns == 4_000_000
