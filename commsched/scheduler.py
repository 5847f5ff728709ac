"""The priority/credit scheduler: ``Scheduler``, one lane per process group, and
``Request``, a flat tensor handed to it.

  submit(request) ─► partition into chunks ─► lane of the request's process group
                                                │  dispatch order: fifo, or a priority plan
                                                ▼
                     credit gate (bytes in flight) ─► async collective (torch.distributed)
                                                │
  request future ◄── all chunks done ◄── completion: device completion, credit back

Every rank dispatches the same collectives in the same order ([Note: every rank in step]
in docs/design.md); the thread that submits issues what it can itself ([Note: the hot
path]); credit returns when the device finished ([Note: completion hand-off]). The lane
(lane.py) does the work; this module checks what is asked and keeps the lanes.

Adapter contract: under a priority plan a lane may hold submitted chunks back until a
planned request of the same iteration is submitted. An adapter must therefore not block on
a request while requests of that iteration are still to come on the same lane; it ends the
iteration first (``end_iteration``), or uses another process group (lane) for the requests
it waits on mid-iteration (the data-parallel mode does this for its all-gathers).
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
import weakref
from typing import Dict, Hashable, List, Optional

import torch
import torch.distributed as dist

from .collectives import parts_for, steps_for
from .config import DECOMPOSITIONS, Config, ConfigError
from .errors import SchedulerError, UnavailableError
from .lane import Lane
from .observer import IterationRecord
from .partition import Chunk, partition
from .safety import agreement_timeout, check_agreement
from .topology import Topology, local_size_from_env
from .workers import keep_past_exit, settle_gloo_workers

__all__ = ["Scheduler", "Request", "SchedulerError", "made_any"]

OPS = ("all_reduce", "reduce_scatter", "all_gather")
_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG
_ALL_REDUCE = steps_for("all_reduce", "none")
# Whole reduce-scatters and all-gathers (Megatron's bucket groups): steps by op
_SHARDED_STEPS = {op: steps_for(op, "none") for op in ("reduce_scatter", "all_gather")}
# Config settings served by an extension the core does not load (see Scheduler)
_NEEDS_EXTENSION = {"autotune": "commsched.autotune.Tuner",
                    "nvtx": "commsched.telemetry.nvtx_ranges.NvtxRanges"}


class Request:
    """A flat tensor handed to the scheduler.

    ``future`` resolves to the tensor: on CPU once every chunk finished, on CUDA once every
    chunk was issued (a plain CPU future: it carries no stream); it is created when first
    asked for; ``done()`` tells the same without one. ``wait()`` is what orders the
    caller after the collectives: on CUDA the current stream waits for them on the device,
    the host does not. ``issue_seq`` numbers the lane's requests in the order their last
    collective was issued (None until then); NCCL runs a lane's collectives in that
    order."""

    __slots__ = (
        "key", "tensor", "op", "group", "world_size", "rank", "priority", "reduce_op",
        "decompose", "steps", "_future", "outcome", "chunks", "remaining", "iteration",
        "t_submit_ns",
        "ready_event", "lane", "reduce_options", "chunks_issued", "done_work", "done_event",
        "cross_group", "issue_seq", "waited", "at_once", "synchronous", "marks",
        "__weakref__",
    )

    def __init__(self, key: Hashable, tensor: torch.Tensor, op: str, lane: Lane,
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
        self.reduce_options = lane.issuer.reduce_options(reduce_op)
        self.decompose = decompose
        self.steps = steps
        self.cross_group = cross_group
        self._future = None
        # None while pending, True once resolved, else the error it failed with; set
        # under the lane's lock (the future may be created from another thread).
        self.outcome = None
        self.chunks: List[Chunk] = ()       # (a list once the scheduler cut it)
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
        self.waited = False           # CPU: somebody waits for the future (Lane._urgent)
        self.at_once = False          # CUDA: every step issued from the submitter's stream
        # submit(async_op=False): issued at once, the collective runs on the caller's
        # stream (see Issuer.issue_batched)
        self.synchronous = False
        # In a profiled iteration: when it was ready and when its collectives ended
        # (readiness.Marks)
        self.marks = None

    @property
    def future(self) -> torch.futures.Future:
        future = self._future
        if future is None:
            with self.lane.lock:
                future = self._future
                if future is None:
                    future = self._future = torch.futures.Future()
                    if self.outcome is not None:
                        self.settle_future()
        return future

    def done(self) -> bool:
        """Whether the future resolved (or would have): on CUDA once every chunk was
        issued, on CPU once every chunk finished (see the class docstring)."""
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

    def settle_future(self) -> None:
        """Resolve the future as the outcome says, unless it already was: when a lane
        fails, every outstanding request is failed, possibly on another thread while one
        of them completes."""
        future, outcome = self._future, self.outcome
        if future.done():
            return
        try:
            if outcome is True:
                future.set_result(self.tensor)
            else:
                future.set_exception(outcome)
        except RuntimeError:
            if not future.done():
                raise

    def __repr__(self) -> str:
        return (f"Request({self.key!r}, op={self.op}, numel={self.tensor.numel()}, "
                f"chunks={len(self.chunks)}, priority={self.priority})")


# Schedulers whose threads must be stopped before the interpreter finalizes (see below).
_live: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()
_made = False


def made_any() -> bool:
    """Whether this process made a scheduler: the DDP hook, the Megatron patches and the
    data-parallel mode each make one once they have something to schedule."""
    return _made


@atexit.register
def _close_at_exit() -> None:
    """Stop every open scheduler's completion threads at exit. A daemon thread that is
    inside a torch call with the GIL released when finalization begins (resolving the
    future the main thread just returned from, say) is ended as it takes the GIL back, and
    ending it inside C++ aborts the process ("terminate called without an active
    exception"). Closing completes what was issued, then joins the threads; then no gloo
    worker thread is left with a collective to destroy (commsched.workers)."""
    for scheduler in list(_live):
        if not scheduler._closed:
            scheduler.close()
    keep_past_exit()
    settle_gloo_workers()


class Scheduler:
    """Partitions requests into chunks and dispatches them under a credit window, in an
    order identical on every rank (see the module docstring).

    ``observer``: telemetry (an ``Observer``), shared by the lanes. ``extensions``:
    factories, each called once per lane with its ``LaneInfo``, of what else instruments
    it (``commsched.autotune.Tuner``, NVTX ranges); ``Config.autotune`` and ``Config.nvtx``
    need theirs (``commsched.adapter.build_scheduler`` adds them). ``feeds_forward``: the
    next forward consumes each iteration's requests in priority order while the rest still
    communicate (the data-parallel mode); with ``Config.plan_forward`` the priority plan
    then minimises the modelled end of that forward (:func:`commsched.plan.build_forward_plan`).

    Example::
        sched = commsched.Scheduler(commsched.Config(partition_bytes=1 << 20))
        sched.submit(grad, key="w", average=True).wait()
    """

    def __init__(self, config: Optional[Config] = None, observer=None,
                 trace_dispatch: bool = False, *, extensions=(), feeds_forward: bool = False):
        self.config = (config if config is not None else Config()).with_policy("priority")
        provided = {name for make in extensions for name in getattr(make, "provides", ())}
        for name, extension in _NEEDS_EXTENSION.items():
            if getattr(self.config, name) and name not in provided:
                raise ConfigError(
                    f"{name}=True needs the extension {extension}: make the scheduler with "
                    f"commsched.adapter.build_scheduler(config), or pass "
                    f"extensions=[{extension.rsplit('.', 1)[1]}]")
        self.observer = observer
        self.extensions = tuple(extensions)
        self.trace_dispatch = trace_dispatch
        self.feeds_forward = feeds_forward
        self._lanes: Dict[object, Lane] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._fifo: Dict[object, Config] = {}      # groups set to submission order
        _live.add(self)
        global _made
        _made = True

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
        ``scale`` multiplies before it. ``decompose`` overrides ``config.decompose`` for an
        all-reduce; ``partition_bytes`` overrides the lane's partition size for this
        request (0: one chunk).

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
            raise ConfigError(f"async_op={async_op!r}: expected True or False")
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        req = None
        if (lane is not None and lane.whole and decompose is None and partition_bytes is None
                and scale is None and tensor.dim() == 1 and tensor.is_contiguous()
                and tensor.get_device() == lane.device_index):
            req = _whole_request(lane, tensor, key, priority, op, average, reduce_op)
        if req is None:
            req = self._request(tensor, key, priority, op, group, average, scale, reduce_op,
                                decompose, partition_bytes)
        req.synchronous = not async_op
        req.lane.add(req)
        return req

    def _request(self, tensor: torch.Tensor, key: Hashable, priority: int, op: str, group,
                 average: bool, scale: Optional[float], reduce_op, decompose: Optional[str],
                 partition_bytes: Optional[int]) -> Request:
        """A request in the general case: checked, its decomposition and chunks chosen
        (the lane's settings, or the tuner's for the iteration it joins)."""
        if op not in OPS:
            raise ConfigError(f"op={op!r}: expected one of {', '.join(OPS)}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ConfigError(f"tensor: expected a flat contiguous tensor, got shape "
                              f"{tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})")
        if partition_bytes is not None and (isinstance(partition_bytes, bool)
                                            or not isinstance(partition_bytes, int)
                                            or partition_bytes < 0):
            raise ConfigError(f"partition_bytes={partition_bytes!r}: expected an int >= 0")
        group = group if group is not None else dist.group.WORLD
        lane = self._lanes.get(group) or self._lane(
            group, tensor.device, (repr(key), tensor.numel(), str(tensor.dtype), op))
        if tensor.get_device() != lane.device_index:
            raise ConfigError(f"tensor on {tensor.device}, but earlier requests of lane "
                              f"{lane.name} were on {lane.device}")
        settings = lane.submit_settings() or lane.config
        average = average and lane.world_size > 1      # [Note: an average over one rank]
        if partition_bytes is None:
            partition_bytes = settings.partition_bytes
        decompose = decompose if decompose is not None else settings.decompose
        if decompose not in DECOMPOSITIONS:
            raise ConfigError(f"decompose={decompose!r}: expected one of "
                              f"{', '.join(DECOMPOSITIONS)}")
        if op != "all_reduce":
            decompose = "none"
            if tensor.numel() % lane.world_size:
                raise ConfigError(f"{op}: tensor of {tensor.numel()} elements does not "
                                  f"divide into {lane.world_size} shards")
        topology = None
        if decompose in ("hier", "leader", "auto"):
            topology = self._topology(lane)
            if decompose == "auto":
                decompose = _auto_decomposition(lane, topology, tensor, partition_bytes)
        if (average and lane.issuer.kernel_average and op != "all_gather"
                and (reduce_op is _SUM or reduce_op == _SUM)
                and (topology is None or decompose == "none")):
            reduce_op, average = _AVG, False
        req = Request(key, tensor, op, lane, priority, reduce_op, decompose,
                      steps_for(op, decompose, topology),
                      topology is not None and decompose != "none")
        if average:
            tensor.div_(lane.world_size)
        if scale is not None:
            tensor.mul_(scale)
        req.chunks = partition(req, partition_bytes,
                               parts_for(op, decompose, lane.world_size, topology))
        req.remaining = len(req.chunks)
        return req

    def _topology(self, lane: Lane) -> Topology:
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

    def end_iteration(self, group=None, wait_dispatched: bool = False) -> Optional[IterationRecord]:
        """No more requests on ``group`` this iteration: what is left may be dispatched,
        and the iteration's layout decides whether the next one gets a new plan. Returns
        the iteration's record.

        ``wait_dispatched``: return only once every collective of the iteration has been
        issued (waiting for credit as needed), so that a collective the caller issues on
        the same group afterwards comes after them on every rank.
        """
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        return None if lane is None else lane.end_iteration(wait_dispatched)

    def join(self, group=None) -> None:
        """Order the caller after every collective issued on ``group`` so far: on CUDA the
        current stream waits for them on the device (the host goes on); on CPU this blocks
        until they completed. What the DDP hook runs at the end of backward, where DDP
        reads the reduced buckets."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is not None:
            lane.join()

    def pending(self, group=None) -> List[Request]:
        """``group``'s requests whose future has not resolved yet, in submission order (on
        CUDA those not fully issued; on CPU those not completed)."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None:
            return []
        with lane.lock:
            return [req for req in lane.book.outstanding.values() if req.outcome is None]

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
        the others the caller's, see [Note: completion hand-off])."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None:
            return {"iterations": 0, "chunks": 0, "bytes": 0, "peak_in_flight_bytes": 0,
                    "completion_batches": 0, "thread_batches": 0}
        with lane.lock:
            return {"iterations": lane.order.count, "chunks": lane.chunks_dispatched,
                    "bytes": lane.bytes_dispatched, "peak_in_flight_bytes": lane.credit.peak,
                    "completion_batches": lane.completion.batches,
                    "thread_batches": lane.completion.thread_batches}

    def tuning_log(self, group=None) -> List[dict]:
        """The autotuner's decisions on ``group``'s lane, oldest first (identical on every
        rank); empty without ``Config.autotune``. Fields: see ``commsched.autotune``."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None:
            return []
        with lane.lock:
            return [dict(entry) for part in lane.parts if part.tunes for entry in part.log]

    def plan_summary(self, group=None) -> Optional[dict]:
        """What ``group``'s newest priority plan was built from and chose (None before the
        first): the order, the submission order, each request's readiness, the link's cost
        per byte, the profiled iterations' spread and, for a plan of whole requests for the
        next forward, its modelled end in both orders."""
        lane = self._lanes.get(group if group is not None else dist.group.WORLD)
        if lane is None:
            return None
        with lane.lock:
            decision = lane.order.decision
            return None if decision is None else dict(decision)

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

    def _lane(self, group, device: torch.device, first: tuple) -> Lane:
        lane = self._lanes.get(group)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(group)
                if lane is None:
                    # Before the first collective on this group: everything that decides the
                    # collective sequence must be the same on every rank.
                    config = self._fifo.get(group, self.config)
                    _check_group(group)
                    check_agreement({
                        "partition_bytes": config.partition_bytes,
                        "credit_bytes": config.credit_bytes, "policy": config.policy,
                        "decompose": config.decompose, "profile_iters": config.profile_iters,
                        "local_size": local_size_from_env(config.local_size,
                                                          dist.get_world_size(group)),
                        "verify": config.verify, "backend": dist.get_backend(group),
                        "autotune": (config.autotune, config.autotune_iters),
                        "device type": device.type, "first request": first,
                    }, group, what="scheduler configuration",
                        timeout_s=agreement_timeout(config.timeout_s))
                    tuned = config.autotune
                    lane = Lane(group, device, f"g{len(self._lanes)}", config,
                                [make for make in self.extensions
                                 if tuned or "autotune" not in getattr(make, "provides", ())],
                                self.observer, self.trace_dispatch, self.feeds_forward,
                                config.timeout_s or _group_timeout(group, device))
                    self._lanes[group] = lane
        return lane


def _check_group(group) -> None:
    """A group destroyed since the adapter took it is named, not a ValueError from
    torch.distributed at the first collective."""
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError) as exc:
        raise UnavailableError(f"commsched scheduler: process group {group!r} cannot be used "
                               f"(destroyed, or not of this process): {exc}") from None


