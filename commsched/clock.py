"""Device time on the host clock: :class:`EventClock` maps timed CUDA events of one device
onto ``time.time_ns()`` without a wait on the calling thread.

The scheduler times its collectives with it (completion.py), the telemetry writer the end
of each iteration's backward (telemetry/device_clock.py).
"""

from __future__ import annotations

import math
import time
from typing import List, Optional, Sequence, Tuple

__all__ = ["EventClock"]


class EventClock:
    """Maps timed CUDA events of one device onto ``time.time_ns()`` without a wait on the
    calling thread: each event's elapsed time from an anchor, a timed event recorded on an
    idle stream whose host time was read as it completed. :meth:`refresh` waits for a new
    anchor (spinning, for the host time to be close): the first mapping, then, every
    ``REFRESH_S``, a thread that may block for a moment (the lane's watchdog where the
    caller maps, else the completion thread itself). The device's timer and the host clock
    drift apart slowly: mapped times are as close to the host clock as the anchor is
    young; durations, differences of one device's events, do not drift. A young anchor
    also keeps elapsed times short enough for their float32 milliseconds to resolve a
    microsecond.

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
