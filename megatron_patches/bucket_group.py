"""megatron-core's bucket-group collectives, routed through the commsched scheduler.

megatron-core's DDP keeps gradients in flat buffers cut into buckets, and buckets in bucket
groups (``_ParamAndGradBucketGroup``); each group starts and finishes its own collectives:

  start_grad_sync / finish_grad_sync     all-reduce, or reduce-scatter with the distributed
                                         optimizer (each rank keeps its shard)
  start_param_sync / finish_param_sync   all-gather of the updated parameter shards
                                         (distributed optimizer only)

The replacements made here keep megatron's semantics (flags, handles, assertions, scaling)
and only swap the ``torch.distributed`` calls for ``Scheduler.submit`` on the same process
group, one request per bucket: every gradient sync, overlapped (``overlap_grad_reduce``) or
not, and the all-gathers overlapped with the forward (``overlap_param_gather``). The handle
megatron stores (``grad_reduce_handle``, ``param_gather_handle``) is a
:class:`BucketGroupHandle`; its ``wait()`` is ``Request.wait()`` on each request of the call
(as with NCCL's own handles, what the caller's stream runs next comes after the collectives).

Iterations. A scheduler iteration is a training iteration; all ranks end it at the same
point, decided from rank-invariant facts only: the number of bucket groups registered on
the process group (at construction, see ``Runtime.register``) and which of them submitted.

  forward   AG bg3 ▸ AG bg2 ▸ AG bg1 ▸ AG bg0     (overlap_param_gather: each is waited
                                                   for before the next is dispatched)
  backward                      RS bg0  RS bg1  RS bg2  RS bg3 ─► end_iteration()
                                (as gradients become ready; the last sync ends it, or
                                the last all-gather where the syncs run unscheduled)

A bucket group that submits the same phase twice before the iteration ended (a step whose
gradient syncs did not all go through the scheduler) means that a new iteration began: the
old one is ended first.

Priorities and the plan. The scheduler's policy here is fifo unless ``COMMSCHED_POLICY``
says otherwise (``Config.policy``): the requests go in the order megatron's own overlap
would issue them. With ``COMMSCHED_POLICY=priority`` a plan dispatches an iteration's
chunks in a fixed order and holds a chunk back until every request planned before it was
submitted. That is safe only if the training thread never waits for a request while one
planned ahead of it is still to come. Hence:

- natural priority = layer position (the first layers first: the next forward needs them
  first), all-gathers before gradient syncs: ``position`` for an all-gather,
  ``groups + position`` for a gradient sync;
- a priority floor: whenever the training thread waits, later requests of the iteration get
  at least the highest priority submitted so far. Along anything that waits (the all-gather
  chain of the forward, synchronous gradient syncs) priorities never decrease, so the plan
  keeps that order; what is submitted together (the syncs of a backward) keeps its layer
  priorities and is reordered;
- calls that are not part of every iteration, or that are synchronous all-gathers, are left
  to megatron (see below), so that iterations keep one layout that plans are made for.

Megatron's own methods run, for that call, where scheduling would gain nothing or the
replacements do not reproduce a configuration (each reason logged once):

- synchronous all-gathers (``overlap_param_gather`` off: the optimizer step's; ``force_sync``
  before evaluation or a checkpoint) and ``force_all_reduce`` with the distributed
  optimizer (a one-off iteration): blocking, nothing to overlap;
- bucket groups constructed before ``apply()``, ``num_distributed_optimizer_instances > 1``,
  ``reduce_scatter_with_fp32_accumulation``, FP8/FP4 parameters, and param gather without
  the distributed optimizer.

Before an original method issues collectives on a process group, that group's outstanding
scheduler requests are completed, so that the two never interleave differently on
different ranks.

Known limit: the scheduler applies the plan made from one iteration to the next whatever
that one submits. After an iteration unlike its neighbours (one with ``force_all_reduce``,
say) and with ``profile_iters=1``, a plan can name requests the next iteration submits only
after waiting for one the plan put behind them. ``profile_iters >= 2`` (the default) needs
two alike iterations before it plans.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from commsched import notices
from commsched.adapter import MEGATRON, adapter_config, build_scheduler, close
from commsched.collectives import averages_in_collective
from commsched.config import Config
from commsched.errors import CommschedWarning
from commsched.scheduler import Request, Scheduler

from .versions import MegatronSeries

__all__ = ["Runtime", "BucketGroupHandle", "make_replacements", "PATCHED_METHODS"]

PATCHED_METHODS = ("__init__", "start_grad_sync", "finish_grad_sync", "start_param_sync",
                   "finish_param_sync")

GRAD_SYNC = "grad"
PARAM_GATHER = "param"


def collective_group(bucket_group):
    """The process group megatron runs the bucket group's collectives on."""
    if bucket_group.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return getattr(bucket_group, "data_parallel_group", None)


