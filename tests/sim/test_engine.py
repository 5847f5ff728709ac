"""The engine replays the scheduler's policy: timelines worked out by hand."""

import pytest
import torch

from commsched.partition import partition
from commsched.sim import IterationProfile, SimConfig, SimError, SimRequest, chunk_bytes, simulate


class AlphaBeta:
    """cost = alpha + nbytes * beta, the same for every step."""

    def __init__(self, alpha, beta):
        self.alpha, self.beta = alpha, beta

    def cost_s(self, step, decompose, nbytes, world_size):
        return self.alpha + nbytes * self.beta


class PerStep:
    def __init__(self, costs):
        self.costs = costs

    def cost_s(self, step, decompose, nbytes, world_size):
        return self.costs[step]


def ends(result):
    return [(s.key, s.chunk, s.step, s.dispatch_s, s.start_s, s.end_s) for s in result.steps]


def two_requests():
    # A: 16 bytes (2 chunks of 8) ready at 0; B: 8 bytes ready at 1. Backward ends at 5,
    # 3 s of other compute.
    return IterationProfile((SimRequest("A", 16, 0.0), SimRequest("B", 8, 1.0)),
                            compute_end_s=5.0, tail_s=3.0)


def test_credit_of_one_chunk_serialises_the_chunks():
    # Cost 1 + 8 * 0.125 = 2 s a chunk. Credit = 8 bytes: A0 [0,2]; A1 waits for A0's
    # credit, [2,4]; B0 ready at 1 but waits for A1's credit, [4,6].
    r = simulate(two_requests(), AlphaBeta(1.0, 0.125), SimConfig(8, 8, "fifo", "none", 2))
    assert ends(r) == [("A", 0, "all_reduce", 0.0, 0.0, 2.0),
                       ("A", 1, "all_reduce", 2.0, 2.0, 4.0),
                       ("B", 0, "all_reduce", 4.0, 4.0, 6.0)]
    # iteration = max(backward end 5, comm end 6) + 3 = 9; compute only 5 + 3 = 8.
    assert r.comm_end_s == 6.0
    assert r.iteration_s == 9.0
    assert r.compute_only_s == 8.0
    assert r.exposed_s == 1.0
    assert r.comm_busy_s == 6.0
    assert r.request_end_s == {"A": 4.0, "B": 6.0}


def test_unbounded_credit_dispatches_at_once_but_the_link_is_serial():
    # A0 and A1 dispatched at 0, B0 at its readiness 1; they still run one after another.
    r = simulate(two_requests(), AlphaBeta(1.0, 0.125), SimConfig(8, 0, "fifo", "none", 2))
    assert ends(r) == [("A", 0, "all_reduce", 0.0, 0.0, 2.0),
                       ("A", 1, "all_reduce", 0.0, 2.0, 4.0),
                       ("B", 0, "all_reduce", 1.0, 4.0, 6.0)]


def test_comm_hidden_behind_backward_is_not_exposed():
    # Backward ends at 7 > comm end 6: iteration = 7 + 3 = 10 = compute only.
    p = IterationProfile(two_requests().requests, compute_end_s=7.0, tail_s=3.0)
    r = simulate(p, AlphaBeta(1.0, 0.125), SimConfig(8, 8, "fifo", "none", 2))
    assert (r.iteration_s, r.exposed_s) == (10.0, 0.0)


def test_credit_window_admits_a_chunk_larger_than_itself_when_nothing_is_in_flight():
    # Credit 4 bytes < chunk 8 bytes: each chunk goes alone.
    r = simulate(two_requests(), AlphaBeta(1.0, 0.125), SimConfig(8, 4, "fifo", "none", 2))
    assert [s.dispatch_s for s in r.steps] == [0.0, 2.0, 4.0]


def test_credit_of_two_chunks_keeps_two_in_flight():
    # Credit 16: A0, A1 at 0; B0 (ready 1) must wait until A0 ends at 2.
    r = simulate(two_requests(), AlphaBeta(1.0, 0.125), SimConfig(8, 16, "fifo", "none", 2))
    assert [s.dispatch_s for s in r.steps] == [0.0, 0.0, 2.0]
    assert [s.end_s for s in r.steps] == [2.0, 4.0, 6.0]


