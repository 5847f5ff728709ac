"""Recorded runs: ranks whose hosts run at different leads are put on one clock."""

import json

import pytest

from commsched.sim.profile import recorded_run_from_data
from commsched.telemetry.store import RunData

MS = 1_000_000
MIB = 1 << 20
CONFIG = {"partition_bytes": 0, "credit_bytes": 0, "policy": "fifo", "decompose": "none"}


def two_rank_run(hosts=("node0", "node0"), count=4):
    """One 4 MiB request a 10 ms iteration, on 2 ranks. Rank 1's host runs 3 ms ahead of
    rank 0's: it submits at 0 and waits in the collective; rank 0 submits at 3 ms. The
    collective runs [3, 4] ms and both ranks record its end at 4 ms (ms after rank 1's
    first submission of the iteration)::

        rank 1  submit 0 ─────────── wait ───────────[====]  end 4
        rank 0                        submit 3 ──────[====]  end 4

    Times are host times (readiness "host"): ready = submission, flush = submission."""
    comm_ops, iterations = [], []
    for i in range(count):
        base = 10 * MS * i
        for rank, lead in ((0, 3 * MS), (1, 0)):
            t = base + lead
            comm_ops.append({
                "rank": rank, "lane": "g0", "iteration": i, "request_key": "0",
                "op": "all_reduce", "step": "all_reduce", "decompose": "none",
                "chunk_index": 0, "num_chunks": 1, "nbytes": 4 * MIB, "dtype": "float32",
                "group_ranks": "[0, 1]", "group_size": 2, "priority": 0, "ok": 1,
                "t_submit_ns": t, "t_dispatch_ns": t, "t_start_ns": t,
                "t_end_ns": base + 4 * MS})
            iterations.append({"rank": rank, "lane": "g0", "iteration": i,
                               "t_first_submit_ns": t, "t_flush_ns": t, "planned": 0,
                               "complete": 1})
    runs = [{"rank": r, "host": h, "world_size": 2, "config_json": json.dumps(CONFIG)}
            for r, h in enumerate(hosts)]
    return RunData("mem", [], {"runs": runs, "comm_ops": comm_ops, "iterations": iterations})


def test_ranks_of_one_host_share_the_iterations_clock():
    run = recorded_run_from_data(two_rank_run(), readiness="host")
    it = run.steady[0]
    # ready at 3 ms (rank 0), backward ends at 3 ms, last chunk ends at 4 ms: 1 ms exposed;
    # tail = 10 - 4 ms.
    assert it.profile.requests[0].ready_s == pytest.approx(3e-3)
    assert it.profile.compute_end_s == pytest.approx(3e-3)
    assert it.exposed_s == pytest.approx(1e-3)
    assert it.profile.tail_s == pytest.approx(6e-3)
    # The plan is built from submissions as each rank measured them (from its own first).
    assert dict(it.plan_submit_s) == {"0": pytest.approx(0.0)}


def test_ranks_of_different_hosts_are_each_on_their_own_clock():
    run = recorded_run_from_data(two_rank_run(hosts=("node0", "node1")), readiness="host")
    it = run.steady[0]
    # Each rank from its own first submission: both ready at 0; rank 1's end at 4 ms.
    assert it.profile.requests[0].ready_s == pytest.approx(0.0)
    assert it.profile.compute_end_s == pytest.approx(0.0)
    assert it.exposed_s == pytest.approx(4e-3)


def test_a_recorded_plan_is_rebuilt_for_the_mode_it_is_replayed_in():
    from commsched.plan import RequestProfile
    from commsched.sim.profile import RecordedRun

    # tests/test_plan.py's four groups: the greedy replay sends them as they come, the
    # data-parallel mode's plan holds c back; a run without plan_forward (or recorded
    # before it existed) replays greedy in both modes.
    profile = [RequestProfile(k, 3 - i, float(i), (2,)) for i, k in enumerate("dcba")]

    def run(config):
        return RecordedRun("run", "g0", 2, [0, 1], config, [], [], [],
                           plan_inputs=(profile, 4, 1.0))

    def keys(plans):
        return [k for k, _ in plans["g0"].order]

    assert keys(run({"plan_forward": True}).plan_for("dp")) == list("dbac")
    assert keys(run({"plan_forward": True}).plan_for("ddp")) == list("dcba")
    assert keys(run({}).plan_for("dp")) == list("dcba")
    assert RecordedRun("run", "g0", 2, [0, 1], {}, [], [], []).plan_for("dp") is None
