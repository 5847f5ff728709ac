"""``commsched.wrap`` / ``commsched.drain``: the model and optimizer wrappers of the
data-parallel mode.

    model, optimizer = commsched.wrap(model, optimizer)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()          # gradients go to the scheduler as layer groups complete
        optimizer.step()         # records the step; returns at once
        optimizer.zero_grad()    # deferred per layer group until its update ran (so is
                                 # model.zero_grad(), of the wrapped or the plain model)
    commsched.drain(model)       # before evaluation on raw parameters, checkpoints, exit

The next forward starts while the last layer groups are still communicating; each module
waits (in a forward pre-hook) only for its own group's request and update.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Optional, Tuple

import torch

from commsched.config import Config, ConfigError
from commsched.errors import UnsupportedError
from commsched.inputs import (require_config, require_group, require_instance,
                              require_module, require_observer, require_optimizer,
                              warn_ineffective)
from commsched.scheduler import Scheduler

from .engine import DataParallelEngine

__all__ = ["DataParallelModel", "DataParallelOptimizer", "wrap", "drain"]


class DataParallelModel(torch.nn.Module):
    """The wrapped model: ``forward`` runs ``module``; the synchronisation lives in hooks
    that the data-parallel mode installed on ``module``'s submodules and parameters.

    Like DDP: ``.module`` is the original model, ``state_dict()`` keys start with
    ``module.``, and ``no_sync()`` accumulates gradients locally.

    Example::
        model, optimizer = commsched.wrap(model, optimizer)
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, module: torch.nn.Module, engine: DataParallelEngine):
        super().__init__()
        self.module = module
        self._engine = engine
        self._no_sync = False

    def forward(self, *args, **kwargs):
        self._engine.before_forward(not self._no_sync)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this context accumulate gradients locally,
        without communication; the first forward/backward outside it synchronises the sum.

        Example::
            with model.no_sync():
                model(x0).sum().backward()
            model(x1).sum().backward(); optimizer.step()
        """
        old = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's ``zero_grad()`` for every parameter of the model, per layer group
        once its pending update ran, as ``optimizer.zero_grad()`` is: the updates still
        pending read their gradients first. So is ``zero_grad()`` of the model passed to
        ``wrap`` (unless its class defines its own)."""
        self._engine.zero_grad(set_to_none, every=True)

    def drain(self) -> None:
        """Complete all outstanding communication and optimizer updates."""
        self._engine.drain()

    def close(self) -> None:
        """Drain, remove the data-parallel mode's hooks and stop its scheduler threads: for
        a model that stays referenced but is done with (dropping the model and its
        optimizer does the same, without the drain)."""
        self._engine.close()


class DataParallelOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer: ``step()`` records the step (the hyper-parameters in force
    now) and returns; each layer group is updated by the real optimizer once its gradients
    arrived. ``param_groups`` and ``state`` are the real optimizer's, so LR schedulers and
    GradScaler work on it as usual.

    Example::
        model, optimizer = commsched.wrap(model, torch.optim.AdamW(model.parameters()))
        sched = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    """

    # GradScaler then unscales through param_groups (which the data-parallel mode notices, waiting
    # for the gradients) instead of handing grad_scale/found_inf to step().
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, engine: DataParallelEngine):
        # Optimizer.__init__ is not called: it would copy the param groups, and these must
        # stay the wrapped optimizer's own.
        self.optimizer = optimizer
        self._engine = engine
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure=None, **kwargs):
        """Record a step with the current hyper-parameters; returns without waiting."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step(kwargs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, per layer group once its pending update ran."""
        self._engine.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """Drain, then the real optimizer's state dict (rs_ag: this rank's shard)."""
        return self._engine.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._engine.load_optimizer_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self._engine.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DataParallelOptimizer({self.optimizer!r})"


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         config: Optional[Config] = None, group=None, *, group_bytes: Optional[int] = None,
         reads_grads: bool = False, broadcast_buffers: bool = True, scheduler=None,
         observer=None) -> Tuple[DataParallelModel, DataParallelOptimizer]:
    """Data-parallel training whose gradient communication overlaps the next forward.

    Replaces ``DistributedDataParallel(model)`` in an unchanged training loop. Collective
    over ``group`` (default: the world): every rank must call it, with the same model
    structure. Parameters and buffers are broadcast from the group's rank 0. ``model`` (and
    every module in it) must not be under another ``wrap`` still alive, and ``optimizer``
    must hold the model's parameters only.

    ``config`` defaults to ``Config.from_env()``; ``config.decompose == "rs_ag"`` selects
    the ZeRO-1 variant (reduce-scatter, sharded optimizer state, all-gather of parameters
    in the next forward); ``none`` and ``auto`` all-reduce; ``hier`` and ``leader`` are
    rejected (they are the DDP hook's and Megatron's). ``group_bytes``: a layer group is
    closed at a module boundary once it holds this many gradient bytes (default
    ``config.group_bytes``, ``COMMSCHED_GROUP_BYTES``; 0: one group per module). ``reads_grads``:
    the loop reads gradients between backward() and step() (gradient clipping, GradScaler);
    backward then waits for its communication, as DDP's does. ``broadcast_buffers``: as in
    DDP, buffers are broadcast from rank 0 at every training forward. ``scheduler`` /
    ``observer``: use this scheduler, or give a new one this telemetry observer.

    Example::
        model, optimizer = commsched.wrap(model, torch.optim.AdamW(model.parameters()))
        model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()
    """
    require_module(model, "commsched.wrap")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedError("commsched.wrap: pass the plain model, not a "
                               "DistributedDataParallel")
    if isinstance(model, DataParallelModel) or isinstance(optimizer, DataParallelOptimizer):
        raise UnsupportedError("commsched.wrap: model or optimizer is already wrapped")
    _refuse_owned(model)
    require_optimizer(optimizer, model, "commsched.wrap")
    config = require_config(config, "commsched.wrap")
    config = config if config is not None else Config.from_env()
    require_group(group, "commsched.wrap")
    require_instance(scheduler, Scheduler, "scheduler", "commsched.wrap")
    require_observer(observer, "commsched.wrap")
    if config.decompose in ("hier", "leader"):
        raise ConfigError(
            f"commsched.wrap: decompose={config.decompose!r} (COMMSCHED_DECOMPOSE) is not "
            "available in the data-parallel mode, which all-reduces on its own process "
            "group: use none, auto (= none here) or rs_ag (ZeRO-1)")
    if group_bytes is not None and (isinstance(group_bytes, bool)
                                    or not isinstance(group_bytes, int) or group_bytes < 0):
        raise ConfigError(f"commsched.wrap: group_bytes={group_bytes!r}: expected an int >= 0 "
                          "(bytes of gradients per layer group; 0: one group per module)")
    warn_ineffective(config, "commsched.wrap")
    kwargs = dict(group_bytes=group_bytes, reads_grads=reads_grads,
                  broadcast_buffers=broadcast_buffers, scheduler=scheduler, observer=observer)
    if config.decompose == "rs_ag":
        from .zero import ZeroEngine
        engine = ZeroEngine(model, optimizer, config, group, **kwargs)
    else:
        engine = DataParallelEngine(model, optimizer, config, group, **kwargs)
    wrapped = DataParallelModel(model, engine)
    # state_dict() of the model (or of the original module) sees updated parameters;
    # load_state_dict() is not overwritten by an update still pending.
    engine._hooks.append(model.register_state_dict_pre_hook(
        lambda module, prefix, keep_vars: engine.drain()))
    engine._hooks.append(model.register_load_state_dict_pre_hook(
        lambda module, *args: engine.drain()))
    engine.route_zero_grad()
    wrapped_optimizer = DataParallelOptimizer(optimizer, engine)
    _release_when_dropped(engine, wrapped, wrapped_optimizer)
    owner = weakref.ref(engine)
    for module in model.modules():
        _OWNED[module] = owner
    return wrapped, wrapped_optimizer


# Every module under a live wrap, and its engine: a second wrap of one of them would install
# a second set of hooks beside the first's, and the two engines' collectives would pair
# differently on different ranks.
_OWNED: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _refuse_owned(model: torch.nn.Module) -> None:
    for module in model.modules():
        owner = _OWNED.get(module)
        engine = owner() if owner is not None else None
        if engine is not None and not engine.closed:
            what = "the model" if module is model else f"its submodule {type(module).__name__}"
            raise UnsupportedError(
                f"commsched.wrap: {what} is already under an earlier commsched.wrap that is "
                f"still alive: train through the model that wrap returned, or call its "
                f"close() (or drop it and its optimizer) before wrapping again")


class _Owners:
    """What ``wrap`` returned, counted: the engine is released (``DataParallelEngine.release``)
    once the user dropped both."""

    __slots__ = ("engine", "left")

    def __init__(self, engine: DataParallelEngine, left: int):
        self.engine, self.left = engine, left

    def dropped(self) -> None:
        self.left -= 1
        if self.left == 0:
            engine, self.engine = self.engine, None
            engine.release()


def _release_when_dropped(engine: DataParallelEngine, *owners) -> None:
    """Release ``engine`` once every one of ``owners`` was dropped, as dropping a DDP model
    frees it: the model, its optimizer state and the scheduler's threads go with them,
    with no ``close()`` needed. No collective runs then (a rank may drop its model at
    another point than the others); what was issued completes."""
    counter = _Owners(engine, len(owners))
    for owner in owners:
        weakref.finalize(owner, counter.dropped).atexit = False


def drain(obj) -> None:
    """Complete all outstanding gradient communication and optimizer updates of a model
    (or optimizer) returned by :func:`wrap`: call before evaluating or checkpointing
    outside a forward, and at the end of training. With ``rs_ag`` it all-gathers the
    updated parameters, a collective: call it on every rank of the group.

    Example::
        model, optimizer = commsched.wrap(model, optimizer)
        ...; commsched.drain(model); torch.save(model.module.state_dict(), path)
    """
    engine = getattr(obj, "_engine", None)
    if not isinstance(engine, DataParallelEngine):
        raise UnsupportedError(f"commsched.drain: expected a model or optimizer returned by "
                               f"commsched.wrap, got {type(obj).__name__}")
    engine.drain()