def late_urgent_profile():
    # L (priority 5): 4 one-byte chunks ready at 0; U (priority 0): 2 chunks ready at 1.5.
    L = SimRequest("L", 4, 0.0, priority=5, itemsize=1)
    U = SimRequest("U", 2, 1.5, priority=0, itemsize=1)
    return IterationProfile((L, U), compute_end_s=2.0, tail_s=2.0, forward_s={0: 1.0, 5: 1.0})


def test_fifo_and_priority_differ_on_a_late_urgent_request():
    # 1 s a chunk, credit 1 chunk.
    # fifo:     L0 [0,1] L1 [1,2] L2 [2,3] L3 [3,4] U0 [4,5] U1 [5,6] -> U done at 6.
    # priority: the plan (build_plan, cost 1 s/chunk) lets U overtake once ready:
    #           L0 [0,1] L1 [1,2] U0 [2,3] U1 [3,4] L2 [4,5] L3 [5,6] -> U done at 4.
    model, cfg = AlphaBeta(1.0, 0.0), SimConfig(1, 1, "fifo", "none", 2)
    fifo = simulate(late_urgent_profile(), model, cfg)
    prio = simulate(late_urgent_profile(), model, cfg.replace(policy="priority"))
    assert fifo.order["g0"] == (("L", 0), ("L", 1), ("L", 2), ("L", 3), ("U", 0), ("U", 1))
    assert prio.order["g0"] == (("L", 0), ("L", 1), ("U", 0), ("U", 1), ("L", 2), ("L", 3))
    assert fifo.request_end_s == {"L": 4.0, "U": 6.0}
    assert prio.request_end_s == {"L": 6.0, "U": 4.0}
    # DDP hook mode only waits for the last chunk: the same iteration time, 6 + 2.
    assert fifo.iteration_s == prio.iteration_s == 8.0


def test_data_parallel_mode_forward_waits_for_its_layer_only():
    # Forward: group 0 (U) 1 s, then group 5 (L) 1 s, each after its chunks are done.
    # priority: U done 4 -> fwd U [4,5]; L done 6 -> fwd L [6,7]: iteration 7.
    # fifo:     U done 6 -> fwd U [6,7]; fwd L [7,8]: iteration 8.
    model, cfg = AlphaBeta(1.0, 0.0), SimConfig(1, 1, "priority", "none", 2)
    prio = simulate(late_urgent_profile(), model, cfg, mode="dp")
    fifo = simulate(late_urgent_profile(), model, cfg.replace(policy="fifo"), mode="dp")
    assert (prio.forward_end_s, prio.iteration_s) == (7.0, 7.0)
    assert (fifo.forward_end_s, fifo.iteration_s) == (8.0, 8.0)
    assert prio.compute_only_s == 4.0
    assert prio.exposed_s == 3.0


def test_data_parallel_mode_replays_the_plan_for_the_next_forward():
    # Four whole groups, d (last layer) .. a (first), 2 s each on the link, ready 1 s
    # apart from d at 0 (tests/test_plan.py's worked example): the greedy replay sends them
    # as they come, the plan for the next forward holds c back until b and a went.
    reqs = tuple(SimRequest(k, 8, float(i), priority=3 - i) for i, k in enumerate("dcba"))
    profile = IterationProfile(reqs, compute_end_s=4.0, tail_s=4.0)
    model, cfg = AlphaBeta(0.0, 0.25), SimConfig(0, 16, "priority", "none", 2)
    dp = simulate(profile, model, cfg, mode="dp")
    assert [k for k, _ in dp.order["g0"]] == ["d", "b", "a", "c"]
    greedy = simulate(profile, model, cfg.replace(plan_forward=False), mode="dp")
    ddp = simulate(profile, model, cfg, mode="ddp")
    assert [k for k, _ in greedy.order["g0"]] == ["d", "c", "b", "a"]
    assert greedy.order == ddp.order


