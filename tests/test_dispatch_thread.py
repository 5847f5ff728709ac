"""The dispatch thread (Config.dispatch): which thread issues the collectives, and that a
lane with a dispatch thread keeps the inline lane's contract — errors at submission, the
end of an iteration as a synchronisation point, failures reaching every waiter, nothing
queued lost at close. Results against plain sums on 2 ranks are in test_scheduler.py.

In-process tests run on a one-rank gloo group; ``issue_step`` is wrapped to see which
thread issues each step (and, where asked, to fail).
"""

import threading

import pytest
import torch

import commsched.scheduler
from commsched import Config, ConfigError, Scheduler, SchedulerError
from commsched.observer import Observer


@pytest.fixture
def issuers(monkeypatch):
    """Names of the threads that issued each step, in order; ``fail_on`` makes the step of
    that request key raise instead."""
    real = commsched.scheduler.issue_step
    seen = []

    def issue_step(chunk, step):
        if chunk.request.key == seen_state["fail_on"]:
            raise RuntimeError("injected issue failure")
        seen.append(threading.current_thread().name)
        return real(chunk, step)

    seen_state = {"fail_on": None}
    monkeypatch.setattr(commsched.scheduler, "issue_step", issue_step)
    return seen, seen_state


def _config(dispatch, **kw):
    return Config(partition_bytes=256, credit_bytes=0, policy="fifo", dispatch=dispatch, **kw)


@pytest.mark.parametrize("dispatch, thread", [("thread", "commsched-g0-dispatch"),
                                              ("inline", "MainThread"),
                                              ("auto", "MainThread")])
def test_which_thread_issues(world1, issuers, dispatch, thread):
    """thread: the lane's dispatch thread; inline, and auto on CPU: the caller."""
    seen, _ = issuers
    sched = Scheduler(_config(dispatch), owns_groups=True)
    reqs = [sched.submit(torch.full((100,), float(i)), key=i) for i in range(3)]
    record = sched.end_iteration()
    for i, req in enumerate(reqs):
        assert torch.equal(req.wait(), torch.full((100,), float(i)))
    assert set(seen) == {thread} and len(seen) == 6       # 400 bytes: 2 chunks each
    assert (record.requests, record.chunks, record.nbytes) == (3, 6, 1200)
    sched.close()


def test_end_iteration_waits_for_the_dispatch_thread(world1, issuers):
    """end_iteration() returns once the dispatch thread took the iteration in, with its
    record; wait_dispatched=True once every step was issued."""
    seen, _ = issuers
    sched = Scheduler(_config("thread"), trace_dispatch=True)
    for it in range(3):
        reqs = [sched.submit(torch.ones(1000), key=k) for k in "abc"]
        record = sched.end_iteration(wait_dispatched=True)
        assert record.iteration == it and record.requests == 3
        assert len(seen) == 48 * (it + 1)             # 4000 bytes: 16 chunks a request
        assert sched.last_iteration() == record
        for req in reqs:
            assert req.iteration == it
            req.wait()
    assert sched.end_iteration() is None              # nothing submitted since
    sched.close()


def test_private_end_does_not_wait_for_the_dispatch_thread(world1, issuers):
    """private=True: end_iteration() returns (None) while the dispatch thread is still
    busy; the iteration still ends there, results and records are those of a waited end."""
    seen, _ = issuers
    sched = Scheduler(_config("thread"))
    sched.submit(torch.ones(1000), key="first")          # creates the lane
    assert sched.end_iteration(wait_dispatched=True).iteration == 0
    lane = next(iter(sched._lanes.values()))
    issued = len(seen)
    returned = threading.Event()
    with lane.lock:                      # the dispatch thread cannot take anything in
        reqs = [sched.submit(torch.full((1000,), float(k)), key=k) for k in range(3)]
        caller = threading.Thread(
            target=lambda: (sched.end_iteration(private=True), returned.set()), daemon=True)
        caller.start()
        assert returned.wait(10), "a private end waited for the dispatch thread"
        assert len(seen) == issued       # nothing of this iteration issued yet
    for k, req in enumerate(reqs):
        assert torch.equal(req.wait(), torch.full((1000,), float(k)))
        assert req.iteration == 1
    # The next iteration is a new one: same keys accepted, records numbered on.
    reqs = [sched.submit(torch.ones(1000), key=k) for k in range(3)]
    record = sched.end_iteration(wait_dispatched=True)
    assert record.iteration == 2 and record.requests == 3
    assert sched.last_iteration(None).iteration == 2
    assert sched.end_iteration(private=True) is None      # nothing submitted since
    for req in reqs:
        req.wait()
    assert len(seen) == issued + 2 * 3 * 16
    sched.close()


