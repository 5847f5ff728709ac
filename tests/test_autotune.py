"""The online tuner (COMMSCHED_AUTOTUNE): every rank switches at the same iteration, results
stay equal to the reference, every decision is recorded, a slower trial is reverted.

Each rank's input is a known function of (rank, iteration, request), so every reduced value
is checked against a sum computed locally; with 2 ranks a sum of two values does not depend
on the reduction order, so results must be bitwise equal whatever the partition, credit or
decomposition. The search and the measurement are stubbed where the test needs a known
decision (``commsched.autotune.search`` / ``mean_iteration_ns`` are the seams).
"""

import contextlib
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from commsched import Config, Scheduler, autotune
from commsched.autotune import Settings, Tuner
from commsched.config import ConfigError
from commsched.telemetry import load_run, open_recorder
from distributed import run_workers

SIZES = (300, 5, 1200, 64)            # float32: 1200, 20, 4800, 256 bytes
BASE = dict(policy="priority", partition_bytes=1024, credit_bytes=0, decompose="none",
            profile_iters=1, autotune=True, autotune_iters=2)
CANDIDATE = Settings(512, 2048, "rs_ag")
FIELDS = {"lane", "round", "event", "decided_at", "iteration", "baseline_from", "trial_from",
          "old_partition_bytes", "old_credit_bytes", "old_decompose",
          "candidate_partition_bytes", "candidate_credit_bytes", "candidate_decompose",
          "predicted_ms", "predicted_old_ms", "baseline_ms", "trial_ms", "kept"}
TERMINAL = ("unchanged", "failed", "keep", "revert")


def rank_input(rank, iteration, request):
    gen = torch.Generator().manual_seed(1000 * iteration + 10 * request + rank)
    return torch.randn(SIZES[request], generator=gen)


def reference(iteration, request):
    return rank_input(0, iteration, request) + rank_input(1, iteration, request)


@contextlib.contextmanager
def stub_tuner(baseline_ms, trial_ms, seen):
    """Force the search's answer and the measured iteration times; keep what the search
    was given, to check the profile it would have searched on."""
    def search(profile, cost_model, current, **kw):
        seen.append((profile, cost_model, current, kw))
        return CANDIDATE, 1.5, 2.25
    real = autotune.search, autotune.mean_iteration_ns
    autotune.search = search
    autotune.mean_iteration_ns = lambda kind, starts: int(
        1e6 * (baseline_ms if kind == "baseline" else trial_ms))
    try:
        yield
    finally:
        autotune.search, autotune.mean_iteration_ns = real


def train(rank, sched, *, sleeps, max_iterations=200, check_every=6):
    """Run iterations (random per-rank sleeps between submissions when ``sleeps``) until
    the tuner's round ended on every rank, and ``check_every`` more after (so that a revert
    took effect); returns the number of iterations."""
    rng = random.Random(rank * 7919 + 3)
    it = ended = 0
    while it < max_iterations:
        reqs = []
        for i in range(len(SIZES)):
            if sleeps and rng.random() < 0.5:
                time.sleep(rng.random() * 0.003)
            reqs.append(sched.submit(rank_input(rank, it, i), key=i, priority=len(SIZES) - i))
        sched.end_iteration()
        if sleeps and rng.random() < 0.3:
            time.sleep(rng.random() * 0.003)
        for i, req in enumerate(reqs):
            assert torch.equal(req.wait(), reference(it, i)), (it, i)
        it += 1
        if it % check_every == 0:
            # Nothing of the scheduler is pending after drain(): a collective of ours on the
            # same group comes after all of its collectives on every rank.
            sched.drain(timeout=30)
            log = sched.tuning_log()
            done = torch.tensor([int(bool(log) and log[-1]["event"] in TERMINAL)])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            ended = ended + 1 if done.item() else 0
            if ended == 2:
                break
    sched.drain(timeout=30)
    return it


def gather(obj, world):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def chunk_shape(dispatch_log):
    """(iteration, key) -> (number of chunks, steps per chunk) as dispatched."""
    shape = {}
    for entry in dispatch_log:
        if entry[0] in ("plan", "autotune"):
            continue
        iteration, key, chunk, step = entry
        n, steps = shape.get((iteration, key), (0, 0))
        shape[(iteration, key)] = (max(n, chunk + 1), max(steps, step + 1))
    return shape


