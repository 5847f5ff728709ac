"""One-line notices on stderr, from rank 0 only: what commsched did (``errors.py`` says how
it reports errors and warnings).

The rank is the default process group's once there is one, else the one its launcher set
before the script started (``RANK`` from torchrun and torch.distributed.launch, else
srun's, Open MPI's or PMI's); a process with none of these is rank 0.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["is_rank0", "say", "started"]


def is_rank0() -> bool:
    """Whether this process is rank 0 of its job (see the module docstring)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except (ImportError, RuntimeError, ValueError):
        pass
    for var in _RANK_VARS:
        if var in os.environ:
            return os.environ[var].strip() in ("", "0")
    return True


_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def say(message: str) -> None:
    """Print ``commsched: <message>`` as one line on stderr, on rank 0 only."""
    if not is_rank0():
        return
    try:
        sys.stderr.write("commsched: " + " ".join(message.split()) + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass        # stderr closed, or replaced by something that cannot write


def started(what: str, config, telemetry_dir: Optional[str] = None) -> None:
    """The start-up line: commsched's version, what it put in place (``what``), the
    settings ``config`` holds away from their defaults, and where telemetry goes."""
    from .version import __version__

    changed = [s for s in config.changed_settings()
               if not (telemetry_dir and s.startswith("COMMSCHED_TELEMETRY_DIR="))]
    line = (f"on (version {__version__}): {what}; settings: "
            f"{', '.join(changed) if changed else 'defaults'}")
    say(line + (f"; telemetry: {telemetry_dir}" if telemetry_dir else ""))