def test_rs_ag_runs_two_dependent_steps_per_chunk():
    # 16 bytes of float32 on 2 ranks, partition 8: chunks of 2 elements (a multiple of 2).
    # RS 1 s, AG 2 s, credit one chunk: c0 RS [0,1] AG [1,3]; c1 RS [3,4] AG [4,6].
    p = IterationProfile((SimRequest("A", 16, 0.0),), compute_end_s=0.0)
    r = simulate(p, PerStep({"reduce_scatter": 1.0, "all_gather": 2.0}),
                 SimConfig(8, 8, "fifo", "rs_ag", 2))
    assert ends(r) == [("A", 0, "reduce_scatter", 0.0, 0.0, 1.0),
                       ("A", 0, "all_gather", 0.0, 1.0, 3.0),
                       ("A", 1, "reduce_scatter", 3.0, 3.0, 4.0),
                       ("A", 1, "all_gather", 3.0, 4.0, 6.0)]
    assert r.iteration_s == 6.0


def test_device_readiness_delays_the_start_not_the_dispatch():
    p = IterationProfile((SimRequest("A", 8, ready_s=1.0, submit_s=0.25),), compute_end_s=0.0)
    r = simulate(p, AlphaBeta(1.0, 0.0), SimConfig(8, 8, "fifo", "none", 2))
    assert ends(r) == [("A", 0, "all_reduce", 0.25, 1.0, 2.0)]


@pytest.mark.parametrize("numel,dtype,part,world,decompose,op,expected", [
    # 40 bytes, 12-byte partition: 3 elements a chunk -> 12, 12, 12, 4
    (10, torch.float32, 12, 2, "none", "all_reduce", [12, 12, 12, 4]),
    # rs_ag on 2 ranks: 3 elements rounded down to a multiple of 2 -> 2 elements a chunk
    (10, torch.float32, 12, 2, "rs_ag", "all_reduce", [8] * 5),
    # rs_ag on 4 ranks: 3 rounded down is 0, at least the group size: 4 elements
    (10, torch.float32, 12, 4, "rs_ag", "all_reduce", [16, 16, 8]),
    (10, torch.float32, 0, 2, "none", "all_reduce", [40]),
    (10, torch.float32, 40, 2, "none", "all_reduce", [40]),
    (10, torch.float32, 64, 2, "rs_ag", "all_reduce", [40]),
    # bf16, 14 bytes, 4-byte partition: 2 elements a chunk -> 4, 4, 4, 2
    (7, torch.bfloat16, 4, 2, "none", "all_reduce", [4, 4, 4, 2]),
    # reduce_scatter of 12 floats on 2 ranks (shards of 6), 16-byte partition:
    # 16 // (4 * 2) = 2 elements per shard piece -> 3 chunks of 2 * 4 * 2 = 16 bytes
    (12, torch.float32, 16, 2, "none", "reduce_scatter", [16, 16, 16]),
    # a remainder under 1/8 of the partition rides with the last chunk: 65 floats, 16 a
    # chunk -> 16, 16, 16, 17 floats; at 1/8 it goes on its own: 34 -> 16, 16, 2
    (65, torch.float32, 64, 2, "none", "all_reduce", [64, 64, 64, 68]),
    (34, torch.float32, 64, 2, "none", "all_reduce", [64, 64, 8]),
    # reduce_scatter, shards of 33 floats, 16-float pieces: 16, 17 per shard, 2 ranks
    (66, torch.float32, 128, 2, "none", "reduce_scatter", [128, 136]),
])
def test_partition_agrees_with_hand_arithmetic_and_the_scheduler(numel, dtype, part, world,
                                                                  decompose, op, expected):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    req = SimRequest("x", numel * itemsize, 0.0, itemsize=itemsize, op=op)
    got = list(chunk_bytes(req, SimConfig(part, 0, "fifo", decompose, world)))
    assert got == expected

    class Real:           # what Scheduler.submit hands to partition(): a real tensor
        tensor = torch.zeros(numel, dtype=dtype)
        world_size = world
    Real.op = op
    multiple = world if decompose == "rs_ag" and op == "all_reduce" else 1
    assert [c.nbytes for c in partition(Real, part, multiple)] == expected


