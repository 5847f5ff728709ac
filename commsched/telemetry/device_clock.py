"""When the device got to a point of a CUDA stream, on the host clock.

The host records a timed event where an iteration's backward ends (its flush). Where the
host runs ahead of a busy GPU, the device gets there long after the host did, and the host
time would count the rest of the device's backward as communication left exposed. The
writer thread asks :class:`DeviceClock` for the device time instead, once the event
completed. Both it and the scheduler, which times its collectives, map events with an
:class:`EventClock`: against an anchor, an event recorded on an idle stream of the same
device (which completes at once) whose host time was read as it completed.
"""

from __future__ import annotations

import time  # noqa: F401 (tests set the host clock through this module)
from typing import Dict, Optional, Tuple

from ..clock import EventClock
from ..observer import DeviceMark

__all__ = ["DeviceClock", "EventClock"]


class DeviceClock:
    """Maps :class:`~commsched.observer.DeviceMark` events onto ``time.time_ns()``. Used by
    one thread (the telemetry writer), which may wait: an :class:`EventClock` per device,
    its anchor renewed here once older than ``EventClock.REFRESH_S``."""

    def __init__(self) -> None:
        self._clocks: Dict[object, EventClock] = {}

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
                clock = self._clocks[mark.device] = EventClock(torch.cuda.Stream(mark.device))
            if clock.age_s() > EventClock.REFRESH_S:
                clock.refresh()
            return True, clock.host_times_ns([mark.event])[0]
        except RuntimeError:
            return True, None
