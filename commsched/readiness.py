"""When a lane's requests were ready and when their collectives ended, on the device's
clock: what a priority plan is built from ([Note: order by the device's clock] in
docs/design.md).

In a profiled iteration each request records, on CUDA, a timed event in the submitter's
stream as it is submitted (``ready``: its producers were queued before it) and one on
the done stream after its last collective (``end``); nothing waits for them then. When a
plan is built, once per request layout, the host waits for the last of them and reads
each one relative to the iteration's first ready point. On CPU (gloo) the host's
submission times are the readiness, and the lane's completions give the link's cost.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

from .plan import RequestProfile

__all__ = ["Marks", "ProfiledRequest", "Profile", "read_profile"]


class Marks:
    """The two points of one profiled request: ``ready`` (a timed CUDA event in the
    submitter's stream, or the host's submission time in ns) and ``end`` (CUDA: an event
    after its last collective, None until it was issued). Held by the request while it
    is in flight and by its iteration's profile after; references nothing of the
    request."""

    __slots__ = ("ready", "end")

    def __init__(self, ready) -> None:
        self.ready = ready
        self.end = None


class ProfiledRequest(NamedTuple):
    key: object
    priority: int
    chunk_bytes: Tuple[int, ...]
    marks: Marks


class Profile(NamedTuple):
    """What a plan is built from, read off the profiled iterations: each request's
    readiness in the last of them (seconds after its first request was ready), the link's
    cost per byte, and the spread of the iterations' spans (first request ready to last
    collective ended; on CPU, to last request ready): how much iterations vary."""

    requests: List[RequestProfile]
    seconds_per_byte: float
    spread_s: float


def read_profile(iterations: Sequence[Sequence[ProfiledRequest]], cuda: bool,
                 host_seconds_per_byte: float = 0.0) -> Profile:
    """The profile of ``iterations`` (each one's requests in submission order, oldest
    iteration first). On CUDA the host waits here for the last end events (once per
    plan) and the link's cost is the time the link was busy over the bytes it moved: a
    collective starts once its request is ready and the one before it ended. On CPU it is
    ``host_seconds_per_byte``, the lane's own measurement of completed steps."""
    busy = nbytes = 0.0
    spans: List[float] = []
    ready: Optional[List[float]] = None
    for requests in iterations:
        times = _times(requests, cuda)
        if times is None:
            continue
        ready = [t_ready for t_ready, _ in times]
        if not cuda:
            spans.append(max(ready))
            continue
        previous = 0.0
        for (t_ready, t_end), request in sorted(zip(times, requests), key=lambda p: p[0][1]):
            start = max(t_ready, previous)
            if t_end > start:
                busy += t_end - start
                previous = t_end
            nbytes += sum(request.chunk_bytes)
        spans.append(max(t_end for _, t_end in times))
    last = iterations[-1]
    if ready is None:         # (no times: as if everything was ready together)
        ready = [0.0] * len(last)
    profile = [RequestProfile(r.key, r.priority, t, r.chunk_bytes) for r, t in zip(last, ready)]
    seconds_per_byte = (busy / nbytes if nbytes else 0.0) if cuda else host_seconds_per_byte
    return Profile(profile, seconds_per_byte, max(spans) - min(spans) if spans else 0.0)


def _times(requests: Sequence[ProfiledRequest], cuda: bool
           ) -> Optional[List[Tuple[float, Optional[float]]]]:
    """(ready, end) of each request in seconds after the first one was ready (CPU: end
    None); None where a request's end was never marked (not issued: the lane failed)."""
    marks = [r.marks for r in requests]
    if not marks:
        return None
    if not cuda:
        t0 = marks[0].ready
        return [((m.ready - t0) * 1e-9, None) for m in marks]
    if any(m.end is None for m in marks):
        return None
    for m in marks:
        m.end.synchronize()
    first = marks[0].ready
    return [(first.elapsed_time(m.ready) * 1e-3, first.elapsed_time(m.end) * 1e-3)
            for m in marks]
