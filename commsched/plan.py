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

Where the next forward consumes the requests in priority order (the data-parallel mode:
its layer groups, whole, priority = forward order), the order that ends the iteration's
communication soonest is not what matters: the next forward is. A request delivered late
costs the forward that comes after its first use. :func:`build_forward_plan` therefore
chooses the order of whole requests that minimises the modelled end of the next forward,

  end of forward = max over requests r of (r's last byte on the link + forward after r)

on one serial link (a request starts when it is ready and the link is free, in plan order),
where "forward after r" is the estimated forward compute of the layers from r's on. That
may hold a ready request back and leave the link idle. Four layer groups d (last layer) ..
a (first), 2 s each on the link, a forward of 0.5 s each (tests/test_plan.py works it out):

  ready       d at 0 s, c at 1 s, b at 2 s, a at 3 s
  greedy      d [0,2] c [2,4] b [4,6] a [6,8]    the next forward ends at 10 s
  forward     d [0,2] b [2,4] a [4,6] c [6,8]    the next forward ends at 9 s

c, ready second, waits for b and a: the forward then runs a's and b's layers under c's
collective instead of all four layers after a's.

The forward compute per request is estimated from the profile itself: the readiness gap
before each request is the backward compute that produced it, and a forward is taken as
half its backward (one matmul per two in backward); the first request's gap is not in the
profile, so its backward is estimated from its bytes at the others' time per byte. This is
scheduling with release and delivery times on one machine (1|r_j,q_j|C_max); the search is
a depth-first branch and bound over orders, exact for the few layer groups the mode uses
by default, and bounded in work beyond: it returns the best order found, never one the model
rates worse than the greedy replay's.
"""

from __future__ import annotations

import heapq
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["RequestProfile", "Plan", "build_plan", "build_forward_plan", "lane_plan",
           "LinkCost", "forward_end"]


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


# The window a lane that feeds the next forward is planned with where it has no credit
# window, in bytes: one chunk on the link at a time. Its collectives run in one stream,
# one after another, in the order they were issued; the plan chooses that order, so that
# a chunk more urgent than the queued ones goes before them with nothing held back at run
# time.
SERIAL_LINK = 1
# A layer's forward compute over its backward's: backward runs two matmuls per forward one
# (the gradients of the input and of the weight).
FORWARD_SHARE = 0.5
# The branch and bound's budget, in bound terms evaluated (a node with k requests left
# costs k * k): it returns the best order found within it, a small share of an iteration. Six layer
# groups take ~200, twenty ~10^5; a search cut short keeps the best order found so far.
SEARCH_WORK = 100_000


def lane_plan(requests: Sequence[RequestProfile], credit_bytes: int,
              seconds_per_byte: float, feeds_forward: bool = False,
              spread_s: float = 0.0) -> Plan:
    """The plan a lane builds from its profile: the greedy replay (:func:`build_plan`).

    Where the next forward consumes the requests in priority order (``feeds_forward``), a
    lane without a credit window is replayed as the serial link it is (``SERIAL_LINK``),
    so that a chunk the forward needs sooner goes before queued ones; and where every
    request goes whole, the plan is the order :func:`build_forward_plan` finds, unless the
    model rates it no more than ``spread_s`` (how much the profiled iterations varied)
    better than the order the requests were submitted in: a gain within the noise is
    none, and submission order asks nothing of timings. Elsewhere (the DDP hook, whose
    backward ends once every bucket was reduced) the order only has to keep the link busy:
    without a window, the order requests are ready in."""
    if not feeds_forward:
        return build_plan(requests, credit_bytes, seconds_per_byte)
    plan = build_plan(requests, credit_bytes or SERIAL_LINK, seconds_per_byte)
    forward = build_forward_plan(requests, seconds_per_byte, seed=plan)
    if forward is None:
        return plan
    submitted = Plan(tuple((r.key, 0) for r in requests), forward.layout)
    keys = [r.key for r in requests]
    gain = (forward_end(requests, seconds_per_byte, keys)
            - forward_end(requests, seconds_per_byte, [key for key, _ in forward.order]))
    return forward if gain > spread_s else submitted


def build_forward_plan(requests: Sequence[RequestProfile], seconds_per_byte: float,
                       seed: Optional[Plan] = None) -> Optional[Plan]:
    """The order of whole requests that minimises the modelled end of the next forward
    (see the module docstring); None where a request has several chunks.

    ``seed``: a plan of the same requests (the greedy replay's) whose order the search
    starts from, so that the result is never rated worse than it. A pure function of the
    arguments: ties keep the order found first.
    """
    if not requests or any(len(r.chunk_bytes) != 1 for r in requests):
        return None
    release, work, tail = _forward_model(requests, seconds_per_byte)
    n = len(requests)
    index = {r.key: i for i, r in enumerate(requests)}
    candidates = [_schrage(release, work, tail)]
    if seed is not None and len(seed.order) == n:
        candidates.insert(0, [index[key] for key, _ in seed.order])
    best = min(candidates, key=lambda order: _end(order, release, work, tail))
    best = _branch_and_bound(release, work, tail, best)
    return Plan(tuple((requests[i].key, 0) for i in best),
                {r.key: 1 for r in requests})


def forward_end(requests: Sequence[RequestProfile], seconds_per_byte: float,
                order: Sequence[Hashable]) -> float:
    """The modelled end of the next forward (seconds after the first request was ready)
    when whole ``requests`` go in ``order`` (their keys)."""
    release, work, tail = _forward_model(requests, seconds_per_byte)
    index = {r.key: i for i, r in enumerate(requests)}
    return _end([index[key] for key in order], release, work, tail)


def _forward_model(requests: Sequence[RequestProfile], seconds_per_byte: float):
    """Per request: when it is ready, its time on the link, and the forward compute from
    its first use to the end of the forward (the delivery time)."""
    n = len(requests)
    release = [max(0.0, r.ready_s) for r in requests]
    nbytes = [sum(r.chunk_bytes) for r in requests]
    work = [b * seconds_per_byte for b in nbytes]
    arrival = sorted(range(n), key=lambda i: (release[i], i))
    backward = [0.0] * n
    for prev, i in zip(arrival, arrival[1:]):
        backward[i] = release[i] - release[prev]
    rest_bytes = sum(nbytes[i] for i in arrival[1:])
    if rest_bytes:
        backward[arrival[0]] = nbytes[arrival[0]] * sum(backward) / rest_bytes
    forward = [FORWARD_SHARE * b for b in backward]
    tail = [sum(forward[j] for j in range(n) if requests[j].priority >= requests[i].priority)
            for i in range(n)]
    return release, work, tail


def _end(order: Sequence[int], release, work, tail) -> float:
    link = end = 0.0
    for i in order:
        link = max(link, release[i]) + work[i]
        end = max(end, link + tail[i])
    return end


def _schrage(release, work, tail) -> List[int]:
    """Whenever the link is free, the ready request with the longest forward after it (or,
    with none ready, the next to be ready): the classic list schedule."""
    left = sorted(range(len(release)), key=lambda i: (release[i], i))
    order: List[int] = []
    link = 0.0
    while left:
        now = max(link, release[left[0]])
        ready = [i for i in left if release[i] <= now]
        i = max(ready, key=lambda j: (tail[j], -j))
        left.remove(i)
        order.append(i)
        link = now + work[i]
    return order


def _branch_and_bound(release, work, tail, best: List[int]) -> List[int]:
    """Depth-first over orders, most promising request first, pruning a partial order
    whose lower bound cannot beat the best complete one, within ``SEARCH_WORK``.

    Only active orders are tried: a request is not put next if another one could run
    entirely before it starts (that one going first delays nothing; of two that take no
    time and could start together, neither is left out), and the bound of a
    partial order is the largest of its own end so far, each remaining request started as
    early as the link allows, and all remaining work back to back plus the smallest
    forward after any of it."""
    n = len(release)
    best_end = _end(best, release, work, tail)
    budget = SEARCH_WORK
    stack = [((), 0.0, 0.0)]            # (order so far, link free at, end so far)
    while stack and budget > 0:
        order, link, end = stack.pop()
        left = [i for i in range(n) if i not in order]
        budget -= len(left) * len(left)
        if not left:
            if end < best_end:
                best_end, best = end, list(order)
            continue
        finish = sorted((max(link, release[i]) + work[i], i) for i in left)
        children = []
        for i in left:
            start = max(link, release[i])
            other = finish[finish[0][1] == i] if len(finish) > 1 else None
            if other is not None and (other[0] < start
                                      or other[0] == start and work[other[1]] > 0):
                continue                 # another request fits entirely before it
            done = start + work[i]
            child_end = max(end, done + tail[i])
            rest = [j for j in left if j != i]
            bound = child_end
            if rest:
                bound = max(bound,
                            max(max(done, release[j]) + work[j] + tail[j] for j in rest),
                            max(done, min(release[j] for j in rest))
                            + sum(work[j] for j in rest) + min(tail[j] for j in rest))
            if bound < best_end:
                children.append((bound, -tail[i], i, done, child_end))
        # Pushed worst first, so the most promising child is explored next.
        for bound, _, i, done, child_end in sorted(children, reverse=True):
            stack.append((order + (i,), done, child_end))
    return best
