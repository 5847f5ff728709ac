"""The commsched DDP communication hook.

DDP calls the hook once per gradient bucket, strictly in bucket-index order on every rank,
and reads every returned future's tensor at the end of backward. The hook submits the
bucket's flat buffer to the scheduler (key = bucket index, priority = the position in forward
order of the bucket's earliest parameter), which issues it from autograd's thread and stream
when the order allows, and returns the request's future. The last bucket ends the scheduler
iteration, so what the plan still holds back may go; the hook returns from it once every
chunk was issued.

On CUDA a bucket issued at once (the common case) returns its collective's own future
(``Work.get_future()``, as PyTorch's ``allreduce_hook`` does): when DDP reads the buckets at
the end of backward, each bucket's copy into the gradients waits on the device for that
bucket's collective only, so the copies of early buckets run while the last collectives do.
A bucket the plan or the credit window held back returns the request's future, resolved
once issued, with no stream; the last bucket's call then makes the current stream wait for
every collective issued (``Scheduler.join``) before DDP reads the buckets. One wait for
all would queue every copy behind the last collective, which costs more than the futures
([Note: the hot path] in docs/design.md). On CPU the futures resolve when the
collectives finished.

Averaging is DDP's: the bucket divided by the group size, then summed. On NCCL with a
power-of-two group the collective averages instead (``ReduceOp.AVG``: the same values,
one pass over the bucket less; see ``Scheduler.submit``).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from commsched import unused
from commsched.adapter import DDP_HOOK, adapter_config, build_scheduler, close
from commsched.config import Config, ConfigError, warn_data_parallel_only
from commsched.errors import CommschedError
from commsched.inputs import (require_config, require_group, require_instance, require_module,
                              require_observer)
from commsched.scheduler import Scheduler

__all__ = ["CommschedState", "commsched_hook", "register", "registered_state", "other_hook",
           "describe", "HookConflictError", "NotDDPError", "HookStateError"]


class HookConflictError(CommschedError, RuntimeError):
    """The commsched hook cannot go on a model that has another comm hook, or commsched's
    with other settings: DDP takes one hook per model."""


class NotDDPError(CommschedError, TypeError):
    """``register`` was given something other than a DistributedDataParallel."""


class HookStateError(CommschedError, TypeError):
    """``commsched_hook`` was registered with a state that is not a ``CommschedState``
    (``DDPStrategy(ddp_comm_state=None)`` in Lightning, a process group)."""


class CommschedState:
    """State of the commsched DDP hook: the scheduler, the process group, and the forward
    order of the model's parameters (for bucket priorities).

    ``ddp_model`` may also be the module DDP will wrap, before torch.distributed is
    initialised (Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, built
    from the LightningModule): the scheduler is then built at the first bucket, on the
    bucket's device (``docs/integrations.md``).

    Example::
        state = CommschedState(ddp_model, Config(partition_bytes=1 << 20))
        ddp_model.register_comm_hook(state, commsched_hook)
    """

    __slots__ = ("scheduler", "group", "param_position", "bucket_priority", "recorder",
                 "held", "results", "deferred")

    def __init__(self, ddp_model: torch.nn.Module, config: Optional[Config] = None,
                 group=None, scheduler: Optional[Scheduler] = None, observer=None):
        _check_state_arguments(ddp_model, config, group, scheduler, observer)
        config = config if config is not None else Config.from_env()
        warn_data_parallel_only(config, "DDP hook", stacklevel=3)
        self.recorder = None
        # (config, observer) until the scheduler is built; ``scheduler`` stays unset
        # meanwhile, so that the hook's one attribute read finds out (commsched_hook).
        self.deferred = None
        if scheduler is None and not dist.is_initialized():
            self.deferred = (config, observer)
            unused.watch("a CommschedState was made before torch.distributed started",
                         "no DistributedDataParallel called commsched_hook: Lightning's "
                         "DDPStrategy registers comm hooks on CUDA only; on CPU, train under "
                         "COMMSCHED=1 python -m commsched.run instead")
        else:
            if scheduler is None:
                scheduler, self.recorder = build_scheduler(
                    config, next(ddp_model.parameters()).device, adapter=DDP_HOOK,
                    observer=observer)
            self.scheduler = scheduler
        self.group = group if group is not None else getattr(ddp_model, "process_group", None)
        module = getattr(ddp_model, "module", ddp_model)
        # parameters() is registration order, which for the models DDP sees is forward
        # order closely enough: the first layer's parameters come first.
        self.param_position: Dict[int, int] = {
            id(p): i for i, p in enumerate(module.parameters())}
        self.bucket_priority: Dict[Tuple[int, int], int] = {}
        self.held = False             # a bucket of this iteration returned a stream-less future
        self.results: List[_BucketTensor] = []     # by bucket index

    def result(self, index: int, tensor: torch.Tensor) -> "_BucketTensor":
        """The callback that resolves bucket ``index``'s future to ``tensor``: one object
        per bucket index, given the call's buffer each time, not a closure per call
        ([Note: no cycles on the hot path] in docs/design.md). It lets go of the buffer
        once called: after DDP rebuilds its buckets the old buffers are not kept."""
        results = self.results
        if index >= len(results):
            results.extend(_BucketTensor() for _ in range(index + 1 - len(results)))
        result = results[index]
        result.tensor = tensor
        return result

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Wait for outstanding chunks, then stop the scheduler and the telemetry recorder."""
        if self.deferred is None:
            close(self.scheduler, self.recorder, timeout)

    def build(self, device: torch.device) -> Scheduler:
        """The scheduler of a state made before torch.distributed was initialised, built
        now for tensors on ``device`` (the first bucket's)."""
        if not dist.is_initialized():
            raise HookStateError(
                "commsched_hook: torch.distributed is not initialised at the first bucket; "
                "the hook runs inside DistributedDataParallel, which needs it")
        config, observer = self.deferred
        self.scheduler, self.recorder = build_scheduler(config, device, adapter=DDP_HOOK,
                                                        observer=observer)
        self.deferred = None
        return self.scheduler

    def priority(self, bucket: dist.GradBucket) -> int:
        """Forward position of the bucket's earliest parameter (lower goes first)."""
        key = (bucket.index(), bucket.buffer().numel())
        prio = self.bucket_priority.get(key)
        if prio is None:
            prio = min((self.param_position.get(id(p), 0) for p in bucket.parameters()),
                       default=0)
            self.bucket_priority[key] = prio
        return prio


