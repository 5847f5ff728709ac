"""Dispatch plans: the order in which one iteration's chunks are handed to the network.

A plan is built from rank-invariant inputs only — the request layout (keys, sizes, chunk
counts, priorities: identical on every rank because every rank submits the same requests in
the same order) and a readiness profile that all ranks reduce with MAX at an iteration
boundary — so every rank builds the same plan (invariant 1). At run time a lane dispatches
``plan.order[i]`` as soon as its request was submitted and credit allows; it never looks at
which other chunks happen to be ready, which is what differs between ranks.

The plan itself is what a priority scheduler would do if it could see the future: a
discrete-event replay of the profiled iteration in which, whenever credit frees, the ready
chunk with the most urgent priority goes next.

  time ─►    b3 ready   b2 ready        b1 ready  b0 ready (priority 0 = first layer)
  link:      [b3.0][b3.1]    [b2.0][b2.1]   [b1.0][b0.0][b1.1][b0.1]...
                                             └ b0 overtakes b1's queued chunks
"""

from __future__ import annotations

import heapq
from typing import Dict, Hashable, List, NamedTuple, Sequence, Tuple

__all__ = ["RequestProfile", "Plan", "build_plan", "LinkCost"]


class RequestProfile(NamedTuple):
    key: Hashable
    priority: int              # lower = needed earlier by the next forward
    ready_s: float             # readiness, seconds after the iteration's first submission
    chunk_bytes: Tuple[int, ...]


class Plan(NamedTuple):
    order: Tuple[Tuple[Hashable, int], ...]    # (request key, chunk index), dispatch order
    layout: Dict[Hashable, int]                # request key -> number of chunks planned for


class LinkCost:
    """The replay's cost per byte, from the collectives a lane completed: the time the link
    was busy with them over their bytes.

    A collective is timed from when it could start (its device start where timing events
    exist, else its dispatch) or the end of the one before it on the lane, whichever is
    later, to its end. Timing it from its dispatch instead would count the time it queued
    behind the collectives issued before it: with k collectives in flight the link would
    look about k times slower than it is, and a plan built on that defers early-ready
    chunks for urgent ones that in fact arrive after the link went idle.
    """

    __slots__ = ("busy_ns", "nbytes", "last_end_ns")

    def __init__(self) -> None:
        self.busy_ns = 0
        self.nbytes = 0
        self.last_end_ns = 0

    def add(self, t_begin_ns: int, t_end_ns: int, nbytes: int = 0) -> None:
        """One collective step, in issue order; ``nbytes`` counted once per chunk."""
        begin = max(t_begin_ns, self.last_end_ns)
        if t_end_ns > begin:
            self.busy_ns += t_end_ns - begin
            self.last_end_ns = t_end_ns
        self.nbytes += nbytes

    @property
    def seconds_per_byte(self) -> float:
        return self.busy_ns * 1e-9 / self.nbytes if self.nbytes else 0.0


def build_plan(requests: Sequence[RequestProfile], credit_bytes: int,
               seconds_per_byte: float, seconds_per_chunk: float = 0.0) -> Plan:
    """Replay ``requests`` on one link under a credit window of ``credit_bytes`` (0 =
    unbounded) with a cost of ``seconds_per_chunk + nbytes * seconds_per_byte`` per chunk,
    dispatching the most urgent ready chunk whenever credit allows.

    Ties go to the earlier submission, then the lower chunk index, so the result is a pure
    function of the arguments.
    """
    arrivals = sorted(range(len(requests)), key=lambda i: (requests[i].ready_s, i))
    total = sum(len(r.chunk_bytes) for r in requests)
    ready: List[Tuple[int, int, int]] = []       # (priority, submission index, chunk index)
    in_flight: List[Tuple[float, int]] = []      # (finish time, bytes)
    in_flight_bytes = 0
    order: List[Tuple[Hashable, int]] = []
    now = link_free = 0.0
    next_arrival = 0
    while len(order) < total:
        while in_flight and in_flight[0][0] <= now:
            in_flight_bytes -= heapq.heappop(in_flight)[1]
        while next_arrival < len(arrivals) and requests[arrivals[next_arrival]].ready_s <= now:
            i = arrivals[next_arrival]
            for c in range(len(requests[i].chunk_bytes)):
                heapq.heappush(ready, (requests[i].priority, i, c))
            next_arrival += 1
        while ready:
            _, i, c = ready[0]
            nbytes = requests[i].chunk_bytes[c]
            if credit_bytes and in_flight_bytes and in_flight_bytes + nbytes > credit_bytes:
                break
            heapq.heappop(ready)
            link_free = max(now, link_free) + seconds_per_chunk + nbytes * seconds_per_byte
            heapq.heappush(in_flight, (link_free, nbytes))
            in_flight_bytes += nbytes
            order.append((requests[i].key, c))
        events = [in_flight[0][0]] if in_flight else []
        if next_arrival < len(arrivals):
            events.append(requests[arrivals[next_arrival]].ready_s)
        if not events:
            break
        now = max(now, min(events))
    return Plan(tuple(order), {r.key: len(r.chunk_bytes) for r in requests})