class BucketGroupHandle:
    """What megatron stores in ``grad_reduce_handle`` / ``param_gather_handle``: ``wait()``
    waits for every request of the call (``Request.wait()``), after raising the priority
    floor of the process group (see the module docstring), and lets go of them.

    One per bucket group and phase, made with its member and given the requests of each
    call in turn (megatron holds at most one call's handle per phase and drops it once
    waited for): nothing is allocated per call, and nothing of a call is kept past its
    wait ([Note: no cycles on the hot path] in docs/design.md)."""

    __slots__ = ("_state", "_requests")

    def __init__(self, state: "GroupState"):
        self._state = state
        self._requests: List[Request] = []

    def wait(self) -> None:
        self._state.raise_floor()
        requests = self._requests
        for request in requests:
            request.wait()
        requests.clear()


class _Member:
    """A registered bucket group: its index on its process group (creation order, the
    same on every rank), the buffer segment it belongs to (for its layer position), why a
    phase cannot run through the scheduler (None: it can), and its requests' keys per
    phase, one per bucket: ``bg3.grad``, ``bg3.b1.param``, unique within an iteration,
    since a bucket group submitting a phase twice starts the next iteration; and its
    handle per phase."""

    __slots__ = ("state", "index", "segment", "ref", "reasons", "keys", "handles")

    def __init__(self, state: "GroupState", index: int, segment: int, ref,
                 reasons: Dict[str, Optional[str]], buckets: int):
        self.state = state
        self.index = index
        self.segment = segment
        self.ref = ref
        self.reasons = reasons
        self.keys = {phase: [f"bg{index}.b{bucket}.{phase}" if buckets > 1
                             else f"bg{index}.{phase}" for bucket in range(buckets)]
                     for phase in (GRAD_SYNC, PARAM_GATHER)}
        self.handles = {phase: BucketGroupHandle(state) for phase in (GRAD_SYNC, PARAM_GATHER)}


class GroupState:
    """What the patches track for one process group: its bucket groups, the open
    iteration's submissions, and the priority floor. Training thread only."""

    def __init__(self, group, closing_phase: str):
        self.group = group
        self.closing_phase = closing_phase
        self.members: List[_Member] = []
        self._segments: Dict[int, int] = {}
        self._view = None            # (positions, closing count) of the live members
        self.submitted = {GRAD_SYNC: set(), PARAM_GATHER: set()}
        self.floor = 0
        self.max_priority = 0

    # ---- membership ----------------------------------------------------------------------
    def add(self, bucket_group, reasons: Dict[str, Optional[str]]) -> _Member:
        # Megatron cuts each grad buffer into buckets in reverse parameter order; buffers
        # (one per dtype per DDP model chunk) are created in model-chunk order.
        data = bucket_group.buckets[0].grad_data
        root = data._base if data._base is not None else data
        segment = self._segments.setdefault(id(root), len(self._segments))
        member = _Member(self, len(self.members), segment, None, reasons,
                         len(bucket_group.buckets))
        member.ref = weakref.ref(bucket_group, self._forget)
        self.members.append(member)
        self._view = None
        return member

    def _forget(self, _ref) -> None:
        self._view = None             # a bucket group was garbage-collected

    def _live_view(self):
        view = self._view
        if view is None:
            live = [m for m in self.members if m.ref() is not None]
            closing = sum(m.reasons[self.closing_phase] is None for m in live)
            live.sort(key=lambda m: (m.segment, -m.index))
            view = self._view = ({m.index: pos for pos, m in enumerate(live)}, closing)
        return view

    def size(self) -> int:
        """Number of live bucket groups on this process group."""
        return len(self._live_view()[0])

    def closing_count(self) -> int:
        """How many closing-phase submissions complete an iteration."""
        return self._live_view()[1]

    def position(self, member: _Member) -> int:
        """Layer position: 0 for the bucket group holding the first layers of the first
        model chunk. Within a buffer the last bucket holds the first layers."""
        return self._live_view()[0][member.index]

    # ---- iteration bookkeeping -----------------------------------------------------------
    def raise_floor(self) -> None:
        """The training thread is about to wait: later requests must not be planned ahead
        of anything submitted so far."""
        self.floor = max(self.floor, self.max_priority)

    def reset_scheduler_iteration(self) -> None:
        self.floor = 0
        self.max_priority = 0


