"""What the public entry points check of their arguments before anything is applied, and
which settings cannot work together.

Every rule here answers bad input with one :class:`commsched.CommschedError` (or one
:class:`commsched.CommschedWarning` for a setting without effect) that names the argument
or variable and the rule: never a builtin exception from deep inside, never a setting
silently not applied. ``commsched env`` runs the same combination rules as ``wrap``, so a
combination that ``wrap`` refuses does not pass it.
"""

from __future__ import annotations

import warnings
from typing import List, Optional

from .config import Config, ConfigError
from .errors import CommschedWarning, UnavailableError, UnsupportedError

__all__ = ["IneffectiveSettingWarning", "require_config", "require_instance", "require_module",
           "require_optimizer", "require_group", "require_observer", "data_parallel_conflicts",
           "ineffective_settings", "warn_ineffective"]


class IneffectiveSettingWarning(CommschedWarning):
    """A setting was given that the combination in force makes without effect."""


def _kind(obj) -> str:
    return "None" if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def require_config(config, where: str) -> Optional[Config]:
    """``config`` where it is a :class:`commsched.Config` or None; else a ``ConfigError``
    (a dict of settings is the usual mistake: ``Config(**settings)`` builds one)."""
    if config is None or isinstance(config, Config):
        return config
    raise ConfigError(f"{where}: config={_kind(config)}: expected a commsched.Config or None "
                      f"(Config(**settings) or Config.from_env())")


def require_instance(value, kind: type, name: str, where: str) -> None:
    """``value`` must be None or a ``kind``."""
    if value is not None and not isinstance(value, kind):
        raise UnsupportedError(f"{where}: {name}={_kind(value)}: expected a "
                               f"{kind.__module__}.{kind.__qualname__} or None")


def require_module(model, where: str, name: str = "model") -> None:
    """``model`` (the argument ``name``) must be a ``torch.nn.Module``."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UnsupportedError(f"{where}: {name}={_kind(model)}: expected a torch.nn.Module")


def require_optimizer(optimizer, model, where: str) -> None:
    """``optimizer`` must be a ``torch.optim.Optimizer`` whose parameters are all
    ``model``'s: an optimizer built on other parameters would never update the model."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedError(f"{where}: optimizer={_kind(optimizer)}: expected a "
                               f"torch.optim.Optimizer over the model's parameters")
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise UnsupportedError(
            f"{where}: optimizer holds {foreign} parameter(s) that are not the model's: "
            f"build it on this model's parameters (optimizer(model.parameters())), or the "
            f"model would never be updated")


def require_observer(observer, where: str) -> None:
    """``observer`` (None: none) must be a lane ``Extension`` or have ``on_chunks`` and
    ``on_iteration`` (``commsched.observer.as_extension``): checked here, since the first
    call comes from a completion thread, far from the cause."""
    from .observer import Extension

    if observer is None or isinstance(observer, Extension):
        return
    missing = [name for name in ("on_chunks", "on_iteration")
               if not callable(getattr(observer, name, None))]
    if missing:
        raise UnsupportedError(f"{where}: observer={_kind(observer)}: expected an object with "
                               f"on_chunks and on_iteration (a telemetry recorder, an "
                               f"Observer); it has no {' or '.join(missing)}")


def require_group(group, where: str) -> None:
    """``group`` (None: the default group) must be a process group this process is still
    part of: a destroyed one fails only at the first collective, far from the cause."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UnavailableError(f"{where}: torch.distributed is not initialized (or its "
                               f"process group was destroyed): call "
                               f"dist.init_process_group() first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise UnsupportedError(f"{where}: group={_kind(group)}: expected a "
                               f"torch.distributed.ProcessGroup (dist.new_group()) or None")
    try:
        dist.get_rank(group)
        dist.get_world_size(group)
    except (ValueError, RuntimeError) as exc:
        raise UnavailableError(f"{where}: process group {group!r} cannot be used (destroyed, "
                               f"or not of this process): {exc}") from None


def data_parallel_conflicts(config: Config) -> List[str]:
    """The combinations of ``config`` that ``commsched.wrap`` refuses (its engine checks them
    again with the arguments it is given), one line each naming the variables."""
    out = []
    if config.decompose in ("hier", "leader"):
        out.append(f"COMMSCHED_DECOMPOSE={config.decompose} is not available in the "
                   f"data-parallel mode (commsched.wrap): use none, auto or rs_ag")
    if config.decompose == "rs_ag" and config.grad_reduce_dtype is not None:
        out.append(f"COMMSCHED_GRAD_REDUCE_DTYPE={config.grad_reduce_dtype} needs "
                   f"COMMSCHED_DECOMPOSE=none in the data-parallel mode (commsched.wrap), "
                   f"not rs_ag")
    return out


def ineffective_settings(config: Config) -> List[str]:
    """The settings of ``config`` that the data-parallel mode would not apply, one line
    each naming the variable and what overrides it."""
    if not config.groups_in_flight:
        return []
    why = []
    if config.credit_bytes:
        why.append("COMMSCHED_CREDIT_BYTES sets a byte window")
    if config.decompose == "rs_ag":
        why.append("COMMSCHED_DECOMPOSE=rs_ag windows no whole all-reduces")
    if config.autotune:
        why.append("COMMSCHED_AUTOTUNE=1 tunes the window")
    if not why:
        return []
    return [f"COMMSCHED_GROUPS_IN_FLIGHT={config.groups_in_flight} has no effect: "
            f"{'; '.join(why)}"]


def warn_ineffective(config: Config, where: str, stacklevel: int = 2) -> None:
    """One warning for the settings of ``config`` that ``where`` does not apply."""
    lines = ineffective_settings(config)
    if lines:
        warnings.warn(f"{where}: {'; '.join(lines)}", IneffectiveSettingWarning,
                      stacklevel=stacklevel + 1)
