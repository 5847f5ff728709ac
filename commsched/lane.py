"""Everything the scheduler does for one process group: a lane.

  submit ─► Lane.add ─► DispatchOrder (intake, order cursor, plan) ─► CreditWindow
                                 │ next chunk, credit to spare
                                 ▼
                          Issuer (streams, events, options) ─► async collective
                                 │
  request outcome ◄── Lane.settle ◄── Completion (in flight, thread, watchdog)

``lock`` guards the state of the lane and of its parts; dispatch happens under it, so the
dispatch sequence is totally ordered. Each part owns its state: the order its iterations
and plan, the window the bytes in flight and its limit, the issuer its streams and events,
the completion side what is in flight and its threads. The lane owns the requests not yet
resolved, the chunk being issued, and the failure. The thread that submits (autograd's in
backward, the training thread for Megatron) issues what the order and the credit allow,
itself ([Note: the hot path] in docs/design.md).
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .collectives import finish_chunk
from .completion import Completion, InFlight, Watchdog
from .errors import SchedulerError
from .issue import Issuer, RequestBook
from .observer import (ChunkRecord, Extension, Extensions, IterationRecord,
                       LaneInfo, as_extension)
from .order import DONE, DispatchOrder, Iteration
from .partition import Chunk
from .safety import all_reduce_max, step_crc, verify_sequences

__all__ = ["Lane", "CreditWindow", "release"]


class CreditWindow:
    """The credit window of a lane: the bytes in flight and the most allowed (``limit``, 0:
    unbounded). Credit is taken when a chunk is dispatched and given back when the device
    finished it; the limit is the config's, or what the tuner set for the iteration at the
    head of the order. A chunk larger than the window goes alone once nothing else is in
    flight."""

    __slots__ = ("limit", "in_flight", "peak")

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.peak = 0

    def admits(self, nbytes: int) -> bool:
        return not (self.limit and self.in_flight and self.in_flight + nbytes > self.limit)

    def take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        if self.in_flight > self.peak:
            self.peak = self.in_flight

    def give(self, nbytes: int) -> None:
        self.in_flight -= nbytes


class Lane:
    """One process group's dispatch order, credit, issue and completion (module docstring).
    ``extensions``: factories of what instruments it (observer, tuner, NVTX ranges)."""

    def __init__(self, group, device: torch.device, name: str, config, extensions=(),
                 observer: Optional[Extension] = None, trace_dispatch: bool = False,
                 feeds_forward: bool = False, timeout_s: float = 0.0):
        self.config = config
        self.group = group
        self.name = name
        self.device = device
        self.cuda = device.type == "cuda"
        # What tensor.get_device() returns for the lane's tensors (-1: CPU).
        self.device_index = (-1 if not self.cuda else device.index
                             if device.index is not None else torch.cuda.current_device())
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.trace_dispatch = trace_dispatch
        self.dispatch_log: List[tuple] = []
        self.topology = None                      # created on first use, every rank
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.failure: Optional[BaseException] = None
        self.book = RequestBook()                 # requests whose outcome is not set yet
        self.cur_chunk: Optional[Chunk] = None    # being issued, step by step
        self.cur_step = 0
        self.chunks_dispatched = self.bytes_dispatched = 0
        info = LaneInfo(name, self.rank, self.world_size, config, observer, self.exchange,
                        lambda: self.order.count)
        parts = self.parts = (([as_extension(observer)] if observer is not None else [])
                              + [make(info) for make in extensions])
        self.ext: Optional[Extension] = (parts[0] if len(parts) == 1
                                         else Extensions(parts) if parts else None)
        self.last_iteration: Optional[IterationRecord] = None
        self.credit = CreditWindow(config.credit_bytes)
        self.order = DispatchOrder(config.policy, config.profile_iters,
                                   feeds_forward and config.plan_forward, self._credit_for,
                                   self.cuda)
        # No per-step work beyond issuing it: the hot path applies (DispatchOrder.take_at_once).
        self.lean = not (trace_dispatch or config.verify or self.ext is not None)
        # Requests go whole, as one all-reduce each, unless a request asks otherwise.
        self.whole = self.lean and config.partition_bytes == 0 and config.decompose == "none"
        self.timed = self.ext is not None and self.ext.timed     # (steps get timing events)
        # CUDA, untimed, unbounded credit: steps issued at once go into completion batches
        # with no per-step work at all (Issuer.issue_batched).
        self.batched = self.cuda and self.lean and not config.credit_bytes
        self.completion = Completion(
            name, self.lock, device, credit=self.credit, settle=self.settle,
            polled=(self.cuda and not config.credit_bytes
                    and not (self.ext is not None and self.ext.tunes)),
            ordered=self.cuda)
        self.issuer = Issuer(group, device, self.world_size, self.completion, self.credit,
                             self.book, self.ext, self.timed)
        self.watchdog = Watchdog(self.completion, timeout_s, self._stalled,
                                 refresh_clock=self.timed)

    def _credit_for(self, index: int) -> int:
        settings = self.ext.settings_for(index) if self.ext is not None else None
        return self.config.credit_bytes if settings is None else settings.credit_bytes

    def submit_settings(self):
        """The settings of the iteration the next request joins (None: the config's)."""
        return self.ext.settings_for(self.order.open_index()) if self.ext else None

    # ---- submission (training thread) ----------------------------------------------------
    def add(self, req) -> None:
        """Take ``req`` in and issue what the order and the credit allow, from the caller's
        thread. The common case, ``req`` next in the order with credit to spare, is issued
        here, on the caller's stream, which orders the tensor's producers before it."""
        with self.lock:
            if self.failure is not None:
                raise self.failure
            if self.order.profiling:
                self.issuer.mark_ready_for_profile(req)
            if (self.lean and self.cur_chunk is None and len(req.chunks) == 1
                    and len(req.steps) == 1 and self.order.take_at_once(req, self.credit)):
                req.at_once = True
                chunk = req.chunks[0]
                self._admit(chunk)
                if self.batched:
                    self.issuer.issue_batched(req, chunk)
                else:
                    self.book.track(req)
                    self.issuer.issue(chunk, 0)
                if self.order.holds_for(self.order.current):
                    self._pump()                  # requests the plan held for this one
                dispatched = self.book.take_dispatched() if self.book.dispatched else None
            else:
                self.order.take_in(req, req.tensor.numel() * req.tensor.element_size(),
                                   self.name)
                self.book.track(req)
                self._pump()
                if req.chunks[-1].t_dispatch_ns == 0:
                    # Held back (order or credit): whoever issues it later, from whatever
                    # thread and stream, waits for this point of the caller's stream.
                    self.issuer.mark_ready(req)
                else:
                    req.at_once = req.chunks_issued == len(req.chunks)
                settled = self._collect()
                dispatched = False
        if dispatched is False:
            self._settle_requests(settled)
        elif dispatched:
            _settle_futures(dispatched)

    def _collect(self):
        """After a pump, lock held: requests to resolve, and to fail if the lane failed."""
        failed = self._take_failed_requests() if self.failure is not None else None
        return failed, self.book.take_dispatched()

    def _settle_requests(self, settled) -> None:
        """Lock released: resolve what was fully issued; on failure fail the rest, raise."""
        failed, dispatched = settled
        _settle_futures(dispatched)
        if failed is not None:
            _settle_futures(failed)
            raise self.failure

    def end_iteration(self, wait_dispatched: bool) -> Optional[IterationRecord]:
        with self.lock:
            mark = (self.issuer.flush_mark() if self.order.current is not None
                    else None)
            record = self.order.close(time.time_ns(), mark, self.name)
            if record is None:
                return None
            self.last_iteration = record
            self._pump()
            while wait_dispatched and record.iteration >= self.order.dispatched:
                if self.failure is not None:
                    break
                self.idle.wait()
            settled = self._collect()
        self._settle_requests(settled)
        if self.completion.polled:
            self.settle(None)
        if self.ext is not None:
            self.ext.on_iteration(record)
        return record

    # ---- dispatch (any thread, lock held) ------------------------------------------------
    def _pump(self) -> None:
        """Dispatch as far as the order, credit and step dependencies allow."""
        order, credit = self.order, self.credit
        while True:
            chunk = self.cur_chunk
            if chunk is None:
                it = order.head()
                if it is None:
                    self.idle.notify_all()
                    return
                if not it.resolved and not self._resolve_head(it):
                    return
                chunk = it.peek()
                if chunk is None:
                    return
                if chunk is DONE:
                    self._dispatched_iteration(it)
                    continue
                if not credit.admits(chunk.nbytes):
                    self.completion.ring()        # dispatch waits for a completion
                    return
                it.advance()
                self._admit(chunk)
                self.cur_chunk, self.cur_step = chunk, 0
            step = self.cur_step
            if step and not self.cuda and chunk.steps_done < step:
                self.completion.ring()            # dispatch waits for a completion
                return
            nsteps = len(chunk.request.steps)     # (read first: _issue may release it)
            self._issue(chunk, step)
            self.cur_step = step + 1
            if self.cur_step == nsteps:
                self.cur_chunk = None

    def _resolve_head(self, it: Iteration) -> bool:
        """``it`` reached the head of the order: what every rank does there, in the same
        place of its collective sequence (verification, the tuner, a new plan), then the
        plan in force. False where that failed the lane."""
        order = self.order
        if order.verify_queue:
            checked, order.verify_queue = order.verify_queue, []
            error = verify_sequences(checked, self.group, self.device, self.world_size,
                                     self.ranks, self.name, self.config.timeout_s)
            if error is not None:
                self._fail(error)
                return False
        if self.ext is not None:
            self.ext.at_head(it)
            self.credit.limit = self._credit_for(it.index)
        if it.profile is not None:
            try:
                plan = order.build_plan(it.profile, self.credit.limit, lambda values: (
                    all_reduce_max(values, torch.float64, self.group, self.device,
                                   self.issuer.launch_stream, self.config.timeout_s)))
            except Exception as exc:  # noqa: BLE001 (a peer gone: fail the lane, naming it)
                self._fail(SchedulerError(
                    f"commsched: the plan exchange at the head of iteration {it.index} on "
                    f"lane {self.name} (ranks {list(self.ranks)}) failed: {exc}"))
                return False
            if self.trace_dispatch:
                self.dispatch_log.append(("plan", plan.order))
        it.plan, it.resolved = order.plan, True
        return True

    def _dispatched_iteration(self, it: Iteration) -> None:
        self.order.pop_head(it, self.config.verify, self.ext is None)
        if self.ext is not None:
            self.ext.dispatched(it)
        if self.completion.polled:
            self.completion.close_newest()    # the caller completes it, later
        else:
            self.completion.ring()            # complete the iteration's chunks
        self.idle.notify_all()

    def _admit(self, chunk: Chunk) -> None:
        """``chunk`` takes its credit and is counted as dispatched (lock held)."""
        self.credit.take(chunk.nbytes)
        self.chunks_dispatched += 1
        self.bytes_dispatched += chunk.nbytes

    def _issue(self, chunk: Chunk, step: int) -> None:
        req = chunk.request
        if self.trace_dispatch:
            self.dispatch_log.append((req.iteration, req.key, chunk.index, step))
        if self.config.verify and not req.steps[step].endswith(":leaders"):
            # (the step among node leaders is the one step other ranks do not take)
            it = self.order.head()
            it.crc = step_crc(it.crc, req.key, chunk.index, step)
            it.sequence.append((req.iteration, repr(req.key), chunk.index, req.steps[step]))
        self.issuer.issue(chunk, step)

    # ---- settling what completed (completion thread, or a polled lane's caller) ---------
    def settle(self, waited: Optional[InFlight]) -> None:
        """Settle ``waited`` and what finished with it (completion thread), or, with
        ``waited`` None, what the device finished of what the caller must complete (polled:
        the caller's thread, at its end of iteration): their credit comes back, their
        requests' outcomes are set, dispatch goes on."""
        completion = self.completion
        t_seen = time.time_ns()
        records: list = []
        finished: list = []
        released: List[Chunk] = []
        failed: list = []
        with self.lock:
            taken = completion.take(waited, t_seen)
            if taken is None:
                return
            batch, times = taken
            keep = self.ext is not None and self.ext.wants_records()
            for item, (t_start, t_end) in zip(batch, times):
                if item.chunk is None:        # a batch of steps (CUDA, see Completion.batch)
                    self._settle_batch(item)
                elif self._settle_step(item, t_start, t_end, finished, released) and keep:
                    records.append((item.chunk, item.step, item.error,
                                    t_start if t_start is not None
                                    else item.chunk.t_dispatch_ns, t_end))
            if self.failure is None:
                self._pump()
            self.idle.notify_all()            # (join() waits for completions)
            if self.failure is not None:
                failed = self._take_failed_requests()
            dispatched = self.book.take_dispatched()
        _settle_futures(dispatched)
        if records:
            self.ext.on_chunks([chunk_record(self, *record) for record in records])
        release(released)
        completion.recycle(batch)
        _settle_futures(finished)
        _settle_futures(failed)

    def _settle_step(self, item: InFlight, t_start, t_end, finished: list,
                     released: List[Chunk]) -> bool:
        """One step completed (lock held): its link time, and on the chunk's last step its
        credit, its request's count and (CPU) outcome; a failed step fails its request
        and the lane. True (always): the step is recorded where records are wanted."""
        chunk, step, error = item.chunk, item.step, item.error
        req = chunk.request
        chunk.steps_done = step + 1
        last = step == len(req.steps) - 1
        if error is not None:
            error = SchedulerError(
                f"commsched: {req.steps[step]} of chunk {chunk.index}/{len(req.chunks)} of "
                f"request {req.key!r} ({chunk.nbytes} bytes, lane {self.name}, ranks "
                f"{list(self.ranks)}, iteration {req.iteration}) failed: {error}")
            item.error = error
            self._fail(error)
            if req.outcome is None:
                req.outcome = error
                finished.append(req)
            return True
        self.order.link_cost.add(t_start if t_start is not None else chunk.t_dispatch_ns,
                                 t_end, chunk.nbytes if last else 0)
        if last:
            if not self.cuda:
                finish_chunk(chunk)
            chunk.staging = None          # kept alive until the device finished with it
            # A work can own buffers until it is destroyed (NCCL's flat output of a
            # list-form all-gather), and a request and its chunks reference each other:
            # kept here, it would live until the cycle collector ran.
            chunk.works = None
            released.append(chunk)
            self.credit.give(chunk.nbytes)
            req.remaining -= 1
            if req.remaining == 0 and not self.cuda:
                self.book.finished(req)
                finished.append(req)
        return True

    def _settle_batch(self, item: InFlight) -> None:
        """A batch completed (lock held): its credit back; a failed collective fails the
        lane. (Its link time is unknown: one event after the last of its steps.)"""
        if item.error is not None:
            self._fail(SchedulerError(
                f"commsched: one of {item.describe()} on lane {self.name} (ranks "
                f"{list(self.ranks)}) failed: {item.error}"))
        self.credit.give(item.nbytes)

    def _stalled(self, item: InFlight) -> None:
        """The watchdog: ``item`` did not complete within the timeout."""
        with self.lock:
            if self.failure is not None or self.completion.waiting_item is not item:
                return
            self._fail(SchedulerError(
                f"commsched: {item.describe()} on lane {self.name} (ranks "
                f"{list(self.ranks)}) did not complete within "
                f"{self.watchdog.timeout_s:.0f} s (COMMSCHED_TIMEOUT_S); a peer may have "
                f"died or the ranks issued different collectives"))
            failed = self._take_failed_requests()
        chunk = item.chunk
        if self.ext is not None and chunk is not None:
            self.ext.on_chunks([chunk_record(self, chunk, item.step, self.failure,
                                             chunk.t_dispatch_ns, time.time_ns())])
        _settle_futures(failed)

    # ---- failure and request outcomes -------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        """Record the lane's failure (lock held); see ``_take_failed_requests``."""
        if self.failure is None:
            self.failure = self.completion.failure = error
        self.idle.notify_all()

    def _take_failed_requests(self) -> list:
        """Fail every request not resolved yet (lock held); their futures are failed
        outside the lock."""
        error = self.failure
        return self.book.fail_pending(
            error if isinstance(error, SchedulerError) else SchedulerError(str(error)))

    # ---- the caller's other calls ---------------------------------------------------------
    def exchange(self, values, what: str) -> List[int]:
        """One all_reduce(MAX) of int64 ``values`` over the group, in its collective
        sequence (the tuner's; lock held, at the head of the order)."""
        out = all_reduce_max(values, torch.int64, self.group, self.device,
                             self.issuer.launch_stream, self.config.timeout_s)
        if self.trace_dispatch:
            self.dispatch_log.append(("autotune", what))
        return out

    def awaited(self, req) -> None:
        """Somebody blocks on ``req``'s future (CPU): complete it as soon as it is issued."""
        with self.lock:
            req.waited = True
            if req.chunks_issued == len(req.chunks):
                self.completion.ring()

    def join(self) -> None:
        """The caller waits for every collective issued on the lane so far: on CUDA its
        current stream does, on the device (the host does not); on CPU the host does,
        until the completion thread completed them (their futures resolved), and the later
        steps of a decomposed chunk that they release (issued as each completes)."""
        completion = self.completion
        with self.lock:
            while not self.cuda and ((completion.pending() or self.cur_chunk is not None)
                                     and self.failure is None):
                completion.ring()
                self.idle.wait()
            if self.failure is not None and not self.cuda:
                raise self.failure
            waits = list(completion.newest.values()) if self.cuda else ()
        for work in waits:
            work.wait()

    def drain(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            self.completion.ring()
            while (self.order.iterations or self.credit.in_flight) and self.failure is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SchedulerError(f"lane {self.name}: drain timed out after {timeout}s")
                self.idle.wait(left)
            if self.failure is not None:
                raise self.failure
        if self.ext is not None:
            self.ext.drained()

    def close(self) -> None:
        self.completion.close(self.failure is not None)   # (completes what was issued)
        self.watchdog.join()


def chunk_record(lane: Lane, chunk: Chunk, step: int, error, t_start: int,
                 t_end: int) -> ChunkRecord:
    """What an extension is told of one completed step of ``lane``."""
    req = chunk.request
    name = req.steps[step]
    # A step on a topology sub-group ("op:role") ran among that sub-group's ranks.
    ranks = lane.ranks if ":" not in name else lane.topology.members[name.split(":")[1]]
    return ChunkRecord(
        lane.name, req.iteration, str(req.key), req.op, name, req.decompose,
        chunk.index, len(req.chunks), chunk.nbytes,
        str(req.tensor.dtype).replace("torch.", ""), ranks, req.priority,
        req.t_submit_ns, chunk.t_dispatch_ns, t_start, t_end, error is None,
        "" if error is None else repr(error))


def release(chunks: List[Chunk]) -> None:
    """Chunks the lane is done with let go of their request: a request and its chunks
    reference each other, and a cycle left in place would be freed by Python's cycle
    collector only ([Note: no cycles on the hot path] in docs/design.md). Once a chunk's
    last step went into a completion batch or completed, nothing reads ``chunk.request``
    again; ``request.chunks`` stays."""
    for chunk in chunks:
        chunk.request = None


def _settle_futures(requests: list) -> None:
    """Resolve each request's future, where one was made, as its outcome says (outside the
    lock: a future's callbacks may submit). On CUDA the futures carry no stream:
    ``Request.wait()`` and ``join()`` order the caller's stream after the collectives."""
    for req in requests:
        if req._future is not None:
            req.settle_future()