class Runtime:
    """Per-process state of the applied patches: the scheduler (created on first use), one
    :class:`GroupState` per process group, and the registered bucket groups."""

    def __init__(self, config: Config, series: MegatronSeries, originals: Dict[str, Callable],
                 is_quantized: Callable, observer=None, version: str = "?"):
        self.config = adapter_config(config, MEGATRON)
        self.version = version
        self.series = series
        self.features = series.features
        self.originals = originals
        self.is_quantized = is_quantized
        self.observer = observer
        self.recorder = None
        self.scheduler: Optional[Scheduler] = None
        self.states: Dict[object, GroupState] = {}
        # Registered bucket groups by id(), each checked against its member's weak
        # reference (an id may be reused once a bucket group is gone): looked up in every
        # patched call, where a WeakKeyDictionary would make a weak reference each time.
        self.members: Dict[int, _Member] = {}
        self._logged = set()
        self._lock = threading.Lock()

    # ---- registration --------------------------------------------------------------------
    def register(self, bucket_group) -> None:
        """Called right after a bucket group was constructed."""
        group = collective_group(bucket_group)
        if group is None:
            return
        reasons = self._reasons(bucket_group)
        state = self.states.get(group)
        if state is None:
            # The backward's gradient syncs close an iteration; the forward's all-gathers
            # do only where the gradient syncs run unscheduled.
            closing = GRAD_SYNC if reasons[GRAD_SYNC] is None else PARAM_GATHER
            state = self.states[group] = GroupState(group, closing)
        self.members[id(bucket_group)] = state.add(bucket_group, reasons)

    def state_of(self, bucket_group) -> Optional[GroupState]:
        group = collective_group(bucket_group)
        return None if group is None else self.states.get(group)

    # ---- what is supported ---------------------------------------------------------------
    def unsupported_reason(self, bucket_group, phase: str) -> Optional[str]:
        """Why ``phase`` (``"grad"`` or ``"param"``) of ``bucket_group`` cannot run through
        the scheduler, or None."""
        return self._lookup(bucket_group, phase)[1]

    def member(self, bucket_group, phase: str) -> Optional[_Member]:
        """The member record when this phase of ``bucket_group`` runs through the scheduler;
        None (after saying why, once) when megatron's original must run. Called by
        every patched method, forward pre-hooks included: one lookup."""
        member, reason = self._lookup(bucket_group, phase)
        if reason is None:
            return member
        self._log_fallback(phase, reason)
        return None

    def _lookup(self, bucket_group, phase: str) -> Tuple[Optional[_Member], Optional[str]]:
        member = self.members.get(id(bucket_group))
        if member is None or member.ref() is not bucket_group:
            return None, ("bucket groups constructed before commsched.megatron_patches.apply() "
                          "(apply it, or apply_on_import, before the model is built)")
        return member, member.reasons[phase]

    def _reasons(self, bucket_group) -> Dict[str, Optional[str]]:
        """Why each phase must run megatron's original method (None: it need not). Fixed
        at construction and the same on every rank."""
        cfg = bucket_group.ddp_config
        common = None
        if cfg.num_distributed_optimizer_instances > 1:
            common = ("num_distributed_optimizer_instances > 1 (an inter-instance all-reduce "
                      "on megatron's own communication stream)")
        grad = common
        if grad is None and cfg.use_distributed_optimizer and getattr(
                cfg, "reduce_scatter_with_fp32_accumulation", False):
            grad = "reduce_scatter_with_fp32_accumulation (megatron's own reduce-scatter)"
        param = common
        if param is None and not cfg.use_distributed_optimizer:
            param = "parameter gathers without the distributed optimizer (layer-wise optimizer)"
        if param is None and (getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False) or any(
                self.is_quantized(p) for b in bucket_group.buckets for p in b.params_list)):
            param = "FP8/FP4 parameters (megatron post-processes their all-gather)"
        return {GRAD_SYNC: grad, PARAM_GATHER: param}

    def _log_fallback(self, phase: str, reason: str, by_design: bool = False) -> None:
        """Say once per phase and reason that megatron's own method runs: a warning, or a
        notice where that is by design."""
        what = "gradient sync" if phase == GRAD_SYNC else "parameter all-gather"
        if (what, reason) not in self._logged:
            self._logged.add((what, reason))
            message = (f"megatron-core's {what} runs as megatron's own method (not "
                       f"scheduled) for {reason}")
            if by_design:
                notices.say(message)
            else:
                warnings.warn("commsched: " + message, CommschedWarning, stacklevel=4)

    def unscheduled(self, phase: str, name: str, bucket_group, reason: str, **kwargs):
        """Megatron's own method, by design (not a missing feature): one notice."""
        self._log_fallback(phase, reason, by_design=True)
        return self.call_original(name, bucket_group, **kwargs)

    def call_original(self, name: str, bucket_group, **kwargs):
        """Run megatron's own method once the process group's scheduled requests have all
        been issued and waited for: its collectives then follow the scheduler's on every
        rank, rather than interleaving with them by timing."""
        state = self.state_of(bucket_group)
        if state is not None:
            self.complete_outstanding(state)
        return self.originals[name](bucket_group, **kwargs)

    def complete_outstanding(self, state: GroupState) -> None:
        """End ``state``'s open iteration and wait for its submitted requests, so that a
        collective megatron issues itself on the group comes after them on every rank.
        (The scheduler knows which are pending: a list of them kept here would keep them
        past their iteration, [Note: no cycles on the hot path] in docs/design.md.)"""
        scheduler = self.scheduler
        if scheduler is not None and scheduler.pending(state.group):
            self.end_iteration(state)
            for request in scheduler.pending(state.group):
                request.wait()

    # ---- submission ----------------------------------------------------------------------
    def submit(self, member: _Member, phase: str, op: str, tensors: List[torch.Tensor], *,
               average: bool = False, async_op: bool = True) -> BucketGroupHandle:
        """Submit one request per bucket tensor; returns the handle for megatron.
        ``async_op=False``: the caller waits for the handle at once (megatron's own call
        is synchronous there); see ``Scheduler.submit``."""
        state = member.state
        scheduler = self._scheduler(tensors[0].device)
        if member.index in state.submitted[phase]:
            self.end_iteration(state)             # this bucket group's next iteration began
        natural = (state.size() if phase == GRAD_SYNC else 0) + state.position(member)
        priority = max(natural, state.floor)
        reduce_op, scale = _reduction(average, state.group, tensors[0])
        handle = member.handles[phase]
        requests = handle._requests
        requests.clear()              # (a call megatron dropped without waiting for it)
        for key, tensor in zip(member.keys[phase], tensors):
            requests.append(scheduler.submit(
                tensor, key=key, priority=priority, op=op, group=state.group,
                scale=scale, reduce_op=reduce_op, async_op=async_op))
        state.max_priority = max(state.max_priority, priority)
        state.submitted[phase].add(member.index)
        if phase == state.closing_phase and len(state.submitted[phase]) >= state.closing_count():
            self.end_iteration(state)
        return handle

    def end_iteration(self, state: GroupState) -> None:
        """End the scheduler iteration: whatever the plan still holds back may go."""
        state.submitted[GRAD_SYNC].clear()
        state.submitted[PARAM_GATHER].clear()
        state.reset_scheduler_iteration()
        if self.scheduler is not None:
            self.scheduler.end_iteration(state.group)

    def _scheduler(self, device: torch.device) -> Scheduler:
        if self.scheduler is None:
            with self._lock:
                if self.scheduler is None:
                    self.scheduler, self.recorder = build_scheduler(
                        self.config, device, adapter=MEGATRON, observer=self.observer)
                    recorder = self.recorder
                    notices.started(
                        f"megatron-core {self.version} bucket-group collectives go through "
                        f"the scheduler ({_ranks_of_job()})", self.config,
                        os.path.dirname(recorder.path) if recorder and recorder.enabled
                        else None)
        return self.scheduler

    def close(self, timeout: Optional[float] = 300.0) -> None:
        """Complete what is outstanding, stop the scheduler's threads, close telemetry."""
        if self.scheduler is not None:
            close(self.scheduler, self.recorder, timeout)


