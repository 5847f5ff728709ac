"""When the device got to a point of a CUDA stream, on the host clock.

The host records a timed event where an iteration's backward ends (its flush). Where the
host runs ahead of a busy GPU, the device gets there long after the host did, and the host
time would count the rest of the device's backward as communication left exposed. The
writer thread asks :class:`DeviceClock` for the device time instead, once the event
completed: against an event recorded then on an idle stream of the same device (which
completes at once), as the scheduler times its collectives.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

from ..observer import DeviceMark

__all__ = ["DeviceClock"]


class DeviceClock:
    """Maps :class:`~commsched.observer.DeviceMark` events onto ``time.time_ns()``. Used by
    one thread (the telemetry writer); one idle stream and event per device."""

    def __init__(self) -> None:
        self._clocks: Dict[object, tuple] = {}

    def host_ns(self, mark: DeviceMark) -> Tuple[bool, Optional[int]]:
        """``(False, None)`` while the device has not got to ``mark``; then ``(True, t)``,
        ``t`` the host-clock time it got there, or ``(True, None)`` where the event cannot
        be timed (a CUDA error)."""
        import torch

        try:
            if not mark.event.query():
                return False, None
            clock = self._clocks.get(mark.device)
            if clock is None:
                clock = (torch.cuda.Stream(mark.device),
                         torch.cuda.Event(enable_timing=True, blocking=True))
                self._clocks[mark.device] = clock
            stream, now = clock
            now.record(stream)
            now.synchronize()
            t_now = time.time_ns()
            return True, t_now - int(mark.event.elapsed_time(now) * 1e6)
        except RuntimeError:
            return True, None
