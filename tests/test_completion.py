"""The completion hand-off: chunks that finished meanwhile are completed in one batch,
failures inside a batch still reach the request, and only a real wait can time out.

The collectives are replaced by works whose completion the test controls, on a one-rank
gloo group, so what the completion thread does is deterministic.
"""

import collections
import gc
import threading
import time
import weakref

import pytest
import torch

import commsched.issue
import commsched.scheduler
import commsched.workers
from commsched import Config, Scheduler, SchedulerError


class FakeWork:
    """A collective that finishes when the test says so."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.done.is_set()


@pytest.fixture
def works(monkeypatch):
    issued = []

    def issue_step(chunk, step):
        work = FakeWork()
        issued.append(work)
        return work

    monkeypatch.setattr(commsched.issue, "issue_step", issue_step)
    return issued


def _submit_four_chunks(config):
    sched = Scheduler(config)
    req = sched.submit(torch.ones(1024), key="a")        # 4 KiB in chunks of 1 KiB
    sched.end_iteration()
    assert len(req.chunks) == 4
    return sched, req


def _settle():
    time.sleep(0.2)       # room for the completion thread to act, if it (wrongly) would


def test_chunks_that_finished_meanwhile_complete_in_one_hand_off(world1, works):
    sched, req = _submit_four_chunks(Config(partition_bytes=1024, credit_bytes=0,
                                            policy="fifo"))
    for work in works[1:]:
        work.done.set()
    _settle()
    # The thread waits for the oldest chunk: nothing completes before it did.
    assert not req.future.done()
    assert sched.stats()["completion_batches"] == 0
    works[0].done.set()
    assert torch.equal(req.wait(), torch.ones(1024))
    assert sched.stats()["completion_batches"] == 1
    sched.drain(timeout=10)
    sched.close()


def test_a_failure_inside_a_batch_fails_the_request(world1, works):
    sched, req = _submit_four_chunks(Config(partition_bytes=1024, credit_bytes=0,
                                            policy="fifo"))
    works[2].error = RuntimeError("link down")
    for work in works[1:]:
        work.done.set()
    works[0].done.set()
    with pytest.raises(SchedulerError, match=r"chunk 2/4 of request 'a'.*link down"):
        req.wait()
    assert sched.stats()["completion_batches"] == 1
    sched.close()


def test_only_a_wait_times_out_and_the_error_names_its_chunk(world1, works):
    sched, req = _submit_four_chunks(Config(partition_bytes=1024, credit_bytes=0,
                                            policy="fifo", timeout_s=1))
    for work in works[1:]:
        work.done.set()
    try:
        with pytest.raises(SchedulerError,
                           match=r"chunk 0/4 of request 'a'.*did not complete within"):
            req.wait()
    finally:
        works[0].done.set()       # let the completion thread go
        sched.close()


def test_schedulers_left_open_are_closed_at_exit(world1):
    """At exit every open scheduler's threads are joined, so none is inside a torch call
    when the interpreter finalizes (which aborts the process)."""
    sched = Scheduler(Config(partition_bytes=1024, credit_bytes=0, policy="fifo"))
    req = sched.submit(torch.ones(1024), key="a")
    sched.end_iteration()
    req.wait()
    threads = [t for lane in sched._lanes.values()
               for t in (lane.completion.thread, lane.watchdog.thread)]
    assert threads and all(t.is_alive() for t in threads)
    commsched.scheduler._close_at_exit()
    assert sched._closed and not any(t.is_alive() for t in threads)


def test_completed_chunks_let_go_of_their_collectives(world1, monkeypatch):
    # A collective's work may own buffers until it is destroyed (NCCL keeps the flat output
    # of a list-form all-gather in it), and requests and chunks reference each other: a
    # work a finished chunk still held would live until Python's cycle collector ran.
    real, refs = commsched.issue.issue_step, []

    def issue_step(chunk, step):
        work = real(chunk, step)
        refs.append(weakref.ref(work))
        return work

    monkeypatch.setattr(commsched.issue, "issue_step", issue_step)
    # (gloo collectives are also kept, deliberately and a bounded number, for the end of
    # the process: commsched.workers.retain; not here)
    monkeypatch.setattr(commsched.workers, "_recent_works", collections.deque(maxlen=0))
    gc.disable()                  # reference counting only
    sched = Scheduler(Config(partition_bytes=1024))
    try:
        reqs = [sched.submit(torch.ones(1024), key=op, op=op)      # 4 chunks each
                for op in ("all_reduce", "reduce_scatter", "all_gather")]
        sched.end_iteration()
        for req in reqs:
            req.wait()
        sched.drain()
        deadline = time.monotonic() + 5
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)      # the completion thread may still be returning
        assert len(refs) == 12
        assert len([r() for r in refs if r() is not None]) == 0
        assert all(c.works is None for req in reqs for c in req.chunks)
    finally:
        gc.enable()
        sched.close()
