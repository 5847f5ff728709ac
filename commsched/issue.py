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

import torch
import torch.distributed as dist

from .collectives import (OptionsByOp, all_gather_options, all_reduce_options, finish_chunk,
                          issue_step, reduce_scatter_options)

__all__ = ["Issuer"]


class Issuer:
    """Owns what a lane issues its steps with: the collective options per reduction (built
    once per lane rather than per request: ``reduce_options(op)``,
    ``sync_reduce_options(op)``, ``scatter_options(op)``, ``gather_options``), the launch
    stream and the pool of ready events (CUDA), and whether the group times its own
    collectives (``group_timed``)."""

    __slots__ = ("device", "cuda", "kernel_average", "reduce_options", "sync_reduce_options",
                 "scatter_options", "gather_options", "launch_stream", "ready_events",
                 "group_timed")

    def __init__(self, group, device: torch.device, world_size: int):
        self.device = device
        self.cuda = device.type == "cuda"
        # NCCL averages inside the collective (ReduceOp.AVG), saving the division's pass
        # over the tensor. Only where 1/n is exact (n a power of two): x * (1/n) and x / n
        # are then the same number, so results stay those of dividing first, as DDP does.
        self.kernel_average = (self.cuda and "nccl" in str(dist.get_backend(group))
                               and world_size & (world_size - 1) == 0)
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
        self.group_timed = False

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

    def synchronous_options(self, req, completion):
        """The options of a whole all-reduce issued with ``asyncOp = False``: on NCCL it
        runs on the caller's current stream and no work comes back (None), as for a
        synchronous ``dist.all_reduce``; a backend that ignores the flag returns a work,
        completed as any other. The caller's stream first waits for the lane's newest
        asynchronous collective, once: the two streams' collectives then run in issue
        order, as every rank issues them."""
        newest = completion.newest.get(None)
        if newest is not None and newest is not completion.joined:
            newest.wait()
            completion.joined = newest
        return self.sync_reduce_options(req.reduce_op)
