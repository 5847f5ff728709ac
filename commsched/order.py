"""A lane's dispatch order: its iterations, the requests submitted to them, the cursor that
says which chunk goes next, and the plan in force ([Note: every rank in step] in
docs/design.md).

Per iteration the order is: the plan's chunks whose request was submitted with the planned
chunk count, in plan order, then every other request's chunks in submission order. Without
a plan (policy fifo, or while profiling) it is submission order. Timing only decides when
the next chunk in that order goes (it waits for its request, for credit and, on backends
without stream ordering, for its previous step), never which one goes next.

Everything here is guarded by the lane's lock.
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, Hashable, List, Optional, Sequence

from .errors import SchedulerError
from .observer import DeviceMark, IterationRecord
from .plan import LinkCost, Plan, forward_end, lane_plan
from .readiness import ProfiledRequest, read_profile

__all__ = ["Iteration", "DispatchOrder", "DONE"]

DONE = object()           # Iteration.peek(): everything of the ended iteration was taken


class Iteration:
    """One lane iteration: the requests submitted between two end_iteration() calls, and
    the dispatch cursor over them (``peek`` finds the next chunk; the order moves it)."""

    __slots__ = ("index", "requests", "by_key", "submitted", "chunks", "nbytes", "flushed",
                 "plan", "profile", "resolved", "planned", "plan_pos", "req_pos", "chunk_pos",
                 "t_first_ns", "crc", "sequence")

    def __init__(self, index: int, profile: Optional[List[List[ProfiledRequest]]],
                 planned: bool):
        self.requests: list = []
        self.by_key: Dict[Hashable, object] = {}
        self.sequence: List[tuple] = []
        self.begin(index, profile, planned)

    def begin(self, index: int, profile: Optional[List[List[ProfiledRequest]]],
              planned: bool) -> None:
        """Start as iteration ``index``, with empty containers: a dispatched iteration's
        object is begun again as a later one (``DispatchOrder.pop_head``), so that a lane
        allocates nothing per iteration ([Note: no cycles on the hot path])."""
        self.index = index
        self.submitted = 0            # requests so far, their chunks and tensors' bytes
        self.chunks = 0
        self.nbytes = 0
        self.flushed = False
        # The plan is resolved when the iteration reaches the head of the dispatch order:
        # only then is it certain, on every rank alike, which plan is in force.
        self.plan: Optional[Plan] = None
        self.profile = profile        # set: build a new plan from it first
        self.resolved = False
        self.planned = planned
        self.plan_pos = 0
        self.req_pos = 0
        self.chunk_pos = 0
        self.t_first_ns = 0
        self.crc = 0                  # COMMSCHED_VERIFY: digest of the dispatch sequence

    def peek(self):
        """The chunk the order issues next (the cursor does not move past it), None while
        it waits for a request not submitted yet, ``DONE`` once everything of the ended
        iteration was taken."""
        plan = self.plan
        if plan is not None:
            order = plan.order
            while self.plan_pos < len(order):
                key, index = order[self.plan_pos]
                req = self.by_key.get(key)
                if req is not None and plan.layout.get(key) == len(req.chunks):
                    return req.chunks[index]
                if req is None and not self.flushed:
                    return None               # head of line: wait for this request
                self.plan_pos += 1            # not in this iteration, or not as planned
        requests = self.requests
        while self.req_pos < len(requests):
            req = requests[self.req_pos]
            if self.chunk_pos < len(req.chunks) and not (
                    plan is not None and plan.layout.get(req.key) == len(req.chunks)):
                return req.chunks[self.chunk_pos]
            self.req_pos += 1
            self.chunk_pos = 0
        return DONE if self.flushed else None

    def advance(self) -> None:
        """The chunk ``peek`` returned was taken."""
        if self.plan is not None and self.plan_pos < len(self.plan.order):
            self.plan_pos += 1
        else:
            self.chunk_pos += 1

    def add(self, req, nbytes: int) -> None:
        """``req``, of ``nbytes`` tensor bytes, joins the iteration."""
        self.requests.append(req)
        self.by_key[req.key] = req
        self.count(req, nbytes)

    def count(self, req, nbytes: int) -> None:
        """``req`` joins the iteration without being kept in it: in submission order,
        issued at once, nothing reads it here again (its key is kept, to refuse it twice)."""
        req.iteration = self.index
        self.by_key.setdefault(req.key, None)
        self.submitted += 1
        self.chunks += len(req.chunks)
        self.nbytes += nbytes


class DispatchOrder:
    """Owns a lane's iterations (the open one and those not fully dispatched, oldest
    first), the plan in force at the head, and what decides the next plan: the layout of
    recent iterations and the profile of those that were profiled (``profiling``: the
    requests of the open iteration are; until a plan for the layout is decided).
    ``credit_for(index)`` gives the credit window of lane iteration ``index`` (the tuner
    may change it), which a plan is built for; ``cuda``: profiles are device times."""

    __slots__ = ("policy", "profile_iters", "feeds_forward", "credit_for", "cuda", "iterations",
                 "current", "count", "dispatched", "plan", "planned_layout", "next_profile",
                 "last_layout", "stable_iters", "link_cost", "verify_queue", "profiling",
                 "profiled", "decision", "layout_key", "spare")

    def __init__(self, policy: str, profile_iters: int, feeds_forward: bool,
                 credit_for: Callable[[int], int], cuda: bool = False):
        self.policy = policy
        self.cuda = cuda
        self.profile_iters = profile_iters
        self.feeds_forward = feeds_forward
        self.credit_for = credit_for
        self.iterations: "collections.deque[Iteration]" = collections.deque()
        self.current: Optional[Iteration] = None
        self.count = 0                        # iterations begun
        self.dispatched = 0                   # iterations whose every step was issued
        self.plan: Optional[Plan] = None      # in force at the head of the order
        self.planned_layout = None            # what the newest decided plan is for
        self.next_profile: Optional[List[List[ProfiledRequest]]] = None
        self.last_layout = None
        self.layout_key = None                # (chunks per key, credit) of last_layout
        self.stable_iters = 0
        self.link_cost = LinkCost()           # CPU: the plan's cost per byte
        self.verify_queue: List[tuple] = []   # (iteration, crc, sequence) to check
        # A lane's first iteration is not profiled: allocations, lazy initialisation and
        # the autotuning of kernels make it unlike the ones after it.
        self.profiling = False
        # The profiled iterations of the current layout, newest last (at most
        # profile_iters), each its requests in submission order.
        self.profiled: "collections.deque[List[ProfiledRequest]]" = collections.deque(
            maxlen=profile_iters)
        self.decision: Optional[dict] = None  # what the newest plan was built from
        self.spare: Optional[Iteration] = None  # a dispatched iteration, begun again next

    # ---- intake ---------------------------------------------------------------------------
    def open_index(self) -> int:
        """The index of the iteration the next request joins."""
        return self.current.index if self.current is not None else self.count

    def begin(self, t_first_ns: int) -> Iteration:
        it, planned = self.spare, self.planned_layout is not None
        if it is None:
            it = Iteration(self.count, self.next_profile, planned)
        else:
            self.spare = None
            it.begin(self.count, self.next_profile, planned)
        self.next_profile = None
        it.t_first_ns = t_first_ns
        self.count += 1
        self.iterations.append(it)
        self.current = it
        return it

    def take_in(self, req, nbytes: int, lane_name: str) -> None:
        """Add ``req`` to the open iteration."""
        it = self.current
        if it is None:
            it = self.begin(req.t_submit_ns)
        if req.key in it.by_key:
            raise SchedulerError(
                f"request key {req.key!r} submitted twice in iteration {it.index} of "
                f"lane {lane_name}; call end_iteration() between iterations")
        it.add(req, nbytes)

    def take_at_once(self, req, credit) -> bool:
        """The hot path: whether ``req``, one chunk of one step, is what the order issues
        next, with ``credit`` to spare and nothing else pending in the lane; if so it joins
        its iteration and the cursor moves past it, as ``take_in`` and a pump would,
        without their search. False (nothing done) where any of that does not hold."""
        it = self.current
        if it is None:
            if self.iterations or self.next_profile is not None:
                return False                  # earlier iterations pending, or a new plan
            # The first request of an iteration with nothing before it: the iteration is
            # at the head of the order at once, with the plan in force (as a pump would
            # resolve it: no extension, no verification on the hot path).
            it = self.begin(req.t_submit_ns)
            it.plan, it.resolved = self.plan, True
        elif self.iterations[0] is not it or not it.resolved or req.key in it.by_key:
            return False
        chunk = req.chunks[0]
        if not credit.admits(chunk.nbytes):
            return False
        plan = it.plan
        if plan is None:
            if it.req_pos != len(it.requests):
                return False                  # an earlier request is not fully issued
        else:
            pos = it.plan_pos
            if (pos >= len(plan.order) or plan.order[pos] != (req.key, 0)
                    or plan.layout.get(req.key) != 1):
                return False
        if plan is not None:
            it.add(req, chunk.nbytes)
            it.plan_pos += 1
        elif self.policy == "priority":
            it.add(req, chunk.nbytes)         # (the layout is read from it at close)
            it.req_pos += 1                   # (what peek() would find: req fully issued)
        else:
            # Submission order: the iteration does not keep it, so that it lives only as
            # long as its caller holds it ([Note: no cycles on the hot path]).
            it.count(req, chunk.nbytes)
        return True

    def holds_for(self, it: Iteration) -> bool:
        """Whether the plan of ``it`` holds requests back for the one just taken at once,
        which the next planned entry names (a pump then issues them)."""
        plan = it.plan
        return (plan is not None and it.plan_pos < len(plan.order)
                and plan.order[it.plan_pos][0] in it.by_key)

    def close(self, t_end_ns: int, mark: Optional[DeviceMark],
              lane_name: str) -> Optional[IterationRecord]:
        """No more requests in the open iteration; its record (None: nothing was open)."""
        it = self.current
        if it is None:
            return None
        self.current = None
        it.flushed = True
        self._note_layout(it)
        return IterationRecord(lane_name, it.index, it.t_first_ns, t_end_ns,
                               it.submitted, it.chunks, it.nbytes, it.planned, mark)

    def _note_layout(self, it: Iteration) -> None:
        """Decide, from the submitted layout only (rank-invariant), whether the next
        iteration builds a new plan, from the profiles of the iterations of this layout,
        and whether the next one is profiled."""
        if self.policy != "priority":
            return
        # (An unchanged layout is compared, not built again: nothing is allocated per
        # iteration here unless the layout changed or the iteration is profiled.)
        if _same_layout(it.requests, self.last_layout):
            self.stable_iters += 1
        else:
            self.stable_iters = 1
            self.profiled.clear()
            self.last_layout = tuple((r.key, r.tensor.numel(), len(r.chunks))
                                     for r in it.requests)
            self.layout_key = None
        if it.requests and all(r.marks is not None for r in it.requests):
            self.profiled.append([
                ProfiledRequest(r.key, r.priority, tuple(c.nbytes for c in r.chunks), r.marks)
                for r in it.requests])
        # A plan is built for a credit window too: a window switched for the next
        # iteration (the tuner, known by now) needs a new plan.
        credit = self.credit_for(it.index + 1)
        current = self.layout_key
        if current is None or current[1] != credit:
            current = self.layout_key = (
                {key: nchunks for key, _, nchunks in self.last_layout}, credit)
        if self.planned_layout != current and len(self.profiled) >= self.profile_iters:
            self.planned_layout = current
            self.next_profile = list(self.profiled)
            self.profiled.clear()
        self.profiling = self.planned_layout != current

    # ---- the head of the order (any thread) -------------------------------------------
    def head(self) -> Optional[Iteration]:
        return self.iterations[0] if self.iterations else None

    def pop_head(self, it: Iteration, verify: bool, reuse: bool) -> None:
        """Every step of ``it``, the head, was issued. ``reuse``: nothing else keeps
        ``it`` (no extension was told of it), so it lets go of its requests now and is
        begun again as a later iteration."""
        self.iterations.popleft()
        self.dispatched = it.index + 1
        if verify:
            self.verify_queue.append((it.index, it.crc, it.sequence))
        elif reuse:
            it.requests.clear()
            it.by_key.clear()
            it.plan = it.profile = None
            self.spare = it

    def build_plan(self, profiled: Sequence[List[ProfiledRequest]], credit_bytes: int,
                   exchange: Callable[[List[float]], List[float]]) -> Plan:
        """The plan of the ``profiled`` iterations: their profile (the requests' readiness,
        the link's cost per byte, the iterations' spread) reduced with MAX over the group
        first (``exchange``), so that every rank builds the same one. Called at the head of
        the order, after every step of the previous iterations was issued: the exchange
        sits at the same place in every rank's collective sequence."""
        profile = read_profile(profiled, self.cuda, self.link_cost.seconds_per_byte)
        requests = profile.requests
        values = exchange([p.ready_s for p in requests]
                          + [profile.seconds_per_byte, profile.spread_s])
        requests = [p._replace(ready_s=v) for p, v in zip(requests, values)]
        self.plan = lane_plan(requests, credit_bytes, values[-2], self.feeds_forward,
                              values[-1])
        self.decision = _decision(requests, self.plan, values[-2], values[-1],
                                  self.feeds_forward)
        return self.plan