def forced_candidate_switches_every_rank_at_the_same_iteration(rank, world, run_dir):
    """A forced candidate, measured faster: every rank switches at the agreed iteration,
    keeps it, and records both decisions (tuning_log and the telemetry table)."""
    seen = []
    rec = open_recorder(Config(telemetry_dir=run_dir), rank=rank, world_size=world,
                        nvml_period_ms=0)
    sched = Scheduler(Config(**BASE), observer=rec, trace_dispatch=True, extensions=[Tuner])
    with stub_tuner(baseline_ms=10.0, trial_ms=5.0, seen=seen):
        iterations = train(rank, sched, sleeps=False)
    logs, tunings = gather(sched.dispatch_log(), world), gather(sched.tuning_log(), world)
    rec.close()
    sched.close()
    assert all(log == logs[0] for log in logs), "dispatch order differs across ranks"
    assert all(t == tunings[0] for t in tunings), "tuning logs differ across ranks"
    trial, keep = tunings[0]
    assert [trial["event"], keep["event"]] == ["trial", "keep"]
    for entry in (trial, keep):
        assert set(entry) == FIELDS
        assert (entry["old_partition_bytes"], entry["old_credit_bytes"],
                entry["old_decompose"]) == (1024, 0, "none")
        assert (entry["candidate_partition_bytes"], entry["candidate_credit_bytes"],
                entry["candidate_decompose"]) == tuple(CANDIDATE)
        assert (entry["predicted_ms"], entry["predicted_old_ms"]) == (1.5, 2.25)
        assert entry["baseline_ms"] == 10.0 and entry["lane"] == "g0" and entry["round"] == 0
    switch = trial["iteration"]
    assert trial["decided_at"] < switch and trial["kept"] is None and trial["trial_ms"] is None
    assert keep["iteration"] == switch and keep["kept"] is True and keep["trial_ms"] == 5.0
    assert switch < keep["trial_from"] < keep["decided_at"]
    # Every rank switched at `switch`: request 2 (4800 bytes) went in 5 chunks of one
    # all-reduce before, in 10 chunks of reduce-scatter + all-gather from then on.
    shape = chunk_shape(logs[0])
    assert [shape[(i, 2)] for i in range(switch)] == [(5, 1)] * switch
    assert [shape[(i, 2)] for i in range(switch, iterations)] == [(10, 2)] * (iterations - switch)
    assert ("autotune", "decide") in logs[0] and ("autotune", "evaluate") in logs[0]
    if rank == 0:
        # The search ran on the baseline: the 4 requests, a cost model fitted on them.
        profile, model, current, kw = seen[0]
        assert [r.nbytes for r in profile.requests] == [4 * n for n in SIZES]
        assert current == Settings(1024, 0, "none") and kw["world_size"] == world
        assert model.params
    dist.barrier()
    if rank == 0:
        rows = load_run(run_dir).rows("tuning")
        assert sorted((r["rank"], r["event"]) for r in rows) == [
            (0, "keep"), (0, "trial"), (1, "keep"), (1, "trial")]
        for r in rows:
            entry = trial if r["event"] == "trial" else keep
            assert {k: r[k] for k in FIELDS if k != "kept"} == {
                k: entry[k] for k in FIELDS if k != "kept"}
            assert r["kept"] == (None if entry["kept"] is None else int(entry["kept"]))


def slower_trial_is_reverted_under_random_per_rank_delays(rank, world, run_dir):
    """A forced candidate, measured slower, with random per-rank sleeps between
    submissions: no hang, the revert applies on every rank from the agreed iteration."""
    sched = Scheduler(Config(**dict(BASE, credit_bytes=2048)), trace_dispatch=True,
                      extensions=[Tuner])
    with stub_tuner(baseline_ms=5.0, trial_ms=6.0, seen=[]):
        iterations = train(rank, sched, sleeps=True)
    logs, tunings = gather(sched.dispatch_log(), world), gather(sched.tuning_log(), world)
    sched.close()
    assert all(log == logs[0] for log in logs), "dispatch order differs across ranks"
    assert all(t == tunings[0] for t in tunings), "tuning logs differ across ranks"
    trial, revert = tunings[0]
    assert [trial["event"], revert["event"]] == ["trial", "revert"]
    assert revert["kept"] is False and (revert["baseline_ms"], revert["trial_ms"]) == (5.0, 6.0)
    switch, back = trial["iteration"], revert["iteration"]
    assert switch < revert["trial_from"] < revert["decided_at"] < back < iterations
    shape = chunk_shape(logs[0])
    for i in range(iterations):
        assert shape[(i, 2)] == ((10, 2) if switch <= i < back else (5, 1)), i


def real_search_ranks_agree_and_results_unchanged(rank, world, run_dir):
    """commsched.sim.tune itself (no stub), random per-rank sleeps: the ranks agree on
    every decision and dispatch, and results stay equal to the reference."""
    sched = Scheduler(Config(**dict(BASE, decompose="rs_ag", credit_bytes=4096)),
                      trace_dispatch=True, extensions=[Tuner])
    train(rank, sched, sleeps=True)
    logs, tunings = gather(sched.dispatch_log(), world), gather(sched.tuning_log(), world)
    sched.close()
    assert all(log == logs[0] for log in logs), "dispatch order differs across ranks"
    assert all(t == tunings[0] for t in tunings), "tuning logs differ across ranks"
    assert tunings[0] and tunings[0][-1]["event"] in ("unchanged", "keep", "revert")
    assert tunings[0][0]["predicted_ms"] is not None


SCENARIOS = (forced_candidate_switches_every_rank_at_the_same_iteration,
             slower_trial_is_reverted_under_random_per_rank_delays,
             real_search_ranks_agree_and_results_unchanged)


def _scenarios(rank, world, run_dir):
    for scenario in SCENARIOS:
        try:
            scenario(rank, world, os.path.join(run_dir, scenario.__name__))
        except BaseException as exc:
            raise AssertionError(f"rank {rank}, {scenario.__name__}: {exc!r}") from exc
        dist.barrier()


def test_autotune_on_2_gloo_ranks(tmp_path):
    """The scenarios above, one after another in one pair of processes (starting
    processes dominates the time of each)."""
    run_workers(_scenarios, 2, str(tmp_path), timeout=60)


def test_autotune_settings():
    config = Config.from_env({"COMMSCHED_AUTOTUNE": "1"}).replace(autotune_iters=3)
    assert (config.autotune, config.autotune_iters) == (True, 3)
    assert Config.from_env({}).autotune is False and Config().autotune_iters == 5
    with pytest.raises(ConfigError, match="autotune_iters=1"):
        Config(autotune_iters=1)
    with pytest.raises(ConfigError, match="COMMSCHED_AUTOTUNE"):
        Config.from_env({"COMMSCHED_AUTOTUNE": "yes"})
