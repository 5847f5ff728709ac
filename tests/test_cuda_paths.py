"""The scheduler's CUDA code paths, run on CPU processes under a fake CUDA runtime
(``fake_cuda``: streams and events that do nothing, gloo collectives made synchronous).

They check the bookkeeping of what otherwise runs only on GPUs — completion batches and
their caller-side completion, held requests issued from the launch stream, per-step
events under a credit window or telemetry, the watchdog handing stale
batches over, the DDP hook's per-bucket futures — against plain collectives and stock
DDP. With 2 ranks every sum is a + b, so results must be bitwise equal. Streams and
devices themselves: ``tests/gpu``.
"""

import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import SmallNet, run_workers

SIZES = (1000, 40, 3000, 512, 7)


class _Records:
    def __init__(self):
        self.chunks, self.iterations = [], []

    def on_chunks(self, records):
        self.chunks.extend(records)

    def on_iteration(self, record):
        self.iterations.append(record)


def _iterations(sched, rank, iterations, priorities, check_each=None):
    """Submit SIZES (rank-dependent values) per iteration; compare with the plain sum."""
    for it in range(iterations):
        ts = [torch.arange(n, dtype=torch.float32) * (rank + 1) + it for n in SIZES]
        expected = [torch.arange(n, dtype=torch.float32) * 3 + 2 * it for n in SIZES]
        reqs = [sched.submit(t, key=i, priority=p)
                for i, (t, p) in enumerate(zip(ts, priorities))]
        sched.end_iteration()
        for r, e in zip(reqs, expected):
            assert torch.equal(r.wait(), e), (it, r.key)
        if check_each is not None:
            check_each(it, reqs)


