"""The DDP hook under the launcher (``python -m commsched.run`` with ``COMMSCHED=1``): every
DistributedDataParallel the script builds gets the commsched hook, and a comm hook the
script registers itself is handled on purpose.

The hook goes on at the model's first forward rather than in its constructor, so that a
hook the script registers in between is seen first:

- PyTorch's ``allreduce_hook`` (or the built-in ALLREDUCE) over the model's own process
  group: commsched's hook does the same job (it averages over that group) and is
  registered in its place, with a notice;
- any other hook: it stays, and commsched leaves that model alone, with one warning naming
  the hook;
- ``commsched.hooks.register`` called by the script: that registration stands.

A hook the script registers after the model's first forward meets commsched's:
``allreduce_hook`` is dropped as above, any other is a :class:`HookConflictError` that
says how to keep it. Nothing here runs per iteration: the forward pre-hook removes itself
at the first forward.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from commsched import notices
from commsched.config import Config
from commsched.errors import CommschedWarning
from commsched.safety import agreement_timeout, check_agreement
from commsched.version import __version__

from .ddp import (CommschedState, HookConflictError, bad_state, commsched_hook, describe,
                  register, registered_state)

__all__ = ["install"]

_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_announced = False          # the start-up line was printed


class _Launched:
    """What the launcher knows of one model: its config, the pending first-forward hook,
    and whether the model has commsched's hook or was left alone."""

    __slots__ = ("config", "pending", "state", "left_alone")

    def __init__(self, config: Config):
        self.config = config
        self.pending = None
        self.state = None
        self.left_alone: Optional[str] = None


def install(config: Config) -> None:
    """Put the commsched hook on every DistributedDataParallel constructed from now on (at
    its first forward), as the module docstring says."""
    ddp = torch.nn.parallel.DistributedDataParallel
    original_init = ddp.__init__
    original_register = ddp.register_comm_hook
    original_builtin = ddp._register_builtin_comm_hook

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        launched = _models[self] = _Launched(config)
        launched.pending = self.register_forward_pre_hook(_first_forward)

    def register_comm_hook(self, state, hook):
        launched = _models.get(self)
        if launched is None or launched.left_alone is not None:
            return original_register(self, state, hook)
        if hook is commsched_hook:
            if not isinstance(state, CommschedState):
                raise bad_state(state)
            original_register(self, state, hook)
            launched.state = state
            _announce(self, launched)
            return None
        return _scripts_hook(self, launched, getattr(hook, "__qualname__", repr(hook)),
                             _averages_over_own_group(self, state, hook),
                             lambda: original_register(self, state, hook))

    def _register_builtin_comm_hook(self, comm_hook_type):
        launched = _models.get(self)
        if launched is None or launched.left_alone is not None:
            return original_builtin(self, comm_hook_type)
        return _scripts_hook(self, launched, str(comm_hook_type),
                             comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE,
                             lambda: original_builtin(self, comm_hook_type))

    for name, function, original in (
            ("__init__", __init__, original_init),
            ("register_comm_hook", register_comm_hook, original_register),
            ("_register_builtin_comm_hook", _register_builtin_comm_hook, original_builtin)):
        function.__wrapped__ = original
        setattr(ddp, name, function)


def _first_forward(model, args) -> None:
    launched = _models.get(model)
    if launched is None:
        return
    launched.pending.remove()
    launched.pending = None
    if launched.left_alone is None and registered_state(model) is None:
        register(model, launched.config)


def _scripts_hook(model, launched: _Launched, name: str, same_job: bool, register_it):
    """The script registers hook ``name`` on ``model``: drop it where commsched's hook does
    the same job, else keep it and leave the model alone (or refuse, once commsched's hook
    is on)."""
    what = describe(model)
    if same_job:
        notices.say(f"{what}: the script's {name} averages over the model's process group, "
                    f"as commsched's hook does, which takes its place")
        return None
    if launched.state is not None:
        raise HookConflictError(
            f"{what}: the script registers the comm hook {name} after the model's first "
            f"forward, where the launcher (COMMSCHED=1) registered commsched's, and DDP takes "
            f"one hook per model: register {name} before the first forward to keep it "
            f"(commsched then leaves the model alone), or run without COMMSCHED=1")
    result = register_it()
    launched.left_alone = name
    if launched.pending is not None:
        launched.pending.remove()
        launched.pending = None
    if notices.is_rank0():
        warnings.warn(f"commsched: {what} has its own comm hook {name}; commsched leaves this "
                      f"model alone (its gradients are not scheduled)", CommschedWarning,
                      stacklevel=3)
    return result


def _averages_over_own_group(model, state, hook) -> bool:
    """Whether ``hook`` with ``state`` is PyTorch's allreduce_hook over the model's own
    process group (``state`` None: the default group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook is not default_hooks.allreduce_hook:
        return False
    group = state if state is not None else dist.group.WORLD
    return group == model.process_group


def _announce(model, launched: _Launched) -> None:
    """Every rank of the model's group says that it has commsched's hook (a store
    exchange, bounded as the agreement check is: a rank a framework started without
    commsched is an error naming it, not a hang); then the start-up line at the first
    model that got the hook, with the number of ranks, a notice for each later one."""
    global _announced
    what = f"the DDP hook on {describe(model)}"
    ranks = check_agreement({"commsched version": __version__}, model.process_group,
                            what=f"the launcher's hook on {describe(model)}",
                            timeout_s=agreement_timeout(launched.config.timeout_s))
    if _announced:
        notices.say(what.replace("the DDP hook on", "the DDP hook also on", 1))
        return
    _announced = True
    what += f" on all {len(ranks)} ranks" if len(ranks) > 1 else " on its one rank"
    recorder = getattr(launched.state, "recorder", None)
    telemetry = (os.path.dirname(recorder.path)
                 if recorder is not None and recorder.enabled else None)
    notices.started(what, launched.config, telemetry)
