"""Hangs become errors, mismatches are caught before they corrupt anything."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commsched import Config, Scheduler, SchedulerError
from commsched.safety import AgreementError
from distributed import free_port, run_workers


def _run_ranks(target, world, *args, timeout=60):
    """``target(rank, world, port, *args)`` in ``world`` spawned processes; their
    processes once all have ended. A rank still alive at ``timeout`` is killed: a hang."""
    ctx = mp.start_processes(target, args=(world, free_port(), *args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    for p in ctx.processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return ctx.processes


def _disagreeing_config(rank, world):
    sched = Scheduler(Config(partition_bytes=1024 if rank == 0 else 2048))
    with pytest.raises(AgreementError) as err:
        sched.submit(torch.ones(10), key="b0")
    message = str(err.value)
    assert "'partition_bytes' differs" in message
    assert "ranks [0]: 1024" in message and "ranks [1]: 2048" in message
    sched.close()


def test_configuration_mismatch_is_an_error_on_every_rank_before_any_collective():
    run_workers(_disagreeing_config, 2, timeout=60)


def _disagreeing_first_request(rank, world):
    sched = Scheduler(Config())
    t = torch.ones(10 + rank)
    with pytest.raises(AgreementError, match="'first request' differs"):
        sched.submit(t, key="b0")
    assert torch.equal(t, torch.ones(10 + rank))        # no gradient touched
    sched.close()


def test_layout_mismatch_is_an_error_naming_the_field():
    run_workers(_disagreeing_first_request, 2, timeout=60)


def _diverging_sequence(rank, world):
    """Same first request, then rank 1 submits two requests in the other order: the sums
    pair tensors of equal size but different meaning. Verification must catch it."""
    sched = Scheduler(Config(policy="fifo", verify=True))
    caught = None
    try:
        for it in range(3):
            keys = ["a", "b", "c"] if (rank == 0 or it == 0) else ["a", "c", "b"]
            reqs = [sched.submit(torch.ones(16), key=k) for k in keys]
            sched.end_iteration()
            for r in reqs:
                r.wait()
    except Exception as exc:  # noqa: BLE001 - the error is the subject of the test
        caught = exc
    assert caught is not None, "divergence not detected"
    assert "first divergence at collective #1" in str(caught), str(caught)
    sched.close()


def test_verify_reports_the_first_divergence():
    run_workers(_diverging_sequence, 2, timeout=90)


def _dies_mid_iteration(rank, world, port, out_dir, crash_at):
    from commsched.telemetry import open_recorder

    os.environ["COMMSCHED_TIMEOUT_S"] = "20"
    os.environ["COMMSCHED_TELEMETRY_DIR"] = os.path.join(out_dir, "telemetry")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    config = Config.from_env()
    recorder = open_recorder(config, rank=rank, world_size=world)
    sched = Scheduler(config, observer=recorder)
    try:
        for it in range(crash_at + 2):
            if rank == 1 and it == crash_at:
                os._exit(17)                       # a rank crashes mid-run
            reqs = [sched.submit(torch.ones(4096), key=i) for i in range(4)]
            sched.end_iteration()
            for r in reqs:
                r.wait()
    except Exception as exc:  # noqa: BLE001
        recorder.close()
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        os._exit(3)
    os._exit(0)


# Iteration 3 begins with the plan exchange (iterations 1 and 2 profiled); later ones
# issue their chunks under the plan.
@pytest.mark.parametrize("crash_at, during", [(3, "plan exchange"), (5, "chunk")])
def test_a_dead_peer_is_an_error_naming_what_it_was_waiting_for_not_a_hang(
        tmp_path, crash_at, during):
    t0 = time.monotonic()
    processes = _run_ranks(_dies_mid_iteration, 2, str(tmp_path), crash_at, timeout=90)
    elapsed = time.monotonic() - t0
    assert processes[0].exitcode == 3
    message = (tmp_path / "rank0.txt").read_text()
    assert "commsched:" in message and f"iteration {crash_at}" in message, message
    assert "ranks [0, 1]" in message, message
    assert elapsed < 60
    if during == "plan exchange":
        assert "plan exchange" in message, message
        return
    assert "bytes" in message, message
    # The survivor's telemetry store is readable and records the failed chunk.
    from commsched.telemetry import load_run

    run = load_run(str(tmp_path / "telemetry"))
    rows = [r for r in run.rows("comm_ops") if r["rank"] == 0]
    assert any(r["ok"] for r in rows), "completed chunks before the failure are stored"
    failed = [r for r in rows if not r["ok"]]
    assert failed and failed[0]["iteration"] == crash_at, failed


def _one_rank_never_answers(rank, world, port, out_dir, silent):
    """Every rank but ``silent`` submits with COMMSCHED_TIMEOUT_S=3 (``silent`` never
    reaches the scheduler: a rank without commsched). Each writes what it saw; none issues
    a collective."""
    from commsched import safety

    safety.VERDICT_GRACE_S = 1.0          # (what the group's first rank gets ahead)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if rank != silent:
        sched = Scheduler(Config(timeout_s=3))
        start = time.monotonic()
        try:
            sched.submit(torch.ones(10), key="b0")
            outcome = "no error"
        except AgreementError as exc:
            outcome = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}\n{outcome}")
    else:
        deadline = time.monotonic() + 30     # (a rank that died without writing: no hang)
        while len(os.listdir(out_dir)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)


# Rank 1 silent: rank 0, the group's first, names it, and rank 2 reads that verdict;
# rank 0 silent: ranks 1 and 2 find out themselves once its verdict did not come.
@pytest.mark.parametrize("silent", [1, 0])
def test_a_rank_that_never_answers_the_agreement_check_is_named_within_the_timeout(
        tmp_path, silent):
    _run_ranks(_one_rank_never_answers, 3, str(tmp_path), silent)
    answered = [r for r in range(3) if r != silent]
    for rank in answered:
        elapsed, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert 3 <= float(elapsed) < 3 + 1 + 6, (rank, elapsed)
        assert message.startswith(
            f"commsched: ranks [{silent}] did not answer the agreement check before the first "
            f"collective (scheduler configuration) within 3 s, where ranks {answered} did: "
            f"they run without commsched"), (rank, message)


def _first_rank_exits_on_the_error(rank, world, port, out_dir):
    """Rank 0 (the group's first, the store's host) disagrees and exits the moment its
    AgreementError is raised, as a training script does."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sched = Scheduler(Config(timeout_s=20, partition_bytes=1024 if rank == 0 else 2048))
    try:
        sched.submit(torch.ones(10), key="b0")
        outcome = "no error"
    except AgreementError as exc:
        if rank == 0:
            os._exit(0)
        outcome = str(exc)
    except Exception as exc:  # noqa: BLE001 - any other error is the failure
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    os._exit(0)