def _whole_request(lane: Lane, tensor: torch.Tensor, key: Hashable, priority: int, op: str,
                   average: bool, reduce_op) -> Optional[Request]:
    """The common cases, what ``Scheduler._request`` makes of them, without its checks: a
    whole tensor in one chunk on a lane with no partitioning, decomposition or tuner. None
    where the request is not one of them."""
    numel = tensor.numel()
    if op == "all_reduce" and reduce_op is _SUM:
        if average and lane.world_size > 1:     # [Note: an average over one rank]
            if lane.issuer.kernel_average:
                reduce_op = _AVG
            else:
                tensor.div_(lane.world_size)
        req = Request(key, tensor, "all_reduce", lane, priority, reduce_op, "none",
                      _ALL_REDUCE, False)
        req.chunks = [Chunk(req, 0, 0, numel, numel * tensor.element_size())]
    elif op in _SHARDED_STEPS and not average and numel % lane.world_size == 0:
        # (Megatron's bucket groups: one chunk of each shard, the shard itself)
        req = Request(key, tensor, op, lane, priority, reduce_op, "none", _SHARDED_STEPS[op],
                      False)
        req.chunks = [Chunk(req, 0, 0, numel // lane.world_size,
                            numel * tensor.element_size())]
    else:
        return None
    req.remaining = 1
    return req


def _auto_decomposition(lane: Lane, topology: Topology, tensor: torch.Tensor,
                        partition_bytes: int) -> str:
    """``auto``: a rank-invariant choice from the request's chunk size and measured costs
    (calibrate.py). The table is measured at the lane's first request, which every rank
    reaches at the same point with nothing in flight; a lane whose first request was not
    ``auto`` keeps the static size rule."""
    if topology.nodes == 1:
        return "none"
    from .calibrate import announce, calibrate, static_choice

    if topology.auto_table is None and lane.order.count == 0:
        topology.auto_table = calibrate(topology, lane.device, tensor.dtype)
        announce(topology.auto_table, lane.name, topology, tensor.dtype, lane.ext)
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
