"""Scheduler.set_fifo: a group dispatched in submission order, with no plan exchange, next
to groups that follow the configured priority policy."""

import pytest
import torch
import torch.distributed as dist

from commsched import Config, Scheduler, SchedulerError
from distributed import run_workers


def _iterations(sched, group, n=4):
    for _ in range(n):
        # submitted last-layer first, as a backward does; priority 0 = needed first
        reqs = [sched.submit(torch.ones(256), key=k, priority=p, group=group)
                for k, p in (("c", 2), ("b", 1), ("a", 0))]
        sched.end_iteration(group)
        for r in reqs:
            r.wait()


def test_fifo_group_keeps_submission_order_and_never_plans(world1):
    sched = Scheduler(Config(policy="priority", profile_iters=1, partition_bytes=256,
                             credit_bytes=256), trace_dispatch=True)
    fifo = dist.new_group([0])
    sched.set_fifo(fifo, "cpu")
    _iterations(sched, fifo)
    log = sched.dispatch_log(fifo)
    assert not any(e[0] == "plan" for e in log)
    # 4 chunks per request, requests in submission order, every iteration
    assert [e[1] for e in log] == [k for k in "cba" for _ in range(4)] * 4
    # The world group, same config, does build plans: the contrast that makes the above
    # mean something.
    _iterations(sched, None)
    world_log = sched.dispatch_log(None)
    assert any(e[0] == "plan" for e in world_log)
    with pytest.raises(SchedulerError, match="already has requests"):
        sched.set_fifo(fifo, "cpu")
    sched.drain(timeout=10)
    sched.close()


def _first_request_at_different_points(rank, world):
    """Rank 0 makes the fifo group's first request before a blocking collective on another
    group, rank 1 after it (the data-parallel mode's first all-gather: in step() on one
    rank, in the next forward on another). The lane was created by set_fifo(), so the
    first request blocks on nothing."""
    sched = Scheduler(Config())
    fifo, other = dist.new_group([0, 1]), dist.new_group([0, 1])
    sched.set_fifo(fifo, "cpu")
    t = torch.full((8,), float(rank + 1))
    if rank == 0:
        req = sched.submit(t, key="x", group=fifo)
        sched.end_iteration(fifo)
        dist.all_reduce(torch.ones(1), group=other)
    else:
        dist.all_reduce(torch.ones(1), group=other)
        req = sched.submit(t, key="x", group=fifo)
        sched.end_iteration(fifo)
    assert torch.equal(req.wait(), torch.full((8,), 3.0))
    sched.close()


def test_first_request_may_come_at_different_points_on_different_ranks():
    run_workers(_first_request_at_different_points, 2, timeout=60)