def _same_layout(requests: list, layout: Optional[tuple]) -> bool:
    """Whether ``requests`` have the (key, numel, chunks) of ``layout``, in its order."""
    if layout is None or len(layout) != len(requests):
        return False
    for req, (key, numel, chunks) in zip(requests, layout):
        if req.key != key or req.tensor.numel() != numel or len(req.chunks) != chunks:
            return False
    return True


def _decision(requests, plan: Plan, seconds_per_byte: float, spread_s: float,
              feeds_forward: bool) -> dict:
    """What a plan was built from and what it chose (``Scheduler.plan_summary``)."""
    order = [key for key, _ in plan.order]
    submitted = [r.key for r in requests]
    summary = {"order": order, "submission_order": submitted,
               "as_submitted": order == [k for r in requests for k in
                                         [r.key] * len(r.chunk_bytes)],
               "ready_s": {repr(r.key): r.ready_s for r in requests},
               "seconds_per_byte": seconds_per_byte, "spread_s": spread_s}
    if feeds_forward and all(len(r.chunk_bytes) == 1 for r in requests):
        summary["forward_end_s"] = forward_end(requests, seconds_per_byte, order)
        summary["forward_end_as_submitted_s"] = forward_end(requests, seconds_per_byte,
                                                             submitted)
    return summary