def _ranks_of_job() -> str:
    """"a job of N ranks" for the start-up line. Rank 0 prints it at its first bucket,
    before the scheduler's agreement check, so it names the job's size, not how many
    ranks run the patches (that check fails the job, naming them, where some do not)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return f"a job of {world} ranks" if world > 1 else "a job of one rank"


def _reduction(average: bool, group, tensor: torch.Tensor):
    """(reduce_op, pre-scale) for ``average_in_collective``, by the one rule of
    ``averages_in_collective``: ReduceOp.AVG on NCCL, exactly what stock megatron runs;
    elsewhere (gloo has no AVG) NCCL's own definition of AVG for floating point, a
    multiply by 1/size before the sum."""
    if not average:
        return dist.ReduceOp.SUM, None
    size = dist.get_world_size(group)
    if averages_in_collective(str(dist.get_backend(group)), tensor.is_cuda, size,
                              reference_averages=True):
        return dist.ReduceOp.AVG, None
    return dist.ReduceOp.SUM, 1.0 / size


def make_replacements(runtime: Runtime) -> Dict[str, Callable]:
    """The replacement methods of ``_ParamAndGradBucketGroup``, bound to ``runtime``."""
    originals = runtime.originals
    features = runtime.features

    def __init__(self, *args, **kwargs):
        """Megatron's constructor, then registration with commsched (for the iteration
        count and the layer positions of the bucket groups on each process group)."""
        originals["__init__"](self, *args, **kwargs)
        runtime.register(self)

    def start_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Reduce the bucket group's gradients through the commsched scheduler: all-reduce,
        or reduce-scatter into this rank's shard with the distributed optimizer. Async
        (handle in ``grad_reduce_handle``) with overlap_grad_reduce, else submitted with
        ``async_op=False`` (as megatron's own call) and waited for."""
        member = runtime.member(self, GRAD_SYNC)
        if member is None:
            return runtime.call_original("start_grad_sync", self,
                                         force_all_reduce=force_all_reduce)
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return          # first batch: already started, e.g. by DDP.start_grad_sync()
        cfg = self.ddp_config
        if force_all_reduce and cfg.use_distributed_optimizer:
            return runtime.unscheduled(
                GRAD_SYNC, "start_grad_sync", self, "force_all_reduce with the distributed "
                "optimizer (a one-off iteration)", force_all_reduce=force_all_reduce)
        assert self.grad_reduce_handle is None, (
            "Should not have multiple communication calls outstanding at once")
        if "cudagraph_wgrad_events" in features:
            _wait_for_cudagraph_wgrads(self)
        if "extra_main_grads" in features:
            _stage_extra_main_grads(self)
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=cfg.check_for_nan_in_grad,
                             check_for_large=cfg.check_for_large_grads)
        # The scaling factor already says whether the collective sums or averages.
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        handle = runtime.submit(
            member, GRAD_SYNC,
            "reduce_scatter" if cfg.use_distributed_optimizer else "all_reduce",
            [bucket.grad_data for bucket in self.buckets], average=cfg.average_in_collective,
            async_op=cfg.overlap_grad_reduce)
        if cfg.overlap_grad_reduce:
            self.grad_reduce_handle = handle
        else:
            handle.wait()
            self.grad_reduce_handle = None

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Wait for the bucket group's gradient sync (starting it first when
        overlap_grad_reduce is off, or in the first batch)."""
        member = runtime.member(self, GRAD_SYNC)
        if member is None:
            return runtime.call_original("finish_grad_sync", self,
                                         force_all_reduce=force_all_reduce)
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
            if "extra_main_grads" in features:
                self._copy_back_extra_main_grads()
            return
        if "grad_reduce_finished" in features and self.grad_reduce_finished:
            return
        if self.is_first_batch:
            # The backward hooks start syncs once the first batch has shown which gradients
            # arrive; until then each starts here (and no plan exists yet to hold it back).
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        assert self.grad_reduce_handle is not None, (
            f"Communication call has not been issued for this bucket "
            f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} "
            f"params have grad available)")
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
        if "extra_main_grads" in features:
            self._copy_back_extra_main_grads()
        if "grad_reduce_finished" in features:
            self.grad_reduce_finished = True

    def start_param_sync(self, force_sync: bool = False):
        """All-gather the updated parameter shards of the bucket group: with
        overlap_param_gather through the commsched scheduler, async (handle in
        ``param_gather_handle``); a synchronous all-gather is megatron's own."""
        member = runtime.member(self, PARAM_GATHER)
        if member is None:
            return runtime.call_original("start_param_sync", self, force_sync=force_sync)
        if force_sync and self.param_gather_handle is not None:
            self.param_gather_handle.wait()          # already dispatched: just complete it
            self.param_gather_handle = None
            return
        if force_sync or not self.ddp_config.overlap_param_gather:
            # Blocking, so nothing to overlap with; and not in every iteration (force_sync)
            # or after the iteration's gradient syncs were waited for (the optimizer step).
            return runtime.unscheduled(
                PARAM_GATHER, "start_param_sync", self, "synchronous all-gathers "
                "(force_sync, or overlap_param_gather off)", force_sync=force_sync)
        assert self.param_gather_handle is None
        self.param_gather_handle = runtime.submit(
            member, PARAM_GATHER, "all_gather", [bucket.param_data for bucket in self.buckets])
        self.param_gather_dispatched = True

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        """Wait for the bucket group's all-gather (dispatching it first if it was not), then
        dispatch the next bucket group's, so that all-gathers run ahead of the forward."""
        if self.param_gather_dispatched and self.param_gather_handle is None:
            # Gathered and waited for already (the forward pre-hook calls this for every
            # module): megatron's own method does nothing then either.
            return
        member = runtime.member(self, PARAM_GATHER)
        if member is None:
            return runtime.call_original("finish_param_sync", self,
                                         skip_next_bucket_dispatch=skip_next_bucket_dispatch)
        assert self.ddp_config.overlap_param_gather
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        following = self.next_param_gather_bucket_group
        if following is None or skip_next_bucket_dispatch:
            return
        if following.param_gather_dispatched:
            warnings.warn("commsched: the next bucket group's parameter all-gather was "
                          "already dispatched: parameters are registered in a different "
                          "order than the forward pass uses them, which hurts the overlap "
                          "of the all-gathers with the forward.", CommschedWarning)
        else:
            following.start_param_sync()

    replacements = {
        "__init__": __init__,
        "start_grad_sync": start_grad_sync,
        "finish_grad_sync": finish_grad_sync,
        "start_param_sync": start_param_sync,
        "finish_param_sync": finish_param_sync,
    }
    for name, function in replacements.items():
        function.__qualname__ = f"_ParamAndGradBucketGroup.{name}"
        function.__module__ = __name__
        function.__wrapped__ = originals[name]     # inspect.signature shows megatron's
    return replacements


def _wait_for_cudagraph_wgrads(bucket_group) -> None:
    """0.19: a local CUDA-graph replay accumulates weight gradients asynchronously to the
    autograd hooks; the gradients may be read only after its event."""
    waited = set()
    for bucket in bucket_group.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None and id(event) not in waited:
                torch.cuda.current_stream().wait_event(event)
                waited.add(id(event))


def _stage_extra_main_grads(bucket_group) -> None:
    """0.19: parameters that accumulate into a separate higher-precision main_grad copy it
    into the communication buffer before the collective."""
    for bucket in bucket_group.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            staged = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if staged is not None:
                staged.copy_(param.main_grad)