def test_bad_inputs_are_rejected_with_a_reason():
    with pytest.raises(SimError, match="whole number"):
        SimRequest("x", 10, 0.0, itemsize=4)
    with pytest.raises(SimError, match="policy"):
        SimConfig(policy="lifo")
    with pytest.raises(SimError, match="repeat"):
        simulate(IterationProfile((SimRequest("a", 4, 0.0), SimRequest("a", 4, 0.0)), 0.0),
                 AlphaBeta(1, 0), SimConfig())


class WithHost(AlphaBeta):
    def __init__(self, alpha, beta, issue_s, credit_return_s):
        super().__init__(alpha, beta)
        self.issue_s, self.credit_return_s = issue_s, credit_return_s


def test_credit_return_and_issue_costs_of_the_host():
    # 2 s a chunk; credit back 0.5 s after a chunk ends; 0.25 s to issue a step.
    # A0 issued 0, [0,2], credit back 2.5. A1 waits for it: issued 2.5, [2.5,4.5], credit
    # back 5. B0 (ready 1) waits for that: issued 5, [5,7].
    r = simulate(two_requests(), WithHost(1.0, 0.125, 0.25, 0.5),
                 SimConfig(8, 8, "fifo", "none", 2))
    assert [(s.dispatch_s, s.start_s, s.end_s) for s in r.steps] == [
        (0.0, 0.0, 2.0), (2.5, 2.5, 4.5), (5.0, 5.0, 7.0)]


def test_a_link_faster_than_the_host_waits_for_issues():
    # 4 chunks of 0.1 s, all ready, unbounded credit, 0.25 s to issue each: the link idles
    # between them. Issues (= starts) at 0, 0.25, 0.5, 0.75; last end 0.85.
    p = IterationProfile((SimRequest("A", 32, 0.0),), compute_end_s=0.0)
    r = simulate(p, WithHost(0.1, 0.0, 0.25, 0.0), SimConfig(8, 0, "fifo", "none", 2))
    assert [s.start_s for s in r.steps] == [0.0, 0.25, 0.5, 0.75]
    assert r.comm_end_s == pytest.approx(0.85)


def test_a_given_plan_is_followed_as_the_scheduler_follows_it():
    from commsched.plan import Plan
    reqs = (SimRequest("A", 8, 0.0, itemsize=1), SimRequest("B", 4, 0.0, itemsize=1),
            SimRequest("C", 4, 0.0, itemsize=1))
    p = IterationProfile(reqs, compute_end_s=0.0)
    cfg = SimConfig(4, 0, "priority", "none", 2)          # A: 2 chunks, B and C: 1
    # Planned requests in plan order, then the unplanned C in submission order.
    plan = Plan((("B", 0), ("A", 1), ("A", 0)), {"A": 2, "B": 1})
    r = simulate(p, AlphaBeta(1.0, 0.0), cfg, plans={"g0": plan})
    assert r.order["g0"] == (("B", 0), ("A", 1), ("A", 0), ("C", 0))
    # A plan made for another chunk count of A does not apply to A.
    plan = Plan((("B", 0), ("A", 2), ("A", 1), ("A", 0)), {"A": 3, "B": 1})
    r = simulate(p, AlphaBeta(1.0, 0.0), cfg, plans={"g0": plan})
    assert r.order["g0"] == (("B", 0), ("A", 0), ("A", 1), ("C", 0))
    # fifo ignores plans.
    r = simulate(p, AlphaBeta(1.0, 0.0), cfg.replace(policy="fifo"), plans={"g0": plan})
    assert r.order["g0"] == (("A", 0), ("A", 1), ("B", 0), ("C", 0))


def test_config_from_a_commsched_config():
    from commsched.config import Config
    cfg = SimConfig.from_config(Config(partition_bytes=1 << 20, credit_bytes=0,
                                       policy="fifo", decompose="rs_ag"), world_size=8)
    assert cfg == SimConfig(1 << 20, 0, "fifo", "rs_ag", 8)
    assert cfg.label() == "partition 1MiB, credit inf, fifo, rs_ag"
