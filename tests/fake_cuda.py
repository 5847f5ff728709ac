"""Run the scheduler's CUDA code paths on CPU processes (gloo), for their bookkeeping.

``install()`` makes every lane created afterwards take its CUDA branches — completion
batches, the caller-side completion of polled lanes, ready events and the launch stream,
per-step end events, ``join()`` — with streams and events that do nothing and report every
event complete. Collectives stay gloo's, made synchronous (a gloo work is waited for before
it is returned), so the in-issue-order completion that the CUDA paths assume of NCCL
holds. What this cannot check is anything about devices and streams themselves: that is
``tests/gpu``'s job. Call it in the worker process, before the Scheduler is created.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


class FakeEvent:
    """Complete at once; timed by the host's clock when it was recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = 0
        self.t = 0.0

    def record(self, stream=None):
        self.recorded += 1
        self.t = time.perf_counter()

    def query(self):
        return True

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class FakeStream:
    def __init__(self, device=None, priority=0):
        self.waited = 0

    def wait_event(self, event):
        self.waited += 1

    def wait_stream(self, stream):
        self.waited += 1

    def synchronize(self):
        pass


class _Waited:
    """A work that was waited for: complete, as an NCCL work is once its kernel ran."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def __getattr__(self, name):
        return getattr(self.work, name)


_CURRENT = FakeStream()


def install() -> None:
    """Patch this process for good (a spawned worker's)."""
    import commsched.issue as issue
    import commsched.lane as lane

    cuda = torch.cuda
    cuda.Stream = FakeStream
    cuda.Event = FakeEvent
    cuda.current_stream = lambda device=None: _CURRENT
    cuda.set_stream = lambda stream: None
    cuda.set_device = lambda device: None
    cuda.stream = lambda stream: contextlib.nullcontext()

    group_type = type(dist.group.WORLD)
    allreduce = group_type.allreduce

    def synchronous_allreduce(self, *args, **kwargs):
        work = allreduce(self, *args, **kwargs)
        work.wait()
        options = args[1] if len(args) > 1 else kwargs.get("opts")
        # NCCL returns no work for a synchronous collective (asyncOp = False): it ran in
        # the caller's stream.
        return None if options is not None and not options.asyncOp else work

    group_type.allreduce = synchronous_allreduce
    issue_step = issue.issue_step

    def synchronous_issue_step(chunk, step):
        work = issue_step(chunk, step)
        work.wait()
        # gloo emulates a reduce-scatter, whose work never reports completion; NCCL's do
        return work if work.is_completed() else _Waited(work)

    issue.issue_step = synchronous_issue_step
    lane_init = lane.Lane.__init__

    def init(self, *args, **kwargs):
        lane_init(self, *args, **kwargs)
        self.cuda = True
        self.batched = self.lean and not self.config.credit_bytes
        completion, issuer = self.completion, self.issuer
        completion.cuda = completion.ordered = issuer.cuda = self.order.cuda = True
        completion.polled = not self.config.credit_bytes and not (
            self.ext is not None and self.ext.tunes)
        # (gloo's works cannot time themselves: their steps keep their completion's time)
        issuer.group_timed = completion.polled and self.timed
        issuer.launch_stream, completion.done_stream = FakeStream(), FakeStream()

    lane.Lane.__init__ = init
