"""How an adapter (the DDP hook, the Megatron patches, the data-parallel mode) gets its
scheduler: its policy default, the telemetry recorder where ``Config.telemetry_dir`` asks
for one, and the extensions other settings ask for (the tuner, NVTX ranges). The scheduler
itself loads none of these ([Note: instruments outside the core] in docs/design.md).

Example::
    scheduler, recorder = build_scheduler(config, device, adapter=DDP_HOOK)
    ...
    close(scheduler, recorder)
"""

from __future__ import annotations

from typing import Optional, Tuple

from .config import Config
from .scheduler import Scheduler

__all__ = ["DDP_HOOK", "MEGATRON", "DATA_PARALLEL", "POLICY_DEFAULTS", "adapter_config",
           "build_scheduler", "close"]

DDP_HOOK, MEGATRON, DATA_PARALLEL = "DDP hook", "Megatron-LM", "data-parallel mode"

# Each adapter's order where the config leaves ``policy`` unset. Megatron-LM submits its
# bucket groups in the order its own overlap issues them ([Note: Megatron's fifo default]
# in docs/design.md); the others plan.
POLICY_DEFAULTS = {DDP_HOOK: "priority", MEGATRON: "fifo", DATA_PARALLEL: "priority"}


def adapter_config(config: Config, adapter: str) -> Config:
    """``config`` as ``adapter`` runs it: its policy default applied where unset."""
    return config.with_policy(POLICY_DEFAULTS[adapter])


def build_scheduler(config: Config, device=None, *, adapter: Optional[str] = None,
                    observer=None, trace_dispatch: bool = False, feeds_forward: bool = False
                    ) -> Tuple[Scheduler, Optional[object]]:
    """A scheduler for ``config`` as ``adapter`` runs it (``adapter_config``; None: a bare
    scheduler's own default, priority), with the instruments it asks for; returns it and
    the telemetry recorder opened for it (None where ``observer`` was given or telemetry
    is off). ``device``: this rank's device, for the recorder's NVLink counters."""
    if adapter is not None:
        config = adapter_config(config, adapter)
    recorder = None
    if observer is None and config.telemetry_dir:
        from .telemetry import open_rank_recorder

        observer = recorder = open_rank_recorder(config, device)
    extensions = []
    if config.autotune:
        from .autotune import Tuner

        extensions.append(Tuner)
    if config.nvtx:
        from .telemetry.nvtx_ranges import NvtxRanges, warn_if_unavailable

        warn_if_unavailable()
        extensions.append(NvtxRanges)
    scheduler = Scheduler(config, observer, trace_dispatch, extensions=extensions,
                          feeds_forward=feeds_forward)
    return scheduler, recorder


def close(scheduler: Scheduler, recorder=None, timeout: Optional[float] = 60.0, *,
          drain: bool = True) -> None:
    """Wait for ``scheduler``'s outstanding chunks (up to ``timeout`` s; ``drain=False``:
    no wait, as when the model was dropped), stop it (its completion threads hand the last
    chunk records to the recorder on the way out), then close ``recorder`` (if any)."""
    try:
        if drain:
            scheduler.drain(timeout)
    finally:
        scheduler.close()
        if recorder is not None:
            recorder.close()