def _cuda_paths(rank, world):
    import fake_cuda
    fake_cuda.install()
    import commsched
    from commsched import Config

    group = dist.group.WORLD
    backwards = [len(SIZES) - 1 - i for i in range(len(SIZES))]

    # Default settings: whole requests, completion batches, the caller completes them.
    sched = commsched.Scheduler(Config())
    lane = None

    def default_checks(it, reqs):
        nonlocal lane
        lane = sched._lanes[group]
        assert lane.batched and lane.completion.polled
        assert all(r.issued_work() is not None for r in reqs)     # issued at once
        assert len(lane.completion.in_flight) <= 2, (it, len(lane.completion.in_flight))
        assert sched.stats()["thread_batches"] == 0
        assert lane.order.link_cost.nbytes == 0           # batches are not link time
    _iterations(sched, rank, 6, backwards, default_checks)
    assert sched.stats()["completion_batches"] >= 5
    sched.close()

    # A plan that holds requests back (priorities against submission order, link time
    # measured by telemetry): held ones wait on a ready event, go from the launch stream,
    # and offer no work of their own to wait on. The caller completes the timed steps and
    # maps their events onto the host clock without waiting for the device, bar once for
    # the clock's first anchor (the watchdog renews it).
    from commsched.telemetry.device_clock import EventClock
    anchors = []
    refresh = EventClock.refresh

    def counted_refresh(clock):
        anchors.append(threading.get_ident())
        refresh(clock)

    EventClock.refresh = counted_refresh
    records = _Records()
    sched = commsched.Scheduler(Config(partition_bytes=1024, profile_iters=1),
                                observer=records)
    held = []
    _iterations(sched, rank, 5, list(range(len(SIZES))),
                lambda it, reqs: held.append(sum(r.issued_work() is None for r in reqs)))
    lane = sched._lanes[group]
    assert not lane.batched and lane.completion.polled
    sched.drain(timeout=30)
    assert not lane.completion.in_flight and lane.credit.in_flight == 0
    chunks = sum(-(-n * 4 // 1024) for n in SIZES)
    assert len(records.chunks) == 5 * chunks
    assert [r.iteration for r in records.iterations] == list(range(5))
    assert lane.order.link_cost.nbytes > 0            # per-step events: measured
    assert sched.stats()["thread_batches"] <= 1      # (drain's)
    assert sched.stats()["completion_batches"] >= 4
    assert anchors.count(threading.get_ident()) == 1
    sched.close()

    # A credit window: per-step end events, the completion thread returns the credit. It
    # maps the end events itself, and takes the clock's anchor itself (it may wait): the
    # watchdog does not touch the device for such a lane, nor does the caller.
    anchors.clear()
    sched = commsched.Scheduler(Config(partition_bytes=512, credit_bytes=2048))
    _iterations(sched, rank, 4, backwards)
    lane = sched._lanes[group]
    assert not lane.completion.polled
    sched.drain(timeout=30)
    assert lane.credit.in_flight == 0 and not lane.completion.in_flight
    assert 0 < sched.stats()["peak_in_flight_bytes"] <= 2048 + 512
    assert sched.stats()["thread_batches"] > 0
    assert set(anchors) == {lane.completion.thread.ident}
    EventClock.refresh = refresh
    sched.close()

    # rs_ag: two steps per chunk, the second issued right behind the first.
    sched = commsched.Scheduler(Config(partition_bytes=1000, decompose="rs_ag",
                                       policy="fifo"))
    _iterations(sched, rank, 3, backwards)
    sched.close()

    # The caller stops in the middle of an iteration: the watchdog hands what stays in
    # flight (an open batch, no event yet) to the completion thread.
    sched = commsched.Scheduler(Config(timeout_s=1, policy="fifo"))   # watchdog: 0.1 s
    _iterations(sched, rank, 2, backwards)
    last = sched.submit(torch.full((100,), float(rank + 1)), key="last")
    in_flight = sched._lanes[group].completion.in_flight
    assert in_flight and in_flight[-1].end is None
    deadline = time.monotonic() + 10
    while in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not in_flight
    assert sched.stats()["thread_batches"] >= 1
    assert torch.equal(last.wait(), torch.full((100,), 3.0))
    sched.end_iteration()
    sched.close()


def _synchronous_requests(rank, world):
    """submit(async_op=False) on a lane that issues whole requests at once: a request
    issued from submit() goes as a synchronous collective (no work: it is in the caller's
    stream) and leaves nothing for the lane to complete, the first of an iteration too
    (nothing of the last one is left to issue); requests that ask for nothing go as
    before. Values equal the plain sums in every mixture."""
    import fake_cuda
    fake_cuda.install()
    import commsched
    from commsched import Config

    sched = commsched.Scheduler(Config(policy="fifo"))
    for it in range(4):
        ts = [torch.arange(n, dtype=torch.float32) * (rank + 1) + it for n in SIZES]
        expected = [torch.arange(n, dtype=torch.float32) * 3 + 2 * it for n in SIZES]
        asynchronous = [it % 2 == 1 and i % 2 == 0 for i in range(len(SIZES))]
        reqs = [sched.submit(t, key=i, async_op=a)
                for i, (t, a) in enumerate(zip(ts, asynchronous))]
        lane = sched._lanes[dist.group.WORLD]
        assert lane.batched
        for i, req in enumerate(reqs):
            assert req.at_once, (it, i)
            assert (req.done_work is None) == (not asynchronous[i]), (it, i)
            assert req.synchronous == (not asynchronous[i])
        sched.end_iteration()
        for r, e in zip(reqs, expected):
            assert torch.equal(r.wait(), e), (it, r.key)
    sched.drain(timeout=30)
    assert lane.credit.in_flight == 0 and not lane.completion.in_flight
    assert lane.completion.joined is None and not lane.completion.newest
    try:
        sched.submit(torch.ones(4), key="bad", async_op=0)
    except ValueError as exc:
        assert "async_op=0" in str(exc)
    else:
        raise AssertionError("async_op=0 was accepted")
    sched.close()


def test_synchronous_requests_go_in_the_callers_stream_and_equal_plain_sums():
    run_workers(_synchronous_requests, 2, timeout=120)


def test_cuda_paths_equal_plain_collectives():
    run_workers(_cuda_paths, 2, timeout=120)


def _train(config, rank, steps=5):
    import commsched.hooks

    torch.manual_seed(0)
    ddp = DDP(SmallNet(), bucket_cap_mb=0.01)
    state = commsched.hooks.register(ddp, config) if config is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    if state is not None:
        state.close()
    return [p.detach().clone() for p in ddp.parameters()]


def _hook_futures(rank, world):
    import fake_cuda
    fake_cuda.install()
    from commsched import Config

    from test_hot_path import scheduler_garbage

    reference = _train(None, rank)
    for config in (Config(),                       # every bucket issued at once
                   Config(partition_bytes=512, credit_bytes=1024, profile_iters=1)):
        params = []
        # (and the lane's batches and completions leave no request-chunk cycle behind)
        assert scheduler_garbage(lambda: params.extend(_train(config, rank))) == []
        for a, b in zip(params, reference):
            assert torch.equal(a, b), config


def test_the_hooks_per_bucket_futures_equal_stock_ddp():
    """The hook returns the collective's own future for buckets issued at once, and joins
    only where one was held back."""
    run_workers(_hook_futures, 2, timeout=120)