def test_duplicate_key_is_rejected_at_submission(world1):
    sched = Scheduler(_config("thread"))
    sched.submit(torch.ones(10), key="w")
    with pytest.raises(SchedulerError, match="'w' submitted twice"):
        sched.submit(torch.ones(10), key="w")
    sched.end_iteration()
    sched.submit(torch.ones(10), key="w").wait()      # a new iteration takes it again
    sched.end_iteration()
    sched.close()


def test_failure_on_the_dispatch_thread_reaches_every_waiter(world1, issuers):
    """A step that cannot be issued fails the lane: the futures of what was queued, the
    end of the iteration, and the next submission all raise it (as inline, the lane's
    unfinished requests fail with it)."""
    _, state = issuers
    state["fail_on"] = "bad"
    sched = Scheduler(_config("thread"))
    sched.submit(torch.ones(10), key="good")             # creates the lane
    lane = next(iter(sched._lanes.values()))
    # Held, the lane's lock keeps the dispatch thread from failing before "later" is
    # queued (a submission after the failure raises it at once, tested below).
    with lane.lock:
        bad = sched.submit(torch.ones(10), key="bad")
        later = sched.submit(torch.ones(10), key="later")
    with pytest.raises(RuntimeError, match="injected issue failure"):
        sched.end_iteration()
    for req in (bad, later):
        with pytest.raises(SchedulerError, match="injected issue failure"):
            req.wait()
    with pytest.raises(RuntimeError, match="injected issue failure"):
        sched.submit(torch.ones(10), key="next")
    sched.close()


def test_close_dispatches_what_was_queued(world1):
    sched = Scheduler(_config("thread"))
    reqs = [sched.submit(torch.full((50,), 2.0), key=i) for i in range(20)]
    sched.end_iteration()
    sched.close()
    for req in reqs:
        assert req.future.done() and torch.equal(req.wait(), torch.full((50,), 2.0))
    assert not sched._lanes[torch.distributed.group.WORLD].inbox.thread.is_alive()
    with pytest.raises(SchedulerError, match="closed"):
        sched.submit(torch.ones(10), key="after")


def test_end_iteration_after_close_raises_instead_of_waiting(world1):
    sched = Scheduler(_config("thread"))
    sched.submit(torch.ones(10), key="a")      # closed with its iteration still open
    sched.close()
    with pytest.raises(SchedulerError, match="lane g0 is closed"):
        sched.end_iteration()                 # no dispatch thread left to take it in


def test_thread_is_rejected_with_autotune():
    with pytest.raises(ConfigError, match="COMMSCHED_DISPATCH.*autotune"):
        Config(dispatch="thread", autotune=True)
    with pytest.raises(ConfigError, match="COMMSCHED_DISPATCH='threads'"):
        Config.from_env({"COMMSCHED_DISPATCH": "threads"})
    assert Config.from_env({"COMMSCHED_DISPATCH": " Inline "}).dispatch == "inline"


def test_an_observer_error_on_the_dispatch_thread_fails_the_lane(world1):
    """The observer's on_iteration runs on the dispatch thread: its error reaches the caller
    instead of leaving end_iteration() waiting forever."""

    class Broken(Observer):
        def on_chunk(self, record):
            pass

        def on_iteration(self, record):
            raise ValueError("observer broke")

    sched = Scheduler(_config("thread"), observer=Broken())
    sched.submit(torch.ones(10), key="a")
    with pytest.raises(ValueError, match="observer broke"):
        sched.end_iteration()
    with pytest.raises(ValueError, match="observer broke"):
        sched.submit(torch.ones(10), key="b")
    sched.close()
