"""One window of training steps recorded with torch.profiler, for ``step_split``.

The window records CUDA activity only (kernels, copies and the runtime calls that launched
them): recording operators on the CPU as well slows the host enough to change what a
host-bound step looks like. It marks each iteration on the training stream with a marker
kernel (``step_split.MARKER``) twice: after the backward's last kernel and at the end of
the optimizer step. The first is queued from the backward itself (an engine callback that
a pre-hook on the root's ``grad_fn`` queues before the backward runs, so it runs before any
callback queued later: DDP's finalize, the data-parallel mode's flush), the second by
whoever sees the step end (``step_ended``). Outside a window nothing is hooked or launched.

Usage (the step's owner calls these three; ``commsched floor``'s worker does)::

    window = ProfiledWindow(iters=3, trace_path="hook.json.gz")
    window.start()                          # after a step, the device synchronised
    # per step: window.backward_started(loss) before loss.backward(), window.step_ended()
    figures = window.stop()                 # after the last step: step_split.window_figures
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Optional

from .errors import TelemetryError
from .step_split import MARKER, window_figures
from .timeline import load_complete, split_trace

__all__ = ["ProfiledWindow", "unavailable_reason", "NO_DEVICE_ACTIVITY"]

# The window was recorded, and the steps in it launched nothing on the device beyond the
# markers (no kernel, copy or memset): nothing to read, rather than a window not recorded.
NO_DEVICE_ACTIVITY = "not measured: the window ran no device activity"


def unavailable_reason() -> Optional[str]:
    """Why a window cannot be recorded in this process (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "not measured: no CUDA timing on this device"
    try:
        if torch.autograd.profiler._is_profiler_enabled:
            return "not measured: the script runs its own profiler"
    except AttributeError:      # (a torch without the flag: start() finds out)
        pass
    return None


def _mark() -> None:
    import torch

    torch.cuda._sleep(0)


def _queue_mark(grad_outputs):
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(_mark)
    return None


class ProfiledWindow:
    """``iters`` steps under torch.profiler with the markers ``step_split`` reads; the
    trace goes to ``trace_path`` (kept) or a temporary file (removed)."""

    __slots__ = ("iters", "trace_path", "profiler", "active", "reason")

    def __init__(self, iters: int, trace_path: Optional[str] = None):
        if iters < 1:
            raise TelemetryError(f"ProfiledWindow: iters must be at least 1, not {iters}")
        self.iters = iters
        self.trace_path = trace_path
        self.profiler = None
        self.active = False
        self.reason: Optional[str] = unavailable_reason()

    def start(self) -> bool:
        """Start recording (the device is synchronised first); False, with ``reason`` set,
        where it cannot."""
        if self.reason is not None:
            return False
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        profiler = profile(activities=[ProfilerActivity.CUDA])
        try:
            profiler.__enter__()
        except RuntimeError as exc:     # another profiler is running
            self.reason = f"not measured: torch.profiler could not start ({exc})"
            return False
        self.profiler, self.active = profiler, True
        return True

    def backward_started(self, tensors) -> None:
        """Before a backward from ``tensors`` (a tensor or a sequence of them): queue the
        marker that runs after its last kernel."""
        if not self.active:
            return
        roots = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
        for t in roots:
            node = getattr(t, "grad_fn", None)
            if node is not None:
                node.register_prehook(_queue_mark)
                return

    def step_ended(self) -> None:
        """At the end of an optimizer step: the step-end marker."""
        if self.active:
            _mark()

    def stop(self) -> Optional[Dict[str, object]]:
        """Stop recording (the device synchronised first) and read the window; None, with
        ``reason`` set, where nothing was recorded."""
        if not self.active:
            return None
        import torch

        torch.cuda.synchronize()
        self.active = False
        self.profiler.__exit__(None, None, None)
        path = self.trace_path
        if path is None:
            fd, path = tempfile.mkstemp(prefix="commsched-window-", suffix=".json")
            os.close(fd)
        try:
            self.profiler.export_chrome_trace(path)
            events, calls = split_trace(load_complete(path))
        finally:
            self.profiler = None
            if self.trace_path is None:
                os.unlink(path)
        if all(MARKER in e["name"] for e in events):
            self.reason = NO_DEVICE_ACTIVITY
            return None
        return window_figures(events, calls, self.iters)
