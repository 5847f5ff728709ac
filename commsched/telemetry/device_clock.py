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

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..observer import DeviceMark

__all__ = ["DeviceClock", "EventClock"]


class EventClock:
    """Maps timed CUDA events of one device onto ``time.time_ns()`` without a wait on the
    calling thread: each event's elapsed time from an anchor, a timed event recorded on an
    idle stream whose host time was read as it completed. :meth:`refresh` waits for a new
    anchor (spinning, for the host time to be close): the first mapping, then, every
    ``REFRESH_S``, a thread that may block for a moment (the lane's watchdog where the
    caller maps, else the completion thread itself). The device's timer and the host clock
    drift apart by tens of microseconds a second
    (benchmarks/ddp_hook_overhead_2xH100_2026-11-27.md): mapped times are that close to
    the host clock; durations, differences of one device's events, do not drift. A young
    anchor also keeps elapsed times short enough for their float32 milliseconds to
    resolve a microsecond.

    Example::
        clock = EventClock(torch.cuda.Stream())
        ends = clock.host_times_ns([end_event])     # end_event timed and completed
    """

    REFRESH_S = 1.0

    __slots__ = ("stream", "anchor")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.anchor: Optional[Tuple[object, int]] = None

    def refresh(self) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        event.synchronize()
        self.anchor = (event, time.time_ns())

    def age_s(self) -> float:
        """Seconds since the anchor was read (infinite before the first)."""
        anchor = self.anchor
        return math.inf if anchor is None else (time.time_ns() - anchor[1]) * 1e-9

    def host_times_ns(self, events: Sequence) -> List[int]:
        """Host-clock times at which the device got to ``events`` (timed, completed; before
        or after the anchor). Raises RuntimeError for an event that cannot be timed."""
        anchor = self.anchor
        if anchor is None:
            self.refresh()
            anchor = self.anchor
        event, t_anchor = anchor
        return [t_anchor + int(event.elapsed_time(e) * 1e6) for e in events]


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
