"""The priority/credit scheduler.

  submit(request) ─► partition into chunks ─► lane of the request's process group
                                                │  dispatch order: fifo, or a priority plan
                                                ▼
                     credit gate (bytes in flight) ─► async collective (torch.distributed)
                                                │
  request future ◄── all chunks done ◄── completion thread: device completion, credit back

Invariant 1 (same collective sequence on every rank, per process group) is kept this way:
a lane dispatches chunks in an order that is a pure function of (a) the sequence of requests
submitted to it — adapters submit the same requests in the same order on every rank, e.g.
DDP buckets strictly by index — and (b) the lane's plan, itself built from rank-invariant
inputs at an iteration boundary (see plan.py). Timing only decides *when* the next chunk
in that order goes (head-of-line: it waits for its request, for credit, and on backends
without stream ordering for its previous step), never *which* chunk goes next.
Per iteration the order is: the plan's chunks whose request was submitted with the planned
chunk count, in plan order, then every other request's chunks in submission order. Without a
plan (policy fifo, or warm-up) it is submission order.

With ``Config.autotune`` (autotune.py) a lane's partition size, credit window and
decomposition may change during a run. The tuner's state changes only where every rank
passes in the same order (an iteration fully dispatched, an iteration at the head of the
order), its cross-rank exchanges sit there in the collective sequence like the plan's, and a
new setting applies from an iteration index agreed in that exchange, before any rank began it.

Adapter contract: under a priority plan a lane may hold submitted chunks back until a
planned request of the same iteration is submitted. An adapter must therefore not block on
a request while requests of that iteration are still to come on the same lane; it ends the
iteration first (``end_iteration``), or uses another process group (lane) for the requests
it waits on mid-iteration (the data-parallel mode does this for its all-gathers).

The hot path. The thread that submits (autograd's in backward, the training thread for
Megatron) issues what the order and the credit allow, itself, under the lane's lock: in the
common case, the request it submits, at once, from its current stream, which orders the
tensor's producers before the collective, exactly as a plain ``dist.all_reduce`` would.
Nothing else happens per request on that path: no other thread, no stream switch, no CUDA
event, no CUDA future (the request's future is a CPU future set at issue on CUDA; a gloo
request of one collective follows that collective's own future). A request the order or the
credit window holds back records a ready event in the submitter's stream and is issued
later, from the launch stream after that event, by the next submission, the end of the
iteration, or the completion thread when credit comes back. A request submitted with
``async_op=False`` (its caller waits at once) and issued on that path in a lane that
completes batches goes as a synchronous collective: on NCCL in the caller's stream, after
the lane's newest asynchronous collective, with nothing left for the lane to complete
(``_Lane._synchronous_options``).

Invariant 2 (completion means device completion): credit is returned, and gloo futures
are resolved, by a completion thread per lane (completion.py) that blocks (GIL released) in
``work.wait()`` (gloo) or ``Event.synchronize()`` on an event recorded on the done stream
after the collectives (CUDA), never when a collective was merely enqueued. Consumers order
themselves after the collectives on the device: ``Request.wait()`` or ``Scheduler.join()``
make the current stream wait for them.

Completion hand-off. Waking the completion thread costs a GIL hand-off each way, more than
issuing a collective, so it is woken only for what somebody waits on: a step whose credit,
gloo future or gloo next step is needed, or whose padded copy should be freed ("urgent"),
the end of a dispatched iteration, ``drain()``, or ``LAZY_ITEMS`` unfinished steps. On CUDA
with an unbounded credit window (and no tuner) nothing is urgent and it is not woken at all
in steady state (``polled``): an iteration's untimed steps go into one batch, closed at the
end of the iteration, and the caller's next ``end_iteration`` completes the batches whose
newest collective reports completion (``Work.is_completed()``, a query of the process
group's own event; NCCL runs a group's collectives in issue order). No event or stream of
the lane's is involved: a wait of the done stream on the collective, under one hardware
queue (CUDA_DEVICE_MAX_CONNECTIONS=1), would hold up whatever is queued behind it. A
thread woken as the device finishes would take the GIL when the training thread is
busiest, at the start of the next step. The watchdog hands the completion thread whatever
stays in flight longer than its period (a caller that stopped ending iterations); only
then does a batch get an event after it ("sealed"), for that thread to wait on, by looking
at it at growing intervals (a polled lane's events are not blocking-sync ones, whose
completions the driver services on a thread of its own). Every end event is timed: a step
completed after it finished gets its host-clock end from its event. With telemetry (or
the tuner) on, each step gets a timing event of its own before it, and, under a credit
window, after it (see _issue_cuda).

Dispatch thread (``Config.dispatch="thread"``, off by default): ``submit`` records the ready
event and queues the request, and a thread per lane issues it. It costs a GIL hand-off per
request and issues later than inline; it is kept for callers whose own thread must not pay
for issuing. ``end_iteration`` queues the iteration's end and returns once the dispatch
thread took it in, so every iteration reaches the lane in the caller's order relative to
the caller's own calls. Safe only where the caller issues no collective of its own on the
group meanwhile.

Who owns what. A lane's state is split along what it does, each piece with one owner, all
under the lane's one lock (bar the dispatch thread's queue): the lane (``_Lane``) owns the
dispatch order (its iterations, the plan in force, the chunk being issued), the credit
(bytes in flight), the requests not yet resolved and the lane's failure; it issues steps
(``_issue``, ``add``, ``_issue_cuda``) and settles completed ones
(``_complete``). Each ``_Iteration`` owns its requests and dispatch cursor; the
``_Completion`` (completion.py) what was issued and not completed yet, the done stream,
the CUDA events and clock that time it, and the completion thread; the
``_DispatchThread`` its inbox and thread; the ``_Watchdog`` its period and thread.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import math
import threading
import time
import weakref
from typing import Dict, Hashable, List, Optional

import torch
import torch.distributed as dist

from .collectives import (OptionsByOp, all_gather_options, all_reduce_options, finish_chunk,
                          issue_step, parts_for, reduce_scatter_options, steps_for)
from .completion import _Completion, _InFlight
from .config import DECOMPOSITIONS, Config
from .errors import CommschedError
from .observer import ChunkRecord, DeviceMark, IterationRecord
from .partition import Chunk, partition
from .plan import LinkCost, Plan, RequestProfile, lane_plan
from .safety import check_agreement, first_divergence, step_crc
from .topology import Topology, local_size_from_env
from .telemetry.device_clock import EventClock
from .telemetry.nvtx_ranges import nvtx_range_pop, nvtx_range_push
from .threads import start_thread
from .workers import keep_past_exit, retain

__all__ = ["Scheduler", "Request", "SchedulerError"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")
_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG
_ALL_REDUCE = steps_for("all_reduce", "none")
# Whole reduce-scatters and all-gathers (Megatron's bucket groups): steps by op
_SHARDED_STEPS = {op: steps_for(op, "none") for op in ("reduce_scatter", "all_gather")}


class SchedulerError(CommschedError, RuntimeError):
    """A request could not be scheduled, or a collective it ran failed."""


class Request:
    """A flat tensor handed to the scheduler.

    ``future`` resolves to the tensor: on CPU once every chunk finished, on CUDA once every
    chunk was issued (a plain CPU future: it carries no stream); it is created when first
    asked for, ``done()`` tells the same without one. ``wait()`` is what orders the caller
    after the collectives: on CUDA the current stream waits for them on the device, the
    host does not. ``issue_seq`` numbers the lane's requests in the order their last
    collective was issued (None until then); NCCL runs a lane's collectives in that
    order."""

    __slots__ = (
        "key", "tensor", "op", "group", "world_size", "rank", "priority", "reduce_op",
        "decompose", "steps", "_future", "outcome", "chunks", "remaining", "iteration",
        "t_submit_ns",
        "ready_event", "lane", "reduce_options", "chunks_issued", "done_work", "done_event",
        "cross_group", "issue_seq", "waited", "at_once", "synchronous",
    )

    def __init__(self, key: Hashable, tensor: torch.Tensor, op: str, lane: "_Lane",
                 priority: int, reduce_op, decompose: str, steps, cross_group: bool):
        self.key = key
        self.tensor = tensor
        self.op = op
        self.lane = lane
        self.group = lane.group
        self.world_size = lane.world_size
        self.rank = lane.rank
        self.priority = priority
        self.reduce_op = reduce_op
        self.reduce_options = lane.reduce_options(reduce_op)
        self.decompose = decompose
        self.steps = steps
        self.cross_group = cross_group
        self._future = None
        # None while pending, True once resolved, else the error it failed with; set
        # under the lane's lock (the future may be created from another thread).
        self.outcome = None
        self.chunks: List[Chunk] = []
        self.remaining = 0
        self.chunks_issued = 0
        self.iteration = -1
        self.t_submit_ns = time.time_ns()
        # Set only where the request was not issued by the thread that submitted it, at
        # once: the point in the submitter's stream where the tensor was ready.
        self.ready_event = None
        # What the request ends with: its last collective (NCCL runs a group's collectives
        # in issue order), or, for a padded chunk copied back, an event after that copy.
        self.done_work = None
        self.done_event = None
        self.issue_seq = None
        self.waited = False           # CPU: somebody waits for the future (see _urgent)
        self.at_once = False          # CUDA: every step issued from the submitter's stream
        # submit(async_op=False): issued at once, the collective runs on the caller's
        # stream (see _Lane.add)
        self.synchronous = False

    @property
    def future(self) -> torch.futures.Future:
        future = self._future
        if future is None:
            with self.lane.lock:
                future = self._future
                if future is None:
                    future = self._future = torch.futures.Future()
                    if self.outcome is not None:
                        _settle_outcome(self)
        return future

    def done(self) -> bool:
        """Whether the future resolved (or would have): see the class docstring."""
        return self.outcome is not None

    def wait(self) -> torch.Tensor:
        """The tensor, once it may be read: on CPU when every chunk finished; on CUDA the
        current stream waits for the collectives on the device (the host does not)."""
        outcome = self.outcome
        if outcome is None:
            self.lane.awaited(self)
            tensor = self.future.wait()
        elif outcome is not True:
            raise outcome
        else:
            tensor = self.tensor
        if self.done_event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(self.done_event)
        elif self.done_work is not None:
            self.done_work.wait()
        return tensor

    def issued_work(self):
        """CUDA: the work of the collective that completes this request, where it was
        issued from the submitter's stream when submitted (the hot path) and nothing
        follows it (a padded chunk's copy back); else None. Its ``get_future()`` is a CUDA
        future that orders a waiting stream after the request on the device."""
        if (self.outcome is not True or self.done_event is not None
                or not self.at_once or self.done_work is None):
            return None
        return self.done_work

    def finished(self) -> bool:
        """Whether every chunk finished on the device, not only was issued; never blocks.
        (A request issued as a synchronous collective, see ``submit(async_op=False)``: once
        issued; the caller's stream orders it.)"""
        if self.outcome is not True:
            return False
        if self.done_event is not None:
            return self.done_event.query()
        return self.done_work is None or self.done_work.is_completed()

    def __repr__(self) -> str:
        return (f"Request({self.key!r}, op={self.op}, numel={self.tensor.numel()}, "
                f"chunks={len(self.chunks)}, priority={self.priority})")


class _Iteration:
    """One lane iteration: the requests submitted between two end_iteration() calls, and
    the dispatch cursor over them (it owns the cursor: ``peek``; the lane moves it)."""

    __slots__ = ("index", "requests", "by_key", "chunks", "nbytes", "flushed", "plan",
                 "profile", "resolved", "planned", "plan_pos", "req_pos", "chunk_pos",
                 "t_first_ns", "crc", "sequence")

    def __init__(self, index: int, profile: Optional[List[RequestProfile]], planned: bool):
        self.index = index
        self.requests: List[Request] = []
        self.by_key: Dict[Hashable, Request] = {}
        self.chunks = 0               # of the requests so far, and their tensors' bytes
        self.nbytes = 0
        self.flushed = False
        # The plan is resolved when the iteration reaches the head of the dispatch order:
        # only then is it certain, on every rank alike, which plan is in force.
        self.plan: Optional[Plan] = None
        self.profile = profile        # set: build a new plan from it first
        self.resolved = False
        self.planned = planned
        self.plan_pos = 0
        self.req_pos = 0
        self.chunk_pos = 0
        self.t_first_ns = 0
        self.crc = 0                  # COMMSCHED_VERIFY: digest of the dispatch sequence
        self.sequence: List[tuple] = []

    def peek(self):
        """The chunk the order issues next (the cursor does not move past it), None while
        it waits for a request not submitted yet, ``_DONE`` once everything of the ended
        iteration was taken: the plan's chunks whose request came with the planned chunk
        count, in plan order, then every other request's chunks in submission order."""
        plan = self.plan
        if plan is not None:
            order = plan.order
            while self.plan_pos < len(order):
                key, index = order[self.plan_pos]
                req = self.by_key.get(key)
                if req is not None and plan.layout.get(key) == len(req.chunks):
                    return req.chunks[index]
                if req is None and not self.flushed:
                    return None               # head of line: wait for this request
                self.plan_pos += 1            # not in this iteration, or not as planned
        requests = self.requests
        while self.req_pos < len(requests):
            req = requests[self.req_pos]
            if self.chunk_pos < len(req.chunks) and not (
                    plan is not None and plan.layout.get(req.key) == len(req.chunks)):
                return req.chunks[self.chunk_pos]
            self.req_pos += 1
            self.chunk_pos = 0
        return _DONE if self.flushed else None

    def add(self, req: Request, nbytes: int) -> None:
        """``req``, of ``nbytes`` tensor bytes, joins the iteration."""
        req.iteration = self.index
        self.requests.append(req)
        self.by_key[req.key] = req
        self.chunks += len(req.chunks)
        self.nbytes += nbytes


_DONE = object()


class _End:
    """An end_iteration() call queued for the dispatch thread."""

    __slots__ = ("t_end_ns", "mark", "record", "taken")

    def __init__(self, t_end_ns: int, mark: Optional[DeviceMark]):
        self.t_end_ns = t_end_ns
        self.mark = mark
        self.record: Optional[IterationRecord] = None
        self.taken = threading.Event()


class _DispatchThread:
    """``Config.dispatch="thread"``: a thread per lane issues what the caller submits.
    Submitted requests and iteration ends wait in the inbox, in call order; the caller
    keeps the keys of its open iteration to reject a duplicate at once. Owns the inbox and
    the thread; everything else is the lane's, under the lane's lock."""

    __slots__ = ("lane", "items", "lock", "ready", "closed", "caller_keys", "thread")

    def __init__(self, lane: "_Lane"):
        self.lane = lane
        self.items: "collections.deque" = collections.deque()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.closed = False
        self.caller_keys: set = set()
        self.thread = start_thread(self._loop, f"commsched-{lane.name}-dispatch",
                                   f"cs-{lane.name}-dispatch")

    def post(self, req: Request) -> None:
        """Queue ``req`` (caller's thread: a few microseconds)."""
        lane = self.lane
        if lane.failure is not None:
            raise lane.failure
        if req.key in self.caller_keys:
            raise SchedulerError(
                f"request key {req.key!r} submitted twice in one iteration of lane "
                f"{lane.name}; call end_iteration() between iterations")
        self.caller_keys.add(req.key)
        self._enqueue(req)

    def _enqueue(self, item) -> None:
        with self.ready:
            if self.closed:
                raise SchedulerError(f"lane {self.lane.name} is closed")
            self.items.append(item)
            self.ready.notify()

    def post_end(self, wait_dispatched: bool, wait_taken: bool) -> Optional[IterationRecord]:
        """Queue the end of the open iteration and wait until the thread took it in:
        requests and their iteration then reach the lane in the same order, relative to
        the caller's own calls, as inline (a plan exchange of the next iteration cannot
        come after a collective the caller issues once its iteration ended). The thread
        takes it in once it dispatched what was queued before it, so the wait lasts as
        long as issuing those collectives; ``wait_taken=False`` skips it (and returns no
        record)."""
        lane = self.lane
        if not self.caller_keys:
            return None
        if lane.failure is not None:
            raise lane.failure
        self.caller_keys = set()
        end = _End(time.time_ns(), lane._flush_mark())
        self._enqueue(end)
        if not wait_taken and not wait_dispatched:
            return None
        end.taken.wait()
        record = end.record
        with lane.lock:
            while (wait_dispatched and record is not None and lane.failure is None
                   and record.iteration >= lane.dispatched_iterations):
                lane.idle.wait()
            if lane.failure is not None:
                raise lane.failure
        return record

    def close(self) -> None:
        """Take in and dispatch what was queued, then end the thread."""
        with self.ready:
            self.closed = True
            self.ready.notify()
        self.thread.join(timeout=1 if self.lane.failure is not None else 10)

    def _loop(self) -> None:
        if self.lane.cuda:
            torch.cuda.set_device(self.lane.device)
        while True:
            with self.ready:
                while not self.items:
                    if self.closed:
                        return
                    self.ready.wait()
            self._take()

    def _take(self) -> None:
        """Take in everything queued, in order, and dispatch as far as possible. A failure
        fails the lane: its requests' futures and the caller's next call raise it."""
        lane = self.lane
        ends = []
        failed = []
        with lane.lock:
            with self.lock:
                items = list(self.items)
                self.items.clear()
            try:
                for item in items:
                    if lane.failure is not None:
                        if type(item) is not _End:
                            failed.append(item)
                    elif type(item) is _End:
                        item.record = lane._close_iteration(item.t_end_ns, item.mark)
                        ends.append(item)
                    else:
                        lane._take_in(item)
                if lane.failure is None:
                    lane._pump()
            except BaseException as error:  # noqa: BLE001 (surfaces in the caller's thread)
                lane._fail(error)
            taken_failed, dispatched = lane._collect()
            failed += taken_failed or []
        try:
            lane._resolve(dispatched)
            if failed:
                lane._fail_futures(failed)
            for end in ends:
                if end.record is not None:
                    lane._report(end.record)
        except BaseException as error:  # noqa: BLE001 (an observer's, say: fail the lane)
            with lane.lock:
                lane._fail(error)
        finally:
            for item in items:
                if type(item) is _End:
                    item.taken.set()


class _Watchdog:
    """A thread per lane that turns a collective that never completes (a dead peer,
    mismatched collectives) into an error on this rank, naming what it was waiting for;
    and hands the completion thread what a lane whose caller completes (``polled``) left
    in flight longer than its period (the caller stopped ending iterations: the end of
    training, an evaluation), which the completion thread then frees and this thread
    times; and, where the caller completes (``polled``) timed steps, renews the anchor of
    the event clock of the lane's completion side, so that mapping their end events onto
    the host clock never waits on the caller's thread. Owns its period and thread; reads
    the state of the lane and of its completion side under the lane's lock."""

    __slots__ = ("lane", "period", "thread")

    def __init__(self, lane: "_Lane"):
        self.lane = lane
        polled = lane.completion.polled
        self.period = min(max(lane.timeout_s / 10.0, 0.05), 5.0,
                          EventClock.REFRESH_S if polled and lane.timed else math.inf)
        self.thread = start_thread(self._run, f"commsched-{lane.name}-watchdog",
                                   f"cs-{lane.name}-watchdog")

    def _run(self) -> None:
        lane = self.lane
        completion = lane.completion
        while not lane.stopping.wait(self.period):
            clock = completion.clock if completion.polled else None
            if clock is not None:
                try:
                    clock.refresh()           # (not under the lock: it waits for the device)
                except RuntimeError:
                    pass                      # a failing device: the wait below reports it
            with lane.lock:
                if lane.failure is not None:
                    return
                # Only a wait can stall: unfinished chunks nobody waits for yet are not late.
                item = completion.waiting_item
                if item is None:
                    self._hand_over_stale()
                    continue
                if time.monotonic() - completion.waiting_since <= lane.timeout_s:
                    continue
                lane._fail(SchedulerError(
                    f"commsched: {item.describe()} on lane {lane.name} (ranks "
                    f"{list(lane.ranks)}) did not complete within {lane.timeout_s:.0f} s "
                    f"(COMMSCHED_TIMEOUT_S); a peer may have died or the ranks issued "
                    f"different collectives"))
                failed = lane._take_failed_requests()
            chunk = item.chunk
            if lane.observer is not None and chunk is not None:
                lane.observer.on_chunks([lane._record(chunk, item.step, lane.failure,
                                                      chunk.t_dispatch_ns, time.time_ns())])
            lane._fail_futures(failed)
            return

    def _hand_over_stale(self) -> None:
        """Ring the completion thread for what a polled lane issued over a period ago
        (lane's lock held)."""
        completion = self.lane.completion
        in_flight = completion.in_flight
        if not (completion.polled and in_flight
                and completion.must_complete < completion.head_seq):
            return
        head = in_flight[0]
        issued = head.t_first_ns if head.chunk is None else head.chunk.t_dispatch_ns
        if time.time_ns() - issued > self.period * 1e9:
            completion.ring()


class _Lane:
    """Everything the scheduler does for one process group. ``lock`` guards all mutable
    state, the lane's and its parts' (its iterations, ``completion``, ``watchdog``;
    ``inbox`` guards its queue itself); dispatch happens under it, so the dispatch sequence
    is totally ordered. The lane owns the dispatch order, the credit, the requests and the
    failure; it issues steps and settles the ones its completion side hands back."""

    def __init__(self, scheduler: "Scheduler", group, device: torch.device, name: str,
                 config: Config, threaded: bool = False):
        self.config = config
        self.observer = scheduler.observer
        self.trace_dispatch = scheduler.trace_dispatch
        self.verify = config.verify
        self.nvtx = config.nvtx
        self.group = group
        self.name = name
        self.device = device
        # What tensor.get_device() returns for the lane's tensors (-1: CPU).
        self.device_index = (-1 if device.type != "cuda" else device.index
                             if device.index is not None else torch.cuda.current_device())
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.cuda = device.type == "cuda"
        # NCCL runs a group's collectives in issue order on one stream: the all-gather of a
        # chunk may be issued right behind its reduce-scatter. Gloo runs them on a thread
        # pool, so a dependent step must wait for the previous one to finish.
        self.stream_ordered = self.cuda
        # NCCL averages inside the collective (ReduceOp.AVG), saving the division's pass
        # over the tensor. Only where 1/n is exact (n a power of two): x * (1/n) and x / n
        # are then the same number, so results stay those of dividing first, as DDP does.
        self.kernel_average = (self.cuda and "nccl" in str(dist.get_backend(group))
                               and self.world_size & (self.world_size - 1) == 0)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.iterations: "collections.deque[_Iteration]" = collections.deque()
        self.current: Optional[_Iteration] = None
        self.iteration_count = 0
        self.dispatched_iterations = 0            # iterations whose every step was issued
        self.in_flight_bytes = 0
        self.cur_chunk: Optional[Chunk] = None
        self.cur_step = 0
        self.plan: Optional[Plan] = None          # in force at the head of the order
        self.planned_layout = None                # what the newest decided plan is for
        self.next_profile: Optional[List[RequestProfile]] = None
        self.last_layout = None
        self.stable_iters = 0
        self.link_cost = LinkCost()               # the plan's cost per byte
        self.feeds_forward = scheduler.feeds_forward and config.plan_forward
        self.failure: Optional[BaseException] = None
        self.dispatch_log: List[tuple] = []
        self.chunks_dispatched = 0
        self.requests_issued = 0                  # requests whose last collective was issued
        self.bytes_dispatched = 0
        self.peak_in_flight_bytes = 0
        self.last_iteration: Optional[IterationRecord] = None
        # Collective options per reduction, built once per lane rather than per request:
        # reduce_options(op), sync_reduce_options(op) (asyncOp = False),
        # scatter_options(op) (whole reduce-scatters), gather_options.
        self.reduce_options = OptionsByOp(all_reduce_options).get
        self.sync_reduce_options = OptionsByOp(
            lambda reduce_op: all_reduce_options(reduce_op, async_op=False)).get
        self.scatter_options = OptionsByOp(reduce_scatter_options).get
        self.gather_options = all_gather_options()
        self.outstanding: Dict[int, Request] = {}     # submitted, future not yet resolved
        self.verify_queue: List[tuple] = []           # (iteration, crc, sequence) to check
        self.timeout_s = self.config.timeout_s or _group_timeout(group, device)
        self.stopping = threading.Event()
        self.topology: Optional[Topology] = None      # created on first use, every rank
        # Ready events, recorded by submit() and free again once the request's first steps
        # were issued (a stream's wait on an event takes the event as recorded at the time
        # of the wait): no event is created and destroyed per request.
        self.ready_events: "collections.deque" = collections.deque()
        # --- autotune (autotune.py): the credit window of the iteration at the head of the
        # order (the config's unless tuned); rank 0 keeps chunk records while `collecting`.
        self.credit_bytes = self.config.credit_bytes
        self.collecting = False
        self.tuner = None
        if self.config.autotune:
            from .autotune import Tuner       # (the tuner and its simulator load on demand)

            self.tuner = Tuner(self)
        # No per-step work beyond issuing it: the hot path applies (_take_at_once).
        self.lean = not (self.trace_dispatch or self.verify or self.nvtx or self.tuner)
        # Requests go whole, as one all-reduce each, unless a request asks otherwise.
        self.whole = (self.lean and config.partition_bytes == 0
                      and config.decompose == "none")
        # --- end autotune
        # CUDA events are timed when telemetry or the tuner needs device durations.
        self.timed = self.observer is not None or self.tuner is not None
        # CUDA, untimed, unbounded credit: steps issued at once go into completion batches
        # with no per-step work at all (add, _issued_direct).
        self.batched = (self.cuda and self.lean and not self.timed
                        and not self.config.credit_bytes)
        # What was issued and not completed yet, and the thread that completes it; whether
        # the caller completes instead (``polled``) is decided there.
        self.completion = _Completion(self)
        if self.cuda:
            self.launch_stream = torch.cuda.Stream(device)
        # Telemetry where the caller completes: the group times its own collectives, and
        # a step needs no event after it (_issue_cuda, _Completion.device_times).
        self.group_timed = (self.cuda and self.completion.polled
                            and self.observer is not None
                            and _enable_collective_timing(group))
        self.dispatched: List[Request] = []          # CUDA: fully issued, future not yet set
        # Config.dispatch="thread": a thread issues what the caller submits (_DispatchThread)
        self.inbox: Optional[_DispatchThread] = _DispatchThread(self) if threaded else None
        self.watchdog = _Watchdog(self)

    # ---- submission (training thread) ----------------------------------------------------
    def add(self, req: Request) -> None:
        """Take ``req`` in and issue what the order and the credit allow, from the caller's
        thread. The common case, ``req`` next in the order with credit to spare, is issued
        here, on the caller's stream, which orders the tensor's producers before it."""
        if self.inbox is not None:
            self._mark_ready(req)
            self.inbox.post(req)
            return
        with self.lock:
            if self.failure is not None:
                raise self.failure
            if self._take_at_once(req):
                chunk = req.chunks[0]
                if self.batched:
                    # The collective from this frame rather than a helper's: NCCL's flight
                    # recorder captures the Python stack of every collective it records.
                    if req.op != "all_reduce":
                        work = issue_step(chunk, 0)
                    elif req.synchronous:
                        work = req.group.allreduce([req.tensor], self._synchronous_options(req))
                    else:
                        work = req.group.allreduce([req.tensor], req.reduce_options)
                    req.outcome = True        # (resolved, as _take_dispatched would)
                    if work is None:
                        # Synchronous on NCCL: the collective is in the caller's stream,
                        # which orders whatever the caller does next after it; the lane
                        # has nothing to complete.
                        self.in_flight_bytes -= chunk.nbytes
                        chunk.request = None
                    else:
                        self._issued_direct(req, chunk, work)
                else:
                    self.outstanding[id(req)] = req
                    self._issue(chunk, 0)
                it = self.current
                plan = it.plan
                if plan is not None and it.plan_pos < len(plan.order) and \
                        plan.order[it.plan_pos][0] in it.by_key:
                    self._pump()                  # requests the plan held for this one
                dispatched = self._take_dispatched() if self.dispatched else None
            else:
                self._take_in(req)
                self._pump()
                if req.chunks[-1].t_dispatch_ns == 0:
                    # Held back (order or credit): whoever issues it later, from whatever
                    # thread and stream, waits for this point of the caller's stream.
                    self._mark_ready(req)
                else:
                    req.at_once = req.chunks_issued == len(req.chunks)
                settled = self._collect()
                dispatched = False
        if dispatched is False:
            self._settle(settled)
        elif dispatched:
            self._resolve(dispatched)

    def _take_at_once(self, req: Request) -> bool:
        """The hot path (lock held): whether ``req``, one chunk of one step, is what the
        order issues next, with credit to spare and nothing else pending in the lane; if
        so, take it in and admit it, as ``_take_in`` and ``_pump`` would, without their
        search, and (``batched``) stamp it as issued: the caller issues it next. False
        (nothing done) where any of that does not hold."""
        if not self.lean or len(req.chunks) != 1 or len(req.steps) != 1:
            return False
        it = self.current
        if it is None:
            if self.iterations or self.next_profile is not None:
                return False                  # earlier iterations pending, or a new plan
            # The first request of an iteration with nothing before it: the iteration is
            # at the head of the order at once, with the plan in force (as _pump would
            # resolve it: a lean lane has no tuner and no verification).
            it = self._begin_iteration(req.t_submit_ns)
            it.plan, it.resolved = self.plan, True
        elif (self.cur_chunk is not None or self.iterations[0] is not it
                or not it.resolved or req.key in it.by_key):
            return False
        chunk = req.chunks[0]
        credit = self.credit_bytes
        if credit and self.in_flight_bytes and self.in_flight_bytes + chunk.nbytes > credit:
            return False
        plan = it.plan
        if plan is None:
            if it.req_pos != len(it.requests):
                return False                  # an earlier request is not fully issued
        else:
            pos = it.plan_pos
            if (pos >= len(plan.order) or plan.order[pos] != (req.key, 0)
                    or plan.layout.get(req.key) != 1):
                return False
        # (_take_in, less the outstanding record: the request is resolved right below)
        it.add(req, chunk.nbytes)
        req.at_once = True
        if plan is None:
            it.req_pos += 1                   # (what peek() would find: req fully issued)
        else:
            it.plan_pos += 1
        self._admit(chunk)
        if self.batched:
            chunk.t_dispatch_ns = time.time_ns()
            req.chunks_issued = 1
            req.issue_seq = self.requests_issued
            self.requests_issued += 1
        return True

    def _mark_ready(self, req: Request) -> None:
        """Record where ``req``'s tensor is ready in the caller's stream (CUDA)."""
        if self.cuda:
            try:
                req.ready_event = self.ready_events.pop()
            except IndexError:
                req.ready_event = torch.cuda.Event()
            req.ready_event.record()

    def _take_in(self, req: Request) -> None:
        """Add ``req`` to the open iteration (lock held)."""
        it = self.current
        if it is None:
            it = self._begin_iteration(req.t_submit_ns)
        if req.key in it.by_key:
            raise SchedulerError(
                f"request key {req.key!r} submitted twice in iteration {it.index} of "
                f"lane {self.name}; call end_iteration() between iterations")
        it.add(req, req.tensor.numel() * req.tensor.element_size())
        self.outstanding[id(req)] = req

    def _collect(self):
        """After a pump, lock held: requests to resolve, and to fail if the lane failed."""
        failed = self._take_failed_requests() if self.failure is not None else None
        return failed, self._take_dispatched()

    def _settle(self, settled) -> None:
        """Lock released: resolve what was fully issued; on failure fail the rest, raise."""
        failed, dispatched = settled
        self._resolve(dispatched)
        if failed is not None:
            self._fail_futures(failed)
            raise self.failure

    def _begin_iteration(self, t_first_ns: int) -> _Iteration:
        it = _Iteration(self.iteration_count, self.next_profile, self.planned_layout is not None)
        self.next_profile = None
        it.t_first_ns = t_first_ns
        self.iteration_count += 1
        self.iterations.append(it)
        self.current = it
        return it

    def end_iteration(self, wait_dispatched: bool,
                      wait_taken: bool = True) -> Optional[IterationRecord]:
        if self.inbox is not None:
            return self.inbox.post_end(wait_dispatched, wait_taken)
        with self.lock:
            mark = self._flush_mark() if self.current is not None else None
            record = self._close_iteration(time.time_ns(), mark)
            if record is None:
                return None
            self._pump()
            while wait_dispatched and record.iteration >= self.dispatched_iterations:
                if self.failure is not None:
                    break
                self.idle.wait()
            settled = self._collect()
        self._settle(settled)
        if self.completion.polled:
            self._complete(None)
        self._report(record)
        return record

    def _flush_mark(self) -> Optional[DeviceMark]:
        """The end of the iteration in the caller's stream, for telemetry: the device may
        get there long after the host (one timed event per iteration, observer only)."""
        if not (self.cuda and self.observer is not None):
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return DeviceMark(self.device, event)

    def _close_iteration(self, t_end_ns: int,
                         mark: Optional[DeviceMark] = None) -> Optional[IterationRecord]:
        """No more requests in the open iteration (lock held); its record."""
        it = self.current
        if it is None:
            return None
        self.current = None
        it.flushed = True
        self._note_layout(it)
        record = IterationRecord(
            self.name, it.index, it.t_first_ns, t_end_ns, len(it.requests), it.chunks,
            it.nbytes, it.planned, mark)
        self.last_iteration = record
        return record

    def _report(self, record: IterationRecord) -> None:
        """An ended iteration to the observer (lock released)."""
        if self.observer is not None:
            self.observer.on_iteration(record)
        if self.tuner is not None:            # autotune: decisions to the observer, unlocked
            self.tuner.report(self.observer)

    def _note_layout(self, it: _Iteration) -> None:
        """Decide, from the submitted layout only (rank-invariant), whether the next
        iteration builds a new plan; keep this iteration's readiness as its profile."""
        if self.config.policy != "priority":
            return
        layout = tuple((r.key, r.tensor.numel(), len(r.chunks)) for r in it.requests)
        self.stable_iters = self.stable_iters + 1 if layout == self.last_layout else 1
        self.last_layout = layout
        current = {key: nchunks for key, _, nchunks in layout}
        if self.tuner is not None:
            # autotune: a plan is built for a credit window too; a switched window (known
            # here for the next iteration, see autotune.py) needs a new plan.
            current = (current, self.tuner.settings_for(it.index + 1).credit_bytes)
        if self.planned_layout != current and self.stable_iters >= self.config.profile_iters:
            self.planned_layout = current
            t0 = it.t_first_ns
            self.next_profile = [
                RequestProfile(r.key, r.priority, (r.t_submit_ns - t0) * 1e-9,
                               tuple(c.nbytes for c in r.chunks))
                for r in it.requests]

    # ---- dispatch (any thread, lock held) ------------------------------------------------
    def _pump(self) -> None:
        """Dispatch as far as the order, credit and step dependencies allow."""
        credit = self.credit_bytes
        while True:
            chunk = self.cur_chunk
            if chunk is None:
                if not self.iterations:
                    self.idle.notify_all()
                    return
                it = self.iterations[0]
                if not it.resolved:
                    if self.verify_queue and not self._verify_sequences():
                        return
                    if self.tuner is not None:    # autotune: may exchange, sets the credit
                        self.tuner.at_head(it)
                        credit = self.credit_bytes
                    if it.profile is not None:
                        self.plan = self._exchange_profile_and_plan(it.profile)
                    it.plan, it.resolved = self.plan, True
                chunk = it.peek()
                if chunk is None:
                    return
                if chunk is _DONE:
                    self.iterations.popleft()
                    self.dispatched_iterations = it.index + 1
                    if self.config.verify:
                        self.verify_queue.append((it.index, it.crc, it.sequence))
                    if self.tuner is not None:    # autotune: layouts, windows, in order
                        self.tuner.iteration_dispatched(it)
                    if self.completion.polled:
                        self.completion.close_newest()    # the caller completes it, later
                    else:
                        self.completion.ring()    # complete the iteration's chunks
                    self.idle.notify_all()
                    continue
                if credit and self.in_flight_bytes and self.in_flight_bytes + chunk.nbytes > credit:
                    self.completion.ring()        # dispatch waits for a completion
                    return
                if it.plan is not None and it.plan_pos < len(it.plan.order):
                    it.plan_pos += 1
                else:
                    it.chunk_pos += 1
                self._admit(chunk)
                self.cur_chunk, self.cur_step = chunk, 0
            step = self.cur_step
            if step and not self.stream_ordered and chunk.steps_done < step:
                self.completion.ring()            # dispatch waits for a completion
                return
            nsteps = len(chunk.request.steps)     # (read first: _issue may release it)
            self._issue(chunk, step)
            self.cur_step = step + 1
            if self.cur_step == nsteps:
                self.cur_chunk = None

    def _admit(self, chunk: Chunk) -> None:
        """``chunk`` takes its credit and is counted as dispatched (lock held)."""
        self.in_flight_bytes += chunk.nbytes
        self.chunks_dispatched += 1
        self.bytes_dispatched += chunk.nbytes
        if self.in_flight_bytes > self.peak_in_flight_bytes:
            self.peak_in_flight_bytes = self.in_flight_bytes

    def _exchange_profile_and_plan(self, profile: List[RequestProfile]) -> Plan:
        """Reduce the readiness profile with MAX over the group and build the plan.

        Runs when the iteration reaches the head of the dispatch order, i.e. after every
        step of the previous iterations was issued, so the exchange sits at the same place
        in the collective sequence on every rank.
        """
        cost = self.link_cost.seconds_per_byte
        values = torch.tensor([p.ready_s for p in profile] + [cost], dtype=torch.float64,
                              device=self.device)
        if self.cuda:
            with torch.cuda.stream(self.launch_stream):
                dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
                values = values.cpu()
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        values = values.tolist()
        profile = [p._replace(ready_s=v) for p, v in zip(profile, values)]
        plan = lane_plan(profile, self.credit_bytes, values[-1], self.feeds_forward)
        if self.trace_dispatch:
            self.dispatch_log.append(("plan", plan.order))
        return plan

    def _verify_sequences(self) -> bool:
        """COMMSCHED_VERIFY: compare the digests of the iterations dispatched since the
        last check across ranks (in the collective sequence, like the plan exchange);
        on a difference gather the sequences and fail with the first divergence."""
        checked, self.verify_queue = self.verify_queue, []
        local = torch.tensor([v for index, crc, _ in checked for v in (index, crc)],
                             dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        if all(torch.equal(g.cpu(), local.cpu()) for g in gathered):
            return True
        sequences: List[Optional[list]] = [None] * self.world_size
        dist.all_gather_object(sequences, [e for _, _, seq in checked for e in seq],
                               group=self.group)
        self._fail(SchedulerError(
            f"commsched: dispatch sequences of lane {self.name} differ across ranks "
            f"(iterations {checked[0][0]}..{checked[-1][0]}): "
            f"{first_divergence(sequences, self.ranks)}"))
        return False

    def _fail(self, error: BaseException) -> None:
        """Record the lane's failure and fail every request still waiting (lock held).
        Futures are failed outside the lock by whoever called, via ``failed_requests``."""
        if self.failure is None:
            self.failure = error
        self.idle.notify_all()

    def _take_dispatched(self) -> List[Request]:
        """CUDA requests whose every chunk was issued (lock held); see ``_resolve``."""
        if not self.dispatched:
            return self.dispatched
        dispatched, self.dispatched = self.dispatched, []
        for req in dispatched:
            self.outstanding.pop(id(req), None)
            req.outcome = True
        return dispatched

    def _resolve(self, requests: List[Request]) -> None:
        """Resolve fully issued CUDA requests (outside the lock: a future's callbacks may
        submit). The futures carry no stream: ``Request.wait()`` and ``join()`` order the
        caller's stream after the collectives."""
        for req in requests:
            if req._future is not None:
                _settle_outcome(req)

    def _take_failed_requests(self) -> List[Request]:
        """Fail every request not resolved yet (lock held); their futures are failed by
        ``_fail_futures``, outside the lock."""
        error = self.failure
        if not isinstance(error, SchedulerError):
            error = SchedulerError(str(error))
        failed = [r for r in self.outstanding.values() if r.outcome is None]
        for req in failed:
            req.outcome = error
        self.outstanding.clear()
        return failed

    def _fail_futures(self, requests: List[Request]) -> None:
        for req in requests:
            if req._future is not None:
                _settle_outcome(req)

    def _issue(self, chunk: Chunk, step: int) -> None:
        req = chunk.request
        if self.trace_dispatch:
            self.dispatch_log.append((req.iteration, req.key, chunk.index, step))
        if self.config.verify and not req.steps[step].endswith(":leaders"):
            # (the step among node leaders is the one step other ranks do not take)
            it = self.iterations[0]
            it.crc = step_crc(it.crc, req.key, chunk.index, step)
            it.sequence.append((req.iteration, repr(req.key), chunk.index, req.steps[step]))
        if step == 0:
            chunk.t_dispatch_ns = time.time_ns()
        nvtx = self.config.nvtx
        if nvtx:
            nvtx_range_push(f"commsched {req.steps[step]} {req.key}#{chunk.index}")
        last = step == len(req.steps) - 1
        if last:
            req.chunks_issued += 1
            if req.chunks_issued == len(req.chunks):
                req.issue_seq = self.requests_issued
                self.requests_issued += 1
        completion = self.completion
        if self.cuda:
            start, end, work = self._issue_cuda(chunk, step, last)
            if last and req.chunks_issued == len(req.chunks):
                req.done_work = work
                self.dispatched.append(req)
                if req.ready_event is not None:    # every step 0 was issued: free again
                    self.ready_events.append(req.ready_event)
                    req.ready_event = None
            # The newest step per process group (a topology step names its sub-group):
            # NCCL runs each group's collectives in issue order, so waiting for it waits
            # for every step issued before it on that group.
            completion.newest[req.steps[step] if req.cross_group else None] = work
            if end is None and start is None and not req.cross_group:
                completion.batch(chunk, step, last, work)
            else:
                completion.add(chunk, step, work, start, end,
                               end is not None and end is req.done_event)
        else:
            work = chunk.works = issue_step(chunk, step)
            retain(work)
            completion.add(chunk, step, work, None, None, False)
        if nvtx:
            nvtx_range_pop()
        if self._urgent(chunk, last):
            completion.ring()
        else:
            completion.bound()

    def _issued_direct(self, req: Request, chunk: Chunk, work) -> None:
        """After ``add`` issued ``req`` (resolved), one step of one chunk, in a lane whose
        steps nobody needs one by one (``batched``): the step into the open completion
        batch."""
        completion = self.completion
        req.done_work = completion.newest[None] = work
        completion.batch(chunk, 0, True, work)
        completion.bound()

    def _synchronous_options(self, req: Request):
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

    def _issue_cuda(self, chunk: Chunk, step: int, last: bool):
        """Issue one step on CUDA; returns (start event, end event, work).

        A request issued when it was submitted goes from the caller's stream, as a plain
        collective would: no stream switch, no event. One that was held back waits on the
        launch stream for its ready event: issued from the caller's stream it would also
        wait for whatever compute was queued there since. Events after a step (on the done
        stream) exist only where somebody needs them: telemetry or the tuner (timings), a
        credit window (the completion thread returns credit at the step's end), a padded
        chunk (copied back after its last step). Telemetry on a lane whose caller completes
        (``polled``) needs no event after a first step on the lane's own group either: that
        group times its collectives itself (``group_timed``), and the step's start event,
        in the issuing stream, costs that stream nothing. A wait of the done stream on
        the collective, issued here by the training thread, could hold up compute queued
        behind it in a shared hardware queue until the collective ended."""
        req = chunk.request
        completion = self.completion
        timed = self.observer is not None or self.collecting
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
        if not (timed or self.credit_bytes or padded):
            return start, None, work
        if self.group_timed and step == 0 and not (padded or req.cross_group):
            # Its end from the group's own timing (device_times). Not for a later step:
            # its start event, in whatever stream issued it, does not order it (the
            # step before it on the group's stream does).
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

    def _urgent(self, chunk: Chunk, last: bool) -> bool:
        """Whether somebody waits for this step's completion (see "Completion hand-off")."""
        if self.credit_bytes:
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
        return (not last or req.waited or self.observer is not None or self.collecting)

    # ---- completion (completion thread, or a polled lane's caller) ----------------------
    def _complete(self, waited: Optional[_InFlight]) -> None:
        """Settle ``waited`` and what finished with it (completion thread), or, with
        ``waited`` None, what the device finished of what the caller must complete
        (``polled``: the caller's thread, at its end of iteration; nothing where the
        completion thread was rung): ``_Completion.take`` hands them over; their credit
        comes back, their requests' outcomes are set, dispatch goes on."""
        completion = self.completion
        t_seen = time.time_ns()
        records = []
        finished = []
        released: List[Chunk] = []
        failed: List[Request] = []
        with self.lock:
            taken = completion.take(waited, t_seen)
            if taken is None:
                return
            batch, times = taken
            for item, (t_start, t_end) in zip(batch, times):
                chunk, step, error = item.chunk, item.step, item.error
                if chunk is None:             # a batch of steps (CUDA, see _Completion.batch)
                    self._complete_batch(item)
                    continue
                req = chunk.request
                chunk.steps_done = step + 1
                last = step == len(req.steps) - 1
                if t_start is None:
                    t_start = chunk.t_dispatch_ns     # (untimed, or failed: its dispatch)
                if error is None:
                    self.link_cost.add(t_start, t_end, chunk.nbytes if last else 0)
                if error is not None:
                    error = SchedulerError(
                        f"commsched: {req.steps[step]} of chunk {chunk.index}/"
                        f"{len(req.chunks)} of request {req.key!r} ({chunk.nbytes} bytes, lane "
                        f"{self.name}, ranks {list(self.ranks)}, iteration {req.iteration}) "
                        f"failed: {error}")
                    if self.failure is None:
                        self.failure = error
                    if req.outcome is None:
                        req.outcome = error
                        finished.append(req)
                elif last:
                    if not self.cuda:
                        finish_chunk(chunk)
                    chunk.staging = None      # kept alive until the device finished with it
                    # A work can own buffers until it is destroyed (NCCL's flat output of a
                    # list-form all-gather), and a request and its chunks reference each
                    # other: kept here, it would live until the cycle collector ran.
                    chunk.works = None
                    released.append(chunk)
                    self.in_flight_bytes -= chunk.nbytes
                    req.remaining -= 1
                    if req.remaining == 0 and not self.cuda:
                        finished.append(req)
                        self.outstanding.pop(id(req), None)
                        req.outcome = True
                if self.observer is not None or self.collecting:     # (autotune: rank 0)
                    records.append((chunk, step, error, t_start, t_end))
            if self.failure is None:
                self._pump()
            self.idle.notify_all()            # (join() waits for completions)
            if self.failure is not None:
                failed = self._take_failed_requests()
            dispatched = self._take_dispatched()
        self._resolve(dispatched)
        if records:
            built = [self._record(*record) for record in records]
            if self.observer is not None:
                self.observer.on_chunks(built)
            if self.tuner is not None:        # autotune: rank 0's profile of device times
                for record in built:
                    self.tuner.on_chunk(record)
        _release(released)
        completion.recycle(batch)
        for req in finished:
            if req._future is not None:
                _settle_outcome(req)
        self._fail_futures(failed)

    def _complete_batch(self, item: _InFlight) -> None:
        """A batch completed (lock held): its credit back. A failed collective fails the
        lane. Its steps' time on the link is unknown (one event after the last): from its
        first dispatch to its end is mostly the backward that produced its tensors, and
        the plan's cost per byte (LinkCost) must not take that for link time."""
        if item.error is not None and self.failure is None:
            self.failure = SchedulerError(
                f"commsched: one of {item.describe()} on lane {self.name} (ranks "
                f"{list(self.ranks)}) failed: {item.error}")
        self.in_flight_bytes -= item.nbytes

    def _record(self, chunk: Chunk, step: int, error, t_start: int, t_end: int) -> ChunkRecord:
        req = chunk.request
        name = req.steps[step]
        # A step on a topology sub-group ("op:role") ran among that sub-group's ranks.
        ranks = self.ranks if ":" not in name else self.topology.members[name.split(":")[1]]
        return ChunkRecord(
            self.name, req.iteration, str(req.key), req.op, name, req.decompose,
            chunk.index, len(req.chunks), chunk.nbytes,
            str(req.tensor.dtype).replace("torch.", ""), ranks, req.priority,
            req.t_submit_ns, chunk.t_dispatch_ns, t_start, t_end, error is None,
            "" if error is None else repr(error))

    def awaited(self, req: Request) -> None:
        """Somebody blocks on ``req``'s future (CPU): complete it as soon as it is issued."""
        with self.lock:
            req.waited = True
            if req.chunks_issued == len(req.chunks):
                self.completion.ring()

    def join(self) -> None:
        """The caller waits for every collective issued on the lane so far: on CUDA its
        current stream does, on the device (the host does not); on CPU the host does,
        until the completion thread completed them (their futures resolved), and the
        later steps of a decomposed chunk that they release (issued as each completes)."""
        completion = self.completion
        with self.lock:
            if self.cuda:
                waits = list(completion.newest.values())
            else:
                while ((completion.in_flight or self.cur_chunk is not None)
                       and self.failure is None):
                    completion.ring()
                    self.idle.wait()
                if self.failure is not None:
                    raise self.failure
                return
        for work in waits:
            work.wait()

    def drain(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            self.completion.ring()
            while (self.iterations or self.in_flight_bytes) and self.failure is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SchedulerError(f"lane {self.name}: drain timed out after {timeout}s")
                self.idle.wait(left)
            if self.failure is not None:
                raise self.failure
        if self.tuner is not None:            # autotune: decisions to the observer, unlocked
            self.tuner.report(self.observer)

    def close(self) -> None:
        if self.inbox is not None:
            # What was queued is taken in and dispatched first, as inline it would have been.
            self.inbox.close()
        self.stopping.set()
        self.completion.close()                   # (completes what was issued, then ends)
        self.watchdog.thread.join(timeout=1)      # (wakes at `stopping`)


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


def _release(chunks: List[Chunk]) -> None:
    """Chunks the lane is done with let go of their request: a request and its chunks
    reference each other, and a cycle left in place would be freed by Python's cycle
    collector only, whose collections a lean step must not trigger (each costs the
    training thread a pause that grows with the process's heap). Once a chunk's last step
    went into a completion batch (CUDA: nothing completes it one by one,
    ``_Completion.batch``) or completed (``_complete``), nothing reads ``chunk.request``
    again; ``request.chunks`` stays."""
    for chunk in chunks:
        chunk.request = None


def _settle_outcome(req: Request) -> None:
    """Resolve ``req``'s future as its outcome says."""
    outcome = req.outcome
    if outcome is True:
        _settle_future(req._future, req.tensor)
    else:
        _settle_future(req._future, error=outcome)


def _settle_future(future, value=None, error: Optional[BaseException] = None) -> None:
    """Resolve ``future`` unless it already was: when a lane fails, every outstanding
    request is failed, possibly on another thread while one of them completes."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except RuntimeError:
        if not future.done():
            raise


def _auto_decomposition(lane: "_Lane", topology: Topology, tensor: torch.Tensor,
                        partition_bytes: int) -> str:
    """``auto``: a rank-invariant choice from the request's chunk size and measured costs
    (calibrate.py). The table is measured at the lane's first request, which every rank
    reaches at the same point with nothing in flight; a lane whose first request was not
    ``auto`` keeps the static size rule."""
    if topology.nodes == 1:
        return "none"
    from .calibrate import calibrate, static_choice

    if topology.auto_table is None and lane.iteration_count == 0:
        topology.auto_table = calibrate(topology, lane.device, tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    chunk = nbytes if not partition_bytes else min(nbytes, partition_bytes)
    if topology.auto_table is None:
        return static_choice(topology.nodes, chunk)
    return topology.auto_table.choose(chunk)


def _group_timeout(group, device: torch.device) -> float:
    """The timeout the process group was created with (torch's default otherwise)."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        from torch.distributed.constants import default_pg_timeout
        return default_pg_timeout.total_seconds()


# Schedulers whose threads must be stopped before the interpreter finalizes (see below).
_live: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Stop every open scheduler's completion threads at exit. A daemon thread that is
    inside a torch call with the GIL released when finalization begins (resolving the
    future the main thread just returned from, say) is ended as it takes the GIL back, and
    ending it inside C++ aborts the process ("terminate called without an active
    exception"). Closing completes what was issued, then joins the threads."""
    for scheduler in list(_live):
        if not scheduler._closed:
            scheduler.close()
    keep_past_exit()


class Scheduler:
    """Partitions requests into chunks and dispatches them under a credit window, in an
    order identical on every rank (see the module docstring).

    Example::
        sched = commsched.Scheduler(commsched.Config(partition_bytes=1 << 20))
        sched.submit(grad, key="w", average=True).wait()
    """

    def __init__(self, config: Optional[Config] = None, observer=None,
                 trace_dispatch: bool = False, *, owns_groups: bool = False,
                 feeds_forward: bool = False):
        """``owns_groups``: the caller issues no collective of its own on a lane's group
        between a request's submission and the end of its iteration (the DDP hook and the
        data-parallel mode: they submit from backward), the condition under which
        ``Config.dispatch="thread"`` is safe: a dispatch thread running beside a caller
        that does issue collectives on the group could put them in a different order on
        different ranks.

        ``feeds_forward``: the next forward consumes each iteration's requests in priority
        order while the rest still communicate (the data-parallel mode). With
        ``Config.plan_forward`` the priority plan then minimises the modelled end of that
        forward (:func:`commsched.plan.build_forward_plan`) where the requests go whole."""
        self.config = (config if config is not None else Config()).with_policy("priority")
        self.observer = observer
        self.trace_dispatch = trace_dispatch
        self.owns_groups = owns_groups
        self.feeds_forward = feeds_forward
        self._lanes: Dict[object, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._fifo: Dict[object, Config] = {}      # groups set to submission order
        _live.add(self)

    def submit(self, tensor: torch.Tensor, *, key: Hashable, priority: int = 0,
               op: str = "all_reduce", group=None, average: bool = False,
               scale: Optional[float] = None, reduce_op=dist.ReduceOp.SUM,
               decompose: Optional[str] = None,
               partition_bytes: Optional[int] = None, async_op: bool = True) -> Request:
        """Schedule a collective on the flat tensor ``tensor``, in place.

        ``key`` names the request within an iteration (stable across iterations, the same
        on every rank); ``priority`` orders it (lower = needed earlier by the next
        forward). ``op``: ``all_reduce``; ``reduce_scatter`` (rank r's shard
        ``tensor[r*S:(r+1)*S]`` receives the reduction of that shard); ``all_gather``
        (every shard receives its owner's values). ``average`` divides by the group size
        before the sum (DDP's semantics; on NCCL, for a sum over a power-of-two group in
        one step, the collective averages instead: ``ReduceOp.AVG``, the same values);
        ``scale`` multiplies before it. ``decompose``
        overrides ``config.decompose`` for an all-reduce; ``partition_bytes`` overrides
        the lane's partition size for this request (0: one chunk).

        ``async_op=False``: the caller orders itself after the request right away (it has
        nothing to overlap with it), as after a synchronous ``dist.all_reduce``. Where the
        order issues a whole all-reduce from this call on a CUDA lane with nothing to time
        and no credit window, it then goes as a synchronous collective: on NCCL it runs on
        the caller's current stream, with no stream switch and nothing for the lane to
        complete (the process group's own watchdog still times it); ``wait()`` returns at
        once, ``finished()`` is true once it was issued, ``drain()`` does not wait for it.
        Elsewhere, or where the order holds it back, it goes as any other request.
        """
        if self._closed:
            raise SchedulerError("submit() on a closed Scheduler")
        if async_op is not True and async_op is not False:
            raise ValueError(f"async_op={async_op!r}: expected True or False")
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if (lane is not None and lane.whole and decompose is None and partition_bytes is None
                and scale is None and tensor.dim() == 1 and tensor.is_contiguous()
                and tensor.get_device() == lane.device_index):
            # The common cases, what the general path below does for them, spelled out: a
            # whole tensor in one chunk (the lane's settings: no partitioning, no
            # decomposition, no tuner).
            numel = tensor.numel()
            if op == "all_reduce" and reduce_op is _SUM:
                if average:
                    if lane.kernel_average:
                        reduce_op = _AVG
                    else:
                        tensor.div_(lane.world_size)
                req = Request(key, tensor, "all_reduce", lane, priority, reduce_op, "none",
                              _ALL_REDUCE, False)
                req.chunks = [Chunk(req, 0, 0, numel, numel * tensor.element_size())]
            elif op in _SHARDED_STEPS and not average and numel % lane.world_size == 0:
                # (Megatron's bucket groups: one chunk of each shard, the shard itself)
                req = Request(key, tensor, op, lane, priority, reduce_op, "none",
                              _SHARDED_STEPS[op], False)
                req.chunks = [Chunk(req, 0, 0, numel // lane.world_size,
                                    numel * tensor.element_size())]
            else:
                req = None
            if req is not None:
                req.synchronous = not async_op
                req.remaining = 1
                lane.add(req)
                return req
        if op not in OPS:
            raise ValueError(f"op={op!r}: expected one of {', '.join(OPS)}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"tensor: expected a flat contiguous tensor, got shape "
                             f"{tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})")
        if partition_bytes is not None and (isinstance(partition_bytes, bool)
                                            or not isinstance(partition_bytes, int)
                                            or partition_bytes < 0):
            raise ValueError(f"partition_bytes={partition_bytes!r}: expected an int >= 0")
        group = group if group is not None else dist.group.WORLD
        lane = self._lanes.get(group) or self._lane(
            group, tensor.device, (repr(key), tensor.numel(), str(tensor.dtype), op))
        if tensor.get_device() != lane.device_index:
            raise ValueError(f"tensor on {tensor.device}, but earlier requests of lane "
                             f"{lane.name} were on {lane.device}")
        # autotune: the settings of the iteration this request joins (autotune.py)
        settings = lane.tuner.submit_settings() if lane.tuner is not None else lane.config
        if partition_bytes is None:
            partition_bytes = settings.partition_bytes
        decompose = decompose if decompose is not None else settings.decompose
        if decompose not in DECOMPOSITIONS:
            raise ValueError(f"decompose={decompose!r}: expected one of "
                             f"{', '.join(DECOMPOSITIONS)}")
        if op != "all_reduce":
            decompose = "none"
            if tensor.numel() % lane.world_size:
                raise ValueError(f"{op}: tensor of {tensor.numel()} elements does not divide "
                                 f"into {lane.world_size} shards")
        topology = None
        if decompose in ("hier", "leader", "auto"):
            topology = self._topology(lane)
            if decompose == "auto":
                decompose = _auto_decomposition(lane, topology, tensor, partition_bytes)
        if (average and lane.kernel_average and op != "all_gather"
                and (reduce_op is _SUM or reduce_op == _SUM)
                and (topology is None or decompose == "none")):
            reduce_op, average = dist.ReduceOp.AVG, False
        req = Request(key, tensor, op, lane, priority, reduce_op, decompose,
                      steps_for(op, decompose, topology),
                      topology is not None and decompose != "none")
        req.synchronous = not async_op
        if average:
            tensor.div_(lane.world_size)
        if scale is not None:
            tensor.mul_(scale)
        req.chunks = partition(req, partition_bytes,
                               parts_for(op, decompose, lane.world_size, topology))
        req.remaining = len(req.chunks)
        lane.add(req)
        return req

    def _topology(self, lane: _Lane) -> Topology:
        if lane.topology is None:
            with self._lock:
                if lane.topology is None:
                    lane.topology = Topology(
                        lane.group, local_size_from_env(self.config.local_size, lane.world_size))
        return lane.topology

    def set_fifo(self, group, device) -> None:
        """Dispatch ``group``'s requests, on ``device``, in submission order: no priority
        plan, no tuning, no sequence verification, hence no blocking exchange on that group
        at the head of an iteration. For requests already submitted in priority order whose
        first submission of an iteration comes at a point that differs between ranks (the
        data-parallel mode's all-gathers): an exchange there, blocking the caller, could
        deadlock against the caller's collectives on another group. For the same reason the
        group's lane is created here, with its configuration check (a collective on the
        group), rather than at the first request: call it on every rank at the same point."""
        if group in self._lanes:
            raise SchedulerError("set_fifo(): the group already has requests")
        self._fifo[group] = dataclasses.replace(self.config, policy="fifo", autotune=False,
                                                verify=False)
        self._lane(group, torch.device(device), ("set_fifo",))

    def end_iteration(self, group=None, wait_dispatched: bool = False,
                      private: bool = False) -> Optional[IterationRecord]:
        """No more requests on ``group`` this iteration: what is left may be dispatched,
        and the iteration's layout decides whether the next one gets a new plan. Returns
        the iteration's record.

        ``wait_dispatched``: return only once every collective of the iteration has been
        issued (waiting for credit as needed), so that a collective the caller issues on
        the same group afterwards comes after them on every rank.

        ``private``: the caller issues no collectives of its own on ``group`` (only
        through this scheduler), so nothing needs ordering against the lane's next plan
        exchange: with a dispatch thread, return at once instead of once the thread took
        the end in, i.e. once it issued what was queued before (returns None then).
        A failure surfaces at the next call.
        """
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        return None if lane is None else lane.end_iteration(wait_dispatched,
                                                            wait_taken=not private)

    def join(self, group=None) -> None:
        """Order the caller after every collective issued on ``group`` so far: on CUDA the
        current stream waits for them on the device (the host goes on); on CPU this blocks
        until they completed. What the DDP hook runs at the end of backward, where DDP
        reads the reduced buckets."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is not None:
            lane.join()

    def drain(self, timeout: Optional[float] = None) -> None:
        """End every lane's iteration and block until all its collectives completed."""
        for lane in list(self._lanes.values()):
            lane.end_iteration(False)
            lane.drain(timeout)

    def last_iteration(self, group=None) -> Optional[IterationRecord]:
        """The record of ``group``'s most recently ended iteration."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        return None if lane is None else lane.last_iteration

    def stats(self, group=None) -> Dict[str, int]:
        """Counters of ``group``'s lane: iterations, chunks and bytes dispatched, the peak
        of bytes in flight (bounded by the credit window), the batches in which chunks were
        completed, and of those the completion thread's (each a hand-off between threads;
        the others the caller's, see "Completion hand-off")."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None:
            return {"iterations": 0, "chunks": 0, "bytes": 0, "peak_in_flight_bytes": 0,
                    "completion_batches": 0, "thread_batches": 0}
        with lane.lock:
            return {"iterations": lane.iteration_count, "chunks": lane.chunks_dispatched,
                    "bytes": lane.bytes_dispatched,
                    "peak_in_flight_bytes": lane.peak_in_flight_bytes,
                    "completion_batches": lane.completion.batches,
                    "thread_batches": lane.completion.thread_batches}

    def tuning_log(self, group=None) -> List[dict]:
        """The autotuner's decisions on ``group``'s lane, oldest first (identical on every
        rank); empty without ``Config.autotune``. Fields: see ``commsched.autotune``."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None or lane.tuner is None:
            return []
        with lane.lock:
            return [dict(entry) for entry in lane.tuner.log]

    def dispatch_log(self, group=None) -> List[tuple]:
        """(iteration, key, chunk, step) in dispatch order, and ("plan", order) where a plan
        was built; only with trace_dispatch=True."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        return [] if lane is None else list(lane.dispatch_log)

    def close(self) -> None:
        """Stop the completion threads once what was issued completed (each waits up to
        10 s); requests not yet dispatched are abandoned: drain() first. Called at exit
        for schedulers still open."""
        self._closed = True
        for lane in self._lanes.values():
            lane.close()

    def _threaded(self, config: Config, device: torch.device) -> bool:
        """Whether a lane gets a dispatch thread (Config.dispatch): only where asked for."""
        return config.dispatch == "thread"

    def _lane(self, group, device: torch.device, first: tuple) -> _Lane:
        lane = self._lanes.get(group)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(group)
                if lane is None:
                    # Before the first collective on this group: everything that decides the
                    # collective sequence must be the same on every rank.
                    config = self._fifo.get(group, self.config)
                    check_agreement({
                        "partition_bytes": config.partition_bytes,
                        "credit_bytes": config.credit_bytes, "policy": config.policy,
                        "decompose": config.decompose, "profile_iters": config.profile_iters,
                        "local_size": local_size_from_env(config.local_size,
                                                          dist.get_world_size(group)),
                        "verify": config.verify, "backend": dist.get_backend(group),
                        "autotune": (config.autotune, config.autotune_iters),
                        "device type": device.type, "first request": first,
                    }, group, what="scheduler configuration")
                    lane = _Lane(self, group, device, f"g{len(self._lanes)}", config,
                                 self._threaded(config, device))
                    self._lanes[group] = lane
        return lane