def test_the_verdict_reaches_every_rank_when_the_first_rank_exits_on_it(tmp_path):
    for attempt in range(3):              # (without the read receipts most runs lose it)
        out = tmp_path / str(attempt)
        out.mkdir()
        _run_ranks(_first_rank_exits_on_the_error, 3, str(out))
        for rank in (1, 2):
            message = (out / f"rank{rank}.txt").read_text()
            assert message.startswith("commsched: ranks disagree before the first "
                                      "collective"), (attempt, rank, message)
            assert "'partition_bytes' differs" in message, (attempt, rank, message)


def test_without_commsched_timeout_the_agreement_check_waits_the_start_up_bound():
    from commsched.safety import STARTUP_BOUND_S, agreement_timeout

    assert STARTUP_BOUND_S == 300.0
    assert agreement_timeout(0) == STARTUP_BOUND_S
    assert agreement_timeout(20) == 20


def _exchange_without_peer(rank, world, port, out_dir):
    from commsched.safety import all_reduce_max

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if rank == 0:
        start = time.monotonic()
        try:
            all_reduce_max([1, 2], torch.int64, None, torch.device("cpu"), None, timeout_s=2,
                           what="the plan exchange")
            outcome = "no error"
        except SchedulerError as exc:
            outcome = str(exc)
        with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}\n{outcome}")
    else:
        while not os.path.exists(os.path.join(out_dir, "rank0.txt")):
            time.sleep(0.1)
    os._exit(0)


def test_an_exchange_of_commscheds_own_is_bounded_by_commsched_timeout(tmp_path):
    _run_ranks(_exchange_without_peer, 2, str(tmp_path))
    elapsed, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert 2 <= float(elapsed) < 8, elapsed
    assert message.startswith("commsched: the plan exchange did not complete within 2 s "
                              "(COMMSCHED_TIMEOUT_S)"), message