# No `from __future__ import annotations` in this module: DDP checks the hook's annotations
# against the real dist.GradBucket / torch.futures.Future objects.
def commsched_hook(state: CommschedState,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group through the commsched scheduler: partitioned,
    prioritised, credit-bounded, decomposed as the state's config says.

    Example::
        state = commsched.hooks.CommschedState(ddp_model)
        ddp_model.register_comm_hook(state, commsched.hooks.commsched_hook)
    """
    try:
        scheduler = state.scheduler
    except AttributeError:
        scheduler = _first_bucket(state, bucket)
    tensor = bucket.buffer()
    request = scheduler.submit(tensor, key=bucket.index(), priority=state.priority(bucket),
                               group=state.group, average=True)
    work = request.issued_work()
    if work is not None:
        future = work.get_future().then(state.result(bucket.index(), tensor))
    else:
        future = request.future
        state.held = True
    if bucket.is_last():
        del state.results[bucket.index() + 1:]      # (buckets rebuilt: fewer of them)
        # DDP issues collectives of its own on this group right after the last bucket
        # (the unused-parameter map with find_unused_parameters): ours must all have been
        # issued before, or the ranks' collective sequences could interleave differently.
        scheduler.end_iteration(state.group, wait_dispatched=True)
        # DDP reads the buckets once this returns (at the end of backward, or at once
        # where it reduces everything from a callback: static_graph's first iteration):
        # futures without a stream need the current stream to wait for the collectives.
        if state.held or not tensor.is_cuda:
            state.held = False
            scheduler.join(state.group)
    return future


def _first_bucket(state, bucket: dist.GradBucket) -> Scheduler:
    """The scheduler of a state whose first bucket this is (``CommschedState``'s deferred
    build); for anything that is not a ``CommschedState``, the error saying what to pass."""
    if isinstance(state, CommschedState) and state.deferred is not None:
        return state.build(bucket.buffer().device)
    raise bad_state(state)


def bad_state(state) -> HookStateError:
    """The error for ``commsched_hook`` registered with ``state``, which is not a
    ``CommschedState``."""
    got = ("None" if state is None
           else f"{type(state).__module__}.{type(state).__qualname__}")
    return HookStateError(
        f"commsched_hook: the hook's state must be a commsched.hooks.CommschedState, got "
        f"{got}: register it with "
        f"ddp_model.register_comm_hook(CommschedState(ddp_model), commsched_hook) or "
        f"commsched.hooks.register(ddp_model); in Lightning pass "
        f"DDPStrategy(ddp_comm_state=CommschedState(lightning_module), "
        f"ddp_comm_hook=commsched_hook), the state built from the LightningModule before "
        f"the Trainer starts")


class _BucketTensor:
    """Resolves a bucket's future (``Future.then``) to the bucket's buffer, whatever the
    collective's own result is (a chunk of it, where the bucket was cut). DDP waits for
    every bucket's future before the next backward, so each is called before its bucket's
    next call gives it the next buffer."""

    __slots__ = ("tensor",)

    def __init__(self):
        self.tensor: Optional[torch.Tensor] = None

    def __call__(self, _future) -> torch.Tensor:
        tensor, self.tensor = self.tensor, None
        return tensor


def register(ddp_model: torch.nn.parallel.DistributedDataParallel,
             config: Optional[Config] = None, **state_kwargs) -> "CommschedState":
    """Register the commsched hook on ``ddp_model``; returns its state.

    ``config`` defaults to ``Config.from_env()``. Registering again returns the state
    registered first when it asks for nothing else (no config, or an equal one, and no
    other argument). DDP accepts one comm hook per model: a model with another hook, or
    with commsched's under other settings, raises :class:`HookConflictError`; something
    other than a DistributedDataParallel :class:`NotDDPError`.

    Example::
        ddp_model = DistributedDataParallel(model)
        commsched.hooks.register(ddp_model)
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise NotDDPError(
            f"commsched.hooks.register: expected a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__module__}.{type(ddp_model).__qualname__}; wrap the model "
            f"first: commsched.hooks.register(DistributedDataParallel(model))")
    _check_arguments(ddp_model, config, state_kwargs)
    existing = registered_state(ddp_model)
    if existing is not None:
        if not state_kwargs and (
                config is None or adapter_config(config, DDP_HOOK) == existing.scheduler.config):
            return existing
        raise HookConflictError(
            f"commsched.hooks.register: {describe(ddp_model)} already has the commsched hook, "
            f"registered with other settings, and DDP takes one hook per model: register it "
            f"once (with COMMSCHED=1 the launcher registers it at the model's first forward: "
            f"register yours before that, or give the settings as COMMSCHED_* variables)")
    other = other_hook(ddp_model)
    if other is not None:
        raise HookConflictError(
            f"commsched.hooks.register: {describe(ddp_model)} already has the comm hook "
            f"{other}, and DDP takes one hook per model: drop that registration to schedule "
            f"this model with commsched, or leave commsched off for it")
    state = CommschedState(ddp_model, config, **state_kwargs)
    ddp_model.register_comm_hook(state, commsched_hook)
    return state


def _check_arguments(ddp_model, config, state_kwargs) -> None:
    """``register``'s arguments, before anything is registered: a config that is not a
    Config, an argument ``CommschedState`` does not take, a process group that is gone."""
    where = "commsched.hooks.register"
    require_config(config, where)
    unknown = sorted(set(state_kwargs) - {"group", "scheduler", "observer"})
    if unknown:
        raise ConfigError(f"{where}: unexpected argument(s) {', '.join(unknown)} (it takes "
                          f"config, group, scheduler, observer)")
    _check_state_arguments(ddp_model, config, where=where, before_start=False, **state_kwargs)


def _check_state_arguments(ddp_model, config, group=None, scheduler=None, observer=None,
                           where: str = "commsched.hooks.CommschedState",
                           before_start: bool = True) -> None:
    """``CommschedState``'s arguments, before anything is built. The group is checked
    where torch.distributed is up; a state made before it (Lightning's; ``before_start``:
    allowed) checks its kind only."""
    require_module(ddp_model, where, "ddp_model")
    require_config(config, where)
    require_instance(scheduler, Scheduler, "scheduler", where)
    require_observer(observer, where)
    if dist.is_initialized() or not before_start:
        require_group(group if group is not None else getattr(ddp_model, "process_group", None),
                      where)
    else:
        require_instance(group, dist.ProcessGroup, "group", where)


def registered_state(ddp_model) -> Optional[CommschedState]:
    """The state of the commsched hook registered on ``ddp_model``, or None."""
    for hook, state in getattr(ddp_model, "_comm_hooks", ()):
        if hook is commsched_hook:
            return state
    return None


def other_hook(ddp_model) -> Optional[str]:
    """The name of a comm hook other than commsched's that ``ddp_model`` has, or None."""
    for hook, _ in getattr(ddp_model, "_comm_hooks", ()):
        if hook is not commsched_hook:
            return getattr(hook, "__qualname__", None) or repr(hook)
    try:
        name = ddp_model._get_ddp_logging_data().get("comm_hook")   # built-in hooks too
    except (AttributeError, RuntimeError):
        return None
    return name if name and name != commsched_hook.__qualname__ else None


def describe(ddp_model) -> str:
    """``DistributedDataParallel(Sequential, 2,177 parameters)``: the wrapped module's
    class and parameter count, as messages name a model."""
    module = getattr(ddp_model, "module", ddp_model)
    count = sum(p.numel() for p in module.parameters())
    return f"{type(ddp_model).__name__}({type(module).__name__}, {count:,} parameters)"

