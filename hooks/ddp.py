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
(measured: ``docs/design.md`` links the report). On CPU the futures resolve when the
collectives finished.

Averaging is DDP's: the bucket divided by the group size, then summed. On NCCL with a
power-of-two group the collective averages instead (``ReduceOp.AVG``: the same values,
one pass over the bucket less; see ``Scheduler.submit``).
"""

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from commsched.adapter import build_scheduler, close
from commsched.config import Config, warn_data_parallel_only
from commsched.scheduler import Scheduler

__all__ = ["CommschedState", "commsched_hook", "register"]


class CommschedState:
    """State of the commsched DDP hook: the scheduler, the process group, and the forward
    order of the model's parameters (for bucket priorities).

    Example::
        state = CommschedState(ddp_model, Config(partition_bytes=1 << 20))
        ddp_model.register_comm_hook(state, commsched_hook)
    """

    __slots__ = ("scheduler", "group", "param_position", "bucket_priority", "recorder",
                 "held")

    def __init__(self, ddp_model: torch.nn.Module, config: Optional[Config] = None,
                 group=None, scheduler: Optional[Scheduler] = None, observer=None):
        config = config if config is not None else Config.from_env()
        warn_data_parallel_only(config, "DDP hook", stacklevel=3)
        self.recorder = None
        if scheduler is None:
            scheduler, self.recorder = build_scheduler(
                config, next(ddp_model.parameters()).device, policy="priority",
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

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Wait for outstanding chunks, then stop the scheduler and the telemetry recorder."""
        close(self.scheduler, self.recorder, timeout)

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
    scheduler = state.scheduler
    tensor = bucket.buffer()
    request = scheduler.submit(tensor, key=bucket.index(), priority=state.priority(bucket),
                               group=state.group, average=True)
    work = request.issued_work()
    if work is not None:
        future = work.get_future().then(lambda _, tensor=tensor: tensor)
    else:
        future = request.future
        state.held = True
    if bucket.is_last():
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


def register(ddp_model: torch.nn.parallel.DistributedDataParallel,
             config: Optional[Config] = None, **state_kwargs) -> "CommschedState":
    """Register the commsched hook on ``ddp_model``; returns its state.

    ``config`` defaults to ``Config.from_env()``. DDP accepts one comm hook per model, so
    this cannot be combined with another hook.

    Example::
        ddp_model = DistributedDataParallel(model)
        commsched.hooks.register(ddp_model)
    """
    state = CommschedState(ddp_model, config, **state_kwargs)
    ddp_model.register_comm_hook(state, commsched_hook)
    return state

