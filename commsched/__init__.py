"""commsched: a priority/credit communication scheduler for PyTorch training.

Gradient communication from DDP (``commsched.hooks``) and Megatron-core
(``commsched.megatron_patches``) goes through one ``Scheduler`` that partitions tensors into
chunks, orders them by priority under a credit window of bytes in flight, decomposes
collectives, and reports what ran to telemetry.
"""

import importlib

from .config import Config, ConfigError
from .errors import CommschedError, CommschedWarning
from .scheduler import Request, Scheduler, SchedulerError
from .version import __version__


__all__ = ["Config", "ConfigError", "CommschedError", "CommschedWarning", "Scheduler",
           "Request", "SchedulerError", "step", "wrap", "drain", "hooks", "megatron_patches",
           "__version__"]


def __getattr__(name):
    # The data-parallel mode and the adapters are imported on first use: ``import
    # commsched`` stays light for the DDP hook and the launcher.
    if name in ("wrap", "drain"):
        from . import data_parallel

        return getattr(data_parallel, name)
    # (import_module, not `from . import`: that asks this function for the name first)
    if name == "hooks":
        return importlib.import_module("commsched.hooks")
    if name == "megatron_patches":
        return importlib.import_module("commsched.megatron_patches")
    raise AttributeError(f"module 'commsched' has no attribute {name!r}")


def step() -> None:
    """Mark an iteration boundary for telemetry, for training loops whose boundaries the
    DDP hook and the launcher cannot see (no-op when telemetry is off)."""
    from .telemetry import step as _step

    _step()
