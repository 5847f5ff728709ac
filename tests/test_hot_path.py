"""The hot path: a request that the order issues next goes out from inside ``submit()``,
on the caller's thread, and a held request waits for whatever releases it; request futures
exist only once asked for; ``join()`` orders the caller after what was issued.

In-process tests on a one-rank gloo group; ``issue_step`` is wrapped to record what was
issued and from where, and the reference values are plain sums computed here.
"""

import gc
import threading

import pytest
import torch

import commsched.issue
from commsched import Config, Scheduler
from commsched.plan import Plan


@pytest.fixture
def issued(monkeypatch):
    """(request key, thread name) of every issued step, in issue order."""
    real = commsched.issue.issue_step
    log = []

    def issue_step(chunk, step):
        log.append((chunk.request.key, threading.current_thread().name))
        return real(chunk, step)

    monkeypatch.setattr(commsched.issue, "issue_step", issue_step)
    return log


def test_a_request_next_in_order_is_issued_inside_submit(world1, issued):
    sched = Scheduler(Config())                       # defaults: whole, priority, inline
    for i in range(3):
        sched.submit(torch.full((64,), float(i)), key=i)
        assert issued[-1] == (i, "MainThread")        # before submit() returned
    record = sched.end_iteration()
    assert (record.requests, record.chunks, record.nbytes) == (3, 3, 3 * 64 * 4)
    sched.drain(timeout=30)
    sched.close()


def test_a_request_the_plan_puts_later_waits_for_the_one_before_it(world1, issued):
    """Under a plan that reverses the submission order, the first request is held until
    the second (planned first) is submitted, which issues both, in plan order."""
    sched = Scheduler(Config(profile_iters=1))
    sched.submit(torch.ones(8), key="a")
    sched.submit(torch.ones(8), key="b")
    sched.end_iteration()
    sched.drain(timeout=30)
    lane = sched._lanes[torch.distributed.group.WORLD]
    # Rank-invariant by construction: the same plan on every rank (one rank here).
    lane.order.plan = Plan((("b", 0), ("a", 0)), {"a": 1, "b": 1})
    lane.order.planned_layout, lane.order.next_profile = "kept", None
    issued.clear()
    a = sched.submit(torch.full((8,), 2.0), key="a")
    assert issued == [] and not a.done()             # held: b goes first
    b = sched.submit(torch.full((8,), 3.0), key="b")
    assert [key for key, _ in issued] == ["b", "a"]
    sched.end_iteration()
    assert torch.equal(a.wait(), torch.full((8,), 2.0))
    assert torch.equal(b.wait(), torch.full((8,), 3.0))
    sched.close()


def test_the_future_is_made_when_asked_for_and_resolved_either_way(world1):
    sched = Scheduler(Config(policy="fifo"))
    early = sched.submit(torch.full((16,), 1.0), key="early")
    assert early._future is None                      # nobody asked: none was made
    future = early.future                             # asked before completion
    late = sched.submit(torch.full((16,), 2.0), key="late")
    sched.end_iteration()
    sched.drain(timeout=30)
    assert torch.equal(future.wait(), torch.full((16,), 1.0))
    assert late.done() and late._future is None
    assert late.future.done()                         # made after it resolved
    assert torch.equal(late.future.wait(), torch.full((16,), 2.0))
    sched.close()


def test_join_returns_once_every_issued_collective_completed(world1):
    sched = Scheduler(Config(policy="fifo"))
    reqs = [sched.submit(torch.full((1 << 16,), float(i)), key=i) for i in range(4)]
    sched.join()
    assert all(r.done() for r in reqs)
    for i, r in enumerate(reqs):
        assert torch.equal(r.tensor, torch.full((1 << 16,), float(i)))
    sched.end_iteration()
    sched.close()


def test_a_wait_before_the_iteration_ended_completes_the_request(world1):
    """On CPU a request's future resolves with its iteration's batch; one that somebody
    waits for is completed at once instead."""
    sched = Scheduler(Config(policy="fifo"))
    req = sched.submit(torch.full((32,), 5.0), key=0)
    assert torch.equal(req.wait(), torch.full((32,), 5.0))
    sched.end_iteration()
    sched.close()


def scheduler_garbage(run) -> list:
    """The Requests and Chunks that ``run()`` left to Python's cycle collector."""
    from commsched.partition import Chunk
    from commsched.scheduler import Request

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, (Request, Chunk))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("config", [Config(), Config(partition_bytes=64, credit_bytes=128)],
                         ids=["default", "partitioned"])
def test_finished_requests_leave_no_reference_cycle(world1, config):
    """A request and its chunks reference each other until the lane is done with them; a
    cycle left behind would cost the training thread cycle-collector pauses."""
    sched = Scheduler(config)

    def run():
        for _ in range(3):
            requests = [sched.submit(torch.full((64,), float(i)), key=i) for i in range(4)]
            sched.end_iteration()
            for i, request in enumerate(requests):
                assert torch.equal(request.wait(), torch.full((64,), float(i)))
        sched.drain(timeout=30)

    assert scheduler_garbage(run) == []
    sched.close()
