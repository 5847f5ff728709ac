"""NVTX ranges for Nsight Systems, with no cost or dependency when unavailable.

The backend is chosen on first use: ``torch.cuda.nvtx`` when CUDA is available (the ranges
then line up with the CUDA kernels in the same Nsight timeline), else the ``nvtx`` package,
else no-ops. Push/pop ranges are per thread (the scheduler's dispatch); start/end ranges may
end on another thread (iterations).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Optional

from ..errors import CommschedWarning
from ..observer import Extension

__all__ = ["nvtx_range_push", "nvtx_range_pop", "range_start", "range_end", "mark", "backend",
           "warn_if_unavailable",
           "NvtxRanges"]

_lock = threading.Lock()
_impl: Optional[dict] = None


def _noop(*_args, **_kwargs):
    return None


def _select() -> dict:
    try:
        import torch
        if torch.cuda.is_available():
            n = torch.cuda.nvtx
            return {"name": "torch.cuda.nvtx", "push": n.range_push, "pop": n.range_pop,
                    "start": n.range_start, "end": n.range_end, "mark": n.mark}
    except Exception:
        pass
    try:
        import nvtx
        return {"name": "nvtx", "push": lambda msg: nvtx.push_range(message=msg),
                "pop": nvtx.pop_range, "start": lambda msg: nvtx.start_range(message=msg),
                "end": nvtx.end_range, "mark": lambda msg: nvtx.mark(message=msg)}
    except Exception:
        pass
    return {"name": "none", "push": _noop, "pop": _noop, "start": _noop, "end": _noop,
            "mark": _noop}


def _get(op: str) -> Callable[..., Any]:
    global _impl
    if _impl is None:
        with _lock:
            if _impl is None:
                _impl = _select()
    return _impl[op]


def backend() -> str:
    """Which NVTX implementation is in use: torch.cuda.nvtx, nvtx or none."""
    _get("push")
    return _impl["name"]


def warn_if_unavailable() -> None:
    """One warning where ``COMMSCHED_NVTX=1`` can record nothing: no CUDA and no ``nvtx``
    package."""
    if backend() == "none":
        warnings.warn("COMMSCHED_NVTX=1 has no effect here: NVTX ranges need CUDA "
                      "(torch.cuda.nvtx) or the nvtx package (pip install nvtx)",
                      CommschedWarning, stacklevel=3)


def nvtx_range_push(name: str) -> None:
    """Open a range named ``name`` on the calling thread (nest with :func:`nvtx_range_pop`).

    Example::

        nvtx_range_push("commsched all_reduce bucket3[0]"); ...; nvtx_range_pop()
    """
    _get("push")(name)


def nvtx_range_pop() -> None:
    """Close the innermost range opened by :func:`nvtx_range_push` on this thread."""
    _get("pop")()


def range_start(name: str):
    """Open a range that may be closed from any thread; returns the handle for range_end."""
    return _get("start")(name)


def range_end(handle) -> None:
    if handle is not None:
        _get("end")(handle)


def mark(name: str) -> None:
    """An instantaneous marker."""
    _get("mark")(name)


class NvtxRanges(Extension):
    """A lane extension (``Config.nvtx``): an NVTX range around each collective step the
    lane issues, on the issuing thread."""

    provides = ("nvtx",)

    def __init__(self, lane=None) -> None:
        pass

    def issuing(self, name: str) -> None:
        nvtx_range_push(name)

    def issued(self) -> None:
        nvtx_range_pop()
