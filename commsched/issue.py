"""Issuing a lane's collective steps: the streams they go from, the events that order and
time them, and the options each collective takes ([Note: the hot path] in
docs/design.md).

A request issued when it was submitted goes from the caller's stream, as a plain
collective would: no stream switch, no event. One that was held back (by the order or the
credit window) recorded a ready event in the caller's stream when it was submitted
(``mark_ready``) and goes from the launch stream after that event. Events after a step, on
the completion side's done stream, exist only where somebody needs them: timings (an
extension), a credit window (credit returns at the step's end), a padded chunk (copied
back after its last step).
"""

from __future__ import annotations

import collections
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .collectives import (OptionsByOp, all_gather_options, all_reduce_options,
                          averages_in_collective, finish_chunk, issue_step,
                          reduce_scatter_options)
from .observer import DeviceMark
from .readiness import Marks
from .workers import retain

__all__ = ["Issuer", "RequestBook"]


class RequestBook:
    """A lane's requests whose outcome is not set yet (``outstanding``), those of them
    fully issued on CUDA whose outcome the lane sets next (``dispatched``), and how many
    requests were fully issued (each one's ``issue_seq``). Guarded by the lane's lock;
    futures are resolved outside it."""

    __slots__ = ("outstanding", "dispatched", "issued")

    def __init__(self) -> None:
        self.outstanding: Dict[int, object] = {}
        self.dispatched: list = []
        self.issued = 0

    def track(self, req) -> None:
        self.outstanding[id(req)] = req

    def fully_issued(self, req) -> None:
        """Every chunk of ``req`` was issued: its place in the lane's issue order."""
        req.issue_seq = self.issued
        self.issued += 1

    def take_dispatched(self) -> list:
        """The CUDA requests fully issued since last asked, their outcome set (resolved:
        they carry no stream, ``Request.wait()`` orders the caller)."""
        if not self.dispatched:
            return self.dispatched
        dispatched, self.dispatched = self.dispatched, []
        for req in dispatched:
            self.outstanding.pop(id(req), None)
            req.outcome = True
        return dispatched

    def finished(self, req) -> None:
        """Every chunk of ``req`` completed (CPU): resolved."""
        self.outstanding.pop(id(req), None)
        req.outcome = True

    def fail_pending(self, error: BaseException) -> list:
        """Fail every request whose outcome is not set yet; returns them."""
        failed = [r for r in self.outstanding.values() if r.outcome is None]
        for req in failed:
            req.outcome = error
        self.outstanding.clear()
        return failed


