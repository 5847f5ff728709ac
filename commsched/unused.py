"""Nothing silent: a process where commsched was asked for, that trains but never gave
commsched anything to schedule, says so once.

"Trains" is counted in optimizer steps (torch's global optimizer step hook; once it has
decided it returns at once, and it is removed at exit, never from inside a step: torch
iterates over the global hooks while it calls them, and a hook removed there ends that
step with "OrderedDict mutated during iteration" wherever another global hook is
registered): the warning comes at the ``STEPS``-th step, or at exit where the process
took at least one step and fewer than ``STEPS``. A process that takes no optimizer step (a
data-loading worker, a launcher's parent process) says nothing. "Something to schedule"
is any scheduler made in the process (``commsched.scheduler.made_any``): a DDP model that
got the hook, megatron-core's bucket groups, the data-parallel mode. One warning per
process, from rank 0 only (``notices.is_rank0``).
"""

from __future__ import annotations

import atexit
import threading
import warnings
from typing import Optional

from . import notices
from .errors import CommschedWarning

__all__ = ["watch", "STEPS"]

STEPS = 10

_lock = threading.Lock()
_cause: Optional[str] = None      # what asked for commsched (None: not watching)
_hint: Optional[str] = None
_steps = 0
_handle = None
_decided = False


def watch(cause: str = "COMMSCHED=1", hint: Optional[str] = None) -> None:
    """Warn once, as the module docstring says, naming ``cause`` (what asked for
    commsched) and, in a distributed process, ``hint`` (why nothing may have been given).
    Idempotent: the first cause stands."""
    global _cause, _hint, _handle
    with _lock:
        if _cause is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _cause, _hint = cause, hint
        _handle = register_optimizer_step_post_hook(_after_step)
        atexit.register(_at_exit)


def _after_step(optimizer, args, kwargs) -> None:
    global _steps
    if _decided:
        return
    _steps += 1
    if _steps >= STEPS:
        _decide(f"by its {STEPS}th optimizer step")


def _at_exit() -> None:
    global _handle
    if _steps:
        _decide(f"in the {_steps} optimizer step{'s' if _steps > 1 else ''} it took")
    with _lock:
        if _handle is not None:
            _handle.remove()
            _handle = None


def _decide(when: str) -> None:
    global _decided
    from .scheduler import made_any

    with _lock:
        if _decided:
            return
        _decided = True
    if made_any() or not notices.is_rank0():
        return
    try:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
    except ImportError:
        distributed = False
    why = ((_hint or "no DistributedDataParallel model was built (nor megatron-core's bucket "
            "groups used): data parallelism of another kind?")
           if distributed else
           "torch.distributed was never initialised: it ran as a single process (`accelerate "
           "launch --cpu` runs one, whatever --num_processes says)")
    warnings.warn(f"commsched: {_cause}, but {when} this process gave commsched nothing to "
                  f"schedule: {why} (docs/integrations.md)", CommschedWarning, stacklevel=2)
