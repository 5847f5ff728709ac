"""Scheduler.set_fifo: a group dispatched in submission order, with no plan exchange, next
to groups that follow the configured priority policy."""

import pytest
import torch
import torch.distributed as dist

from commsched import Config, Scheduler, SchedulerError


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
    sched.set_fifo(fifo)
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
        sched.set_fifo(fifo)
    sched.drain(timeout=10)
    sched.close()