class Issuer:
    """Issues a lane's collective steps, and owns what it issues them with: the collective
    options per reduction (built once per lane rather than per request:
    ``reduce_options(op)``, ``sync_reduce_options(op)``, ``scatter_options(op)``,
    ``gather_options``), the launch stream and the pool of ready events (CUDA), and
    whether the group times its own collectives (``group_timed``). Each issued step goes
    to the completion side; ``ext`` (or None) is told around it, and ``timed``: every step
    gets timing events."""

    __slots__ = ("device", "cuda", "kernel_average", "reduce_options", "sync_reduce_options",
                 "scatter_options", "gather_options", "launch_stream", "ready_events",
                 "group_timed", "completion", "credit", "book", "ext", "timed")

    def __init__(self, group, device: torch.device, world_size: int, completion, credit,
                 book: RequestBook, ext, timed: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.completion = completion
        self.credit = credit
        self.book = book
        self.ext = ext
        self.timed = timed
        # Averaging inside the collective saves the division's pass over the tensor.
        self.kernel_average = averages_in_collective(str(dist.get_backend(group)), self.cuda,
                                                     world_size)
        self.reduce_options = OptionsByOp(all_reduce_options).get
        self.sync_reduce_options = OptionsByOp(
            lambda reduce_op: all_reduce_options(reduce_op, async_op=False)).get
        self.scatter_options = OptionsByOp(reduce_scatter_options).get
        self.gather_options = all_gather_options()
        self.launch_stream = torch.cuda.Stream(device) if self.cuda else None
        # Ready events, recorded by mark_ready() and free again once the request's first
        # steps were issued (a stream's wait on an event takes the event as recorded at the
        # time of the wait): no event is created and destroyed per request.
        self.ready_events: "collections.deque" = collections.deque()
        # Telemetry where the caller completes: the group times its own collectives, and a
        # step needs no event after it (issue_cuda, Completion.device_times).
        self.group_timed = (self.cuda and completion.polled and timed
                            and _enable_collective_timing(group))

    def issue(self, chunk, step: int) -> None:
        """Issue step ``step`` of ``chunk`` (lock held), and hand it to the completion
        side."""
        req = chunk.request
        name = req.steps[step]
        if step == 0:
            chunk.t_dispatch_ns = time.time_ns()
        ext = self.ext
        if ext is not None:
            ext.issuing(f"commsched {name} {req.key}#{chunk.index}")
        last = step == len(req.steps) - 1
        whole = False
        if last:
            req.chunks_issued += 1
            whole = req.chunks_issued == len(req.chunks)
            if whole:
                self.book.fully_issued(req)
        completion = self.completion
        if self.cuda:
            timed = self.timed or (ext is not None and ext.wants_records())
            start, end, work = self.issue_cuda(chunk, step, last, timed,
                                               bool(self.credit.limit), completion)
            if whole:
                req.done_work = work
                self.book.dispatched.append(req)
                self.release_ready(req)
                if req.marks is not None:
                    self._mark_end_for_profile(req, work)
            # The newest step per process group (a topology step names its sub-group):
            # NCCL runs each group's collectives in issue order, so waiting for it waits
            # for every step issued before it on that group.
            completion.newest[name if req.cross_group else None] = work
            if end is None and start is None and not req.cross_group:
                completion.batch(chunk, step, last, work)
            else:
                completion.add(chunk, step, work, start, end,
                               end is not None and end is req.done_event)
        else:
            work = chunk.works = issue_step(chunk, step)
            retain(work)
            completion.add(chunk, step, work, None, None, False)
        if ext is not None:
            ext.issued()
        if self._urgent(chunk, last):
            completion.ring()
        else:
            completion.bound()

    def issue_batched(self, req, chunk) -> None:
        """Issue ``req`` (one step of one chunk, resolved at once) into the open completion
        batch: nobody needs its steps one by one (CUDA, no extension, no credit window).
        An all-reduce calls the process group from here rather than through
        ``issue_step``: NCCL's flight recorder captures the Python stack of every
        collective it records, one frame less."""
        chunk.t_dispatch_ns = time.time_ns()
        req.chunks_issued = 1
        self.book.fully_issued(req)
        completion = self.completion
        if req.op != "all_reduce":
            work = issue_step(chunk, 0)
        elif req.synchronous:
            work = req.group.allreduce([req.tensor], self.synchronous_options(req))
        else:
            work = req.group.allreduce([req.tensor], req.reduce_options)
        req.outcome = True
        if req.marks is not None:
            self._mark_end_for_profile(req, work)
        if work is None:
            # Synchronous on NCCL: the collective is in the caller's stream, which orders
            # whatever the caller does next after it; the lane has nothing to complete.
            self.credit.give(chunk.nbytes)
            chunk.request = None
            return
        req.done_work = completion.newest[None] = work
        completion.batch(chunk, 0, True, work)
        completion.bound()

    def _urgent(self, chunk, last: bool) -> bool:
        """Whether somebody waits for this step's completion ([Note: completion hand-off]
        in docs/design.md)."""
        if self.credit.limit:
            return True                   # the credit it returns may be what dispatch waits for
        if chunk.staging is not None:
            return True                   # a padded copy: free it as soon as it is done
        if self.cuda:
            return False                  # futures resolve at dispatch, steps are stream-ordered
        req = chunk.request
        # CPU: the chunk's next step, the recorded device times (no events to recover them
        # from later), and a future somebody waits for need the completion when it
        # happens. Other futures resolve with the iteration's batch (woken at its end):
        # a wake-up per request would cost a GIL hand-off each.
        ext = self.ext
        return (not last or req.waited
                or (ext is not None and (self.timed or ext.wants_records())))

    def flush_mark(self) -> Optional[DeviceMark]:
        """The end of the iteration in the caller's stream, for telemetry: the device may
        get there long after the host (one timed event per iteration)."""
        if not (self.cuda and self.timed):
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return DeviceMark(self.device, event)

    def mark_ready_for_profile(self, req) -> None:
        """``req`` is profiled: mark where it is ready (readiness.Marks)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            req.marks = Marks(event)
        else:
            req.marks = Marks(req.t_submit_ns)

    def _mark_end_for_profile(self, req, work) -> None:
        """A profiled request was fully issued (CUDA): an event after ``work``, its last
        collective (None: it ran on the caller's stream), on the done stream."""
        event = torch.cuda.Event(enable_timing=True)
        if work is None:
            event.record()
        else:
            done_stream = self.completion.done_stream
            caller = torch.cuda.current_stream(self.device)
            torch.cuda.set_stream(done_stream)
            try:
                work.wait()
                event.record(done_stream)
            finally:
                torch.cuda.set_stream(caller)
        req.marks.end = event

    def mark_ready(self, req) -> None:
        """Record where ``req``'s tensor is ready in the caller's stream (CUDA)."""
        if self.cuda:
            try:
                req.ready_event = self.ready_events.pop()
            except IndexError:
                req.ready_event = torch.cuda.Event()
            req.ready_event.record()

    def release_ready(self, req) -> None:
        """Every step 0 of ``req`` was issued: its ready event is free again."""
        if req.ready_event is not None:
            self.ready_events.append(req.ready_event)
            req.ready_event = None

    def issue_cuda(self, chunk, step: int, last: bool, timed: bool, bounded: bool,
                   completion):
        """Issue one step on CUDA; returns (start event, end event, work). ``timed``: the
        step gets timing events; ``bounded``: a credit window waits for its end.

        Telemetry on a lane whose caller completes (``group_timed``) needs no event after a
        first step on the lane's own group: that group times its collectives itself, and
        the step's start event, in the issuing stream, costs that stream nothing. See
        [Note: no waits on the collective] in docs/design.md for why no other end event is
        recorded."""
        req = chunk.request
        start = None
        if req.ready_event is None and not (step and req.cross_group):
            if timed:
                start = completion.event()
                start.record()
            work = issue_step(chunk, step)
        else:
            caller = torch.cuda.current_stream(self.device)
            torch.cuda.set_stream(self.launch_stream)
            try:
                if step == 0:
                    self.launch_stream.wait_event(req.ready_event)
                elif req.cross_group:
                    # The previous step ran on another group's stream: order on the device.
                    chunk.works.wait()
                if timed:
                    start = completion.event()
                    start.record(self.launch_stream)
                work = issue_step(chunk, step)
            finally:
                torch.cuda.set_stream(caller)
        chunk.works = work
        padded = last and chunk.staging is not None
        if not (timed or bounded or padded):
            return start, None, work
        if self.group_timed and step == 0 and not (padded or req.cross_group):
            # Its end from the group's own timing (Completion.device_times). Not for a
            # later step: its start event, in whatever stream issued it, does not order it
            # (the step before it on the group's stream does).
            return start, None, work
        done_stream = completion.done_stream
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(done_stream)
        try:
            work.wait()
            if padded:
                finish_chunk(chunk)
            end = completion.event() if not padded else torch.cuda.Event(
                enable_timing=True, blocking=True)
            end.record(done_stream)
        finally:
            torch.cuda.set_stream(caller)
        if padded:
            completion.newest["copy"] = end
            if req.chunks_issued == len(req.chunks):
                req.done_event = end      # the copy back is what a waiter needs
        return start, end, work

    def synchronous_options(self, req):
        """The options of a whole all-reduce issued with ``asyncOp = False``: on NCCL it
        runs on the caller's current stream and no work comes back (None), as for a
        synchronous ``dist.all_reduce``; a backend that ignores the flag returns a work,
        completed as any other. The caller's stream first waits for the lane's newest
        asynchronous collective, once: the two streams' collectives then run in issue
        order, as every rank issues them."""
        completion = self.completion
        newest = completion.newest.get(None)
        if newest is not None and newest is not completion.joined:
            newest.wait()
            completion.joined = newest
        return self.sync_reduce_options(req.reduce_op)


def _enable_collective_timing(group) -> bool:
    """Have ``group`` time its own collectives (NCCL: a start event beside the end event of
    every collective, read by ``Work._get_duration()``), for every caller of the group;
    False where the process group cannot."""
    enable = getattr(group, "_enable_collectives_timing", None)
    if enable is None or not hasattr(dist.Work, "_get_duration"):
        return False
    try:
        enable()
    except RuntimeError:
        return False
    return True
