"""Discrete-event model of one training iteration under the commsched scheduler.

The engine replays the scheduler's policy, reusing its code where the policy is code:

* partitioning: :func:`commsched.partition.partition`, called on stand-in requests;
* steps per chunk: :func:`commsched.collectives.steps_for` (rs_ag = reduce_scatter then
  all_gather);
* dispatch order: submission order (fifo); or (priority) a given plan — e.g. the one a
  recorded run used — followed as ``_Iteration.peek`` follows it, else the plan
  :func:`commsched.plan.lane_plan` makes from the iteration's own submission profile (in
  mode dp with ``plan_forward``: the order that ends the next forward soonest), with
  the cost per byte the scheduler would have measured in its fifo warm-up iterations (chunk
  dispatch to completion, queueing included), obtained from a fifo replay of the profile;
* head of line: chunk ``k`` of the order is dispatched no earlier than chunk ``k-1``, once
  its request was submitted, and once the credit window admits it (in flight + bytes <=
  credit, or nothing in flight; credit 0 = unbounded). Credit returns when the chunk's last
  step finished;
* one serial link per lane: the collectives of one process group run one after another, a
  step starting at max(its issue, its data ready on the device, the link free);
* host costs, where the cost model has them (``issue_s``: consecutive step issues are at
  least this far apart; ``credit_return_s``: a chunk's credit comes back this long after
  its end — the completion thread noticing it and dispatching the next chunk).

Iteration time, DDP hook mode (``mode="ddp"``); t = 0 is the iteration's first submission::

    backward  ──────────────────────────────┤ compute_end
    link        [c0][c1]   [c2][c3]      [c4][c5]──┤ comm_end
    iteration = max(compute_end, comm_end) + tail      (tail: optimizer step, forward,
    exposed   = iteration - (compute_end + tail)        backward before the first gradient)

Data-parallel mode (``mode="dp"``, ``commsched.wrap``; a simple model): after
backward the next forward runs the layer groups in ascending priority; group p (the requests
of priority p, its optimizer update folded into its forward time) starts when the previous
group's forward ended and all its requests' chunks completed. The iteration is the end of
the last group's forward plus the rest of the tail (``tail - sum(forward)``). Every chunk of
iteration i completes before the forward of iteration i+1 ends, so one iteration's
communication never meets the next one's and a single-iteration replay is the steady state.
Per-group forward times default to the tail split in proportion to each group's bytes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from ..collectives import steps_for
from ..partition import partition
from ..plan import LinkCost, Plan, RequestProfile, lane_plan
from .model import SimError

__all__ = ["SimRequest", "SimConfig", "IterationProfile", "StepTiming", "SimResult",
           "simulate", "chunk_bytes", "MODES"]

MODES = ("ddp", "dp")
_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class SimRequest:
    """One request of an iteration, as the scheduler saw it.

    ``ready_s``: when its data is ready on the device, seconds after the iteration's first
    submission; ``submit_s``: when it was handed to the scheduler (host), default
    ``ready_s`` — chunks are dispatched no earlier than ``submit_s`` and start no earlier
    than ``ready_s``; the priority plan is built from ``submit_s``, as the scheduler builds
    it from submission times.
    """

    key: Hashable
    nbytes: int
    ready_s: float
    priority: int = 0
    itemsize: int = 4
    op: str = "all_reduce"
    lane: str = "g0"
    submit_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.itemsize < 1 or self.nbytes < 0 or self.nbytes % self.itemsize:
            raise SimError(f"request {self.key!r}: {self.nbytes} bytes is not a whole number "
                           f"of {self.itemsize}-byte elements")
        if self.op not in _OPS:
            raise SimError(f"request {self.key!r}: op {self.op!r}, expected one of "
                           f"{', '.join(_OPS)}")

    @property
    def dispatchable_s(self) -> float:
        return self.ready_s if self.submit_s is None else self.submit_s


@dataclass(frozen=True)
class IterationProfile:
    """What one iteration computes and submits (rank-invariant: the slowest rank's times).

    ``requests`` in submission order; ``compute_end_s``: end of backward; ``tail_s``: the
    rest of the iteration's compute (optimizer step, forward, backward before the first
    submission), so compute-only iteration time = ``compute_end_s + tail_s``;
    ``forward_s``: data-parallel mode only, forward (+ update) seconds per priority group.
    """

    requests: Tuple[SimRequest, ...]
    compute_end_s: float
    tail_s: float = 0.0
    forward_s: Optional[Mapping[int, float]] = None

    @property
    def compute_only_s(self) -> float:
        return self.compute_end_s + self.tail_s

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.requests)


@dataclass(frozen=True)
class SimConfig:
    """The scheduler settings the engine replays (the fields of
    :class:`commsched.config.Config` that shape communication, plus the group size)."""

    partition_bytes: int = 4 << 20
    credit_bytes: int = 16 << 20
    policy: str = "priority"
    decompose: str = "none"
    world_size: int = 2
    plan_forward: bool = True       # mode dp: the plan minimises the next forward's end

    def __post_init__(self) -> None:
        for name in ("partition_bytes", "credit_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SimError(f"{name}={v!r}: expected an integer >= 0 (0 = unbounded)")
        if self.policy not in ("priority", "fifo"):
            raise SimError(f"policy={self.policy!r}: expected priority or fifo")
        if self.decompose not in ("none", "rs_ag"):
            raise SimError(f"decompose={self.decompose!r}: expected none or rs_ag")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 1:
            raise SimError(f"world_size={self.world_size!r}: expected an integer >= 1")

    @classmethod
    def from_config(cls, config, world_size: int) -> "SimConfig":
        """From a :class:`commsched.config.Config` (or a dict of its fields)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        base = cls()
        # (a run recorded before plan_forward existed used the greedy replay)
        return cls(int(get("partition_bytes", base.partition_bytes)),
                   int(get("credit_bytes", base.credit_bytes)),
                   str(get("policy") or base.policy), str(get("decompose", base.decompose)),
                   int(world_size), bool(get("plan_forward", False)))

    def replace(self, **changes) -> "SimConfig":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SimConfig(**values)

    def label(self) -> str:
        part = _fmt_bytes(self.partition_bytes) if self.partition_bytes else "off"
        return (f"partition {part}, credit {_fmt_bytes(self.credit_bytes)}, {self.policy}, "
                f"{self.decompose}")


@dataclass(frozen=True)
class StepTiming:
    lane: str
    key: Hashable
    chunk: int
    step: str
    nbytes: int
    dispatch_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """The replayed iteration. Times in seconds from the iteration's first submission."""

    config: SimConfig
    mode: str
    iteration_s: float
    compute_only_s: float
    exposed_s: float
    comm_end_s: float
    comm_busy_s: float                      # sum of step costs: the link time, no overlap
    steps: Tuple[StepTiming, ...]
    request_end_s: Dict[Hashable, float]
    order: Dict[str, Tuple[Tuple[Hashable, int], ...]] = field(default_factory=dict)
    forward_end_s: Optional[float] = None   # dp mode


class _TensorShape:
    """Just enough of a tensor for :func:`commsched.partition.partition`."""

    __slots__ = ("_numel", "_itemsize")

    def __init__(self, numel: int, itemsize: int):
        self._numel, self._itemsize = numel, itemsize

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._itemsize


class _RequestShape:
    """Just enough of a :class:`commsched.scheduler.Request` for partitioning."""

    __slots__ = ("key", "tensor", "op", "world_size")

    def __init__(self, req: SimRequest, world_size: int):
        self.key, self.op, self.world_size = req.key, req.op, world_size
        self.tensor = _TensorShape(req.nbytes // req.itemsize, req.itemsize)


def chunk_bytes(req: SimRequest, config: SimConfig) -> Tuple[int, ...]:
    """Payload bytes of each chunk the scheduler cuts ``req`` into under ``config``
    (the same arithmetic as ``Scheduler.submit``: commsched.partition.partition)."""
    decompose = config.decompose if req.op == "all_reduce" else "none"
    steps = steps_for(req.op, decompose)
    multiple = config.world_size if steps[0] == "reduce_scatter" and req.op == "all_reduce" else 1
    chunks = partition(_RequestShape(req, config.world_size), config.partition_bytes, multiple)
    return tuple(c.nbytes for c in chunks)


def simulate(profile: IterationProfile, cost_model, config: SimConfig,
             mode: str = "ddp", plans: Optional[Mapping[str, Plan]] = None) -> SimResult:
    """Replay one iteration of ``profile`` under ``config`` with collective costs from
    ``cost_model`` (any object with ``cost_s(step, decompose, nbytes, world_size)``).

    ``plans``: with policy priority, the plan in force per lane (e.g. the one a recorded
    run actually used, :meth:`RecordedRun.plan_for`) instead of one built from ``profile``; it
    is followed as the scheduler follows it: its entries whose request has the planned
    chunk count, in order, then every other request's chunks in submission order.

    Example::
        r = simulate(profile, TopologyCostModel("ring", 100.0), SimConfig(world_size=8))
        print(r.iteration_s, r.exposed_s)
    """
    if mode not in MODES:
        raise SimError(f"mode {mode!r}: expected ddp or dp")
    if not profile.requests:
        raise SimError("the profile has no requests")
    keys = [(r.lane, r.key) for r in profile.requests]
    if len(set(keys)) != len(keys):
        raise SimError("request keys repeat within a lane of the profile")
    lanes: Dict[str, List[SimRequest]] = {}
    for r in profile.requests:
        lanes.setdefault(r.lane, []).append(r)
    steps: List[StepTiming] = []
    request_end: Dict[Hashable, float] = {}
    orders = {}
    busy = 0.0
    for lane, reqs in lanes.items():
        plan = plans.get(lane) if plans and config.policy == "priority" else None
        lane_steps, order, lane_busy = _replay_lane(lane, reqs, cost_model, config, plan,
                                                    mode == "dp")
        steps += lane_steps
        orders[lane] = order
        busy += lane_busy
        for s in lane_steps:
            key = s.key if len(lanes) == 1 else (lane, s.key)
            request_end[key] = max(request_end.get(key, 0.0), s.end_s)
    comm_end = max((s.end_s for s in steps), default=0.0)
    compute_only = profile.compute_only_s
    forward_end = None
    if mode == "ddp":
        iteration = max(profile.compute_end_s, comm_end) + profile.tail_s
    else:
        forward_end, rest = _forward(profile, steps)
        iteration = forward_end + rest
    return SimResult(config, mode, iteration, compute_only, iteration - compute_only,
                     comm_end, busy, tuple(steps), request_end, orders, forward_end)


def _chunks(reqs: Sequence[SimRequest], config: SimConfig):
    return [chunk_bytes(r, config) for r in reqs]


def _replay_lane(lane: str, reqs: List[SimRequest], cost_model, config: SimConfig,
                 plan: Optional[Plan] = None, feeds_forward: bool = False):
    chunks = _chunks(reqs, config)
    fifo = [(i, c) for i, sizes in enumerate(chunks) for c in range(len(sizes))]
    if config.policy == "fifo":
        order = fifo
    elif plan is not None:
        order = _follow_plan(reqs, chunks, plan)
    else:
        timeline, _ = _timeline(lane, reqs, chunks, fifo, cost_model, config)
        order = _plan_order(reqs, chunks, timeline, config, feeds_forward)
    timeline, busy = _timeline(lane, reqs, chunks, order, cost_model, config)
    return timeline, tuple((reqs[i].key, c) for i, c in order), busy


def _follow_plan(reqs, chunks, plan: Plan):
    """The scheduler's dispatch order under ``plan`` (``_Iteration.peek``): planned chunks of
    requests submitted with the planned chunk count, then the rest in submission order."""
    index = {r.key: i for i, r in enumerate(reqs)}
    planned = {i for i, r in enumerate(reqs) if plan.layout.get(r.key) == len(chunks[i])}
    order = [(index[key], c) for key, c in plan.order
             if key in index and index[key] in planned and c < len(chunks[index[key]])]
    order += [(i, c) for i in range(len(reqs)) if i not in planned
              for c in range(len(chunks[i]))]
    if len(set(order)) != sum(len(c) for c in chunks):
        raise SimError("the plan does not cover every chunk of its requests exactly once")
    return order


def _plan_order(reqs, chunks, fifo_timeline: List[StepTiming], config: SimConfig,
                feeds_forward: bool = False):
    """The priority plan the scheduler builds: ``lane_plan`` on the profile, with the
    seconds per byte it accumulates over its fifo warm-up (``LinkCost``: the time the link
    was busy with the steps, in issue order)."""
    cost = LinkCost()
    counted = set()
    for s in sorted(fifo_timeline, key=lambda s: s.dispatch_s):
        chunk = (s.key, s.chunk)        # a chunk's bytes count once, whatever its steps
        cost.add(round(s.start_s * 1e9), round(s.end_s * 1e9),
                 0 if chunk in counted else s.nbytes)
        counted.add(chunk)
    seconds_per_byte = cost.seconds_per_byte
    profile = [RequestProfile(i, r.priority, r.dispatchable_s, chunks[i])
               for i, r in enumerate(reqs)]
    plan = lane_plan(profile, config.credit_bytes, seconds_per_byte,
                     feeds_forward and config.plan_forward)
    return list(plan.order)


def _timeline(lane, reqs, chunks, order, cost_model, config: SimConfig):
    """Dispatch ``order`` head-of-line under the credit window on one serial link.

    Host costs, when the cost model has them (a fitted model does): ``issue_s`` spaces
    consecutive step issues (the dispatching thread issues one collective at a time);
    ``credit_return_s`` is the time from a chunk's end until its credit lets the next chunk
    start (completion thread noticing it, dispatching the next).
    """
    credit = config.credit_bytes
    issue_s = float(getattr(cost_model, "issue_s", 0.0) or 0.0)
    credit_return_s = float(getattr(cost_model, "credit_return_s", 0.0) or 0.0)
    in_flight: List[Tuple[float, int]] = []          # (credit back, bytes), a min-heap
    in_flight_bytes = 0
    t = 0.0                                          # dispatch time of the previous chunk
    link_free = host_free = 0.0
    busy = 0.0
    out: List[StepTiming] = []
    for i, c in order:
        req = reqs[i]
        nbytes = chunks[i][c]
        t = max(t, req.dispatchable_s, host_free)
        while True:
            while in_flight and in_flight[0][0] <= t:
                in_flight_bytes -= heapq.heappop(in_flight)[1]
            if not credit or not in_flight_bytes or in_flight_bytes + nbytes <= credit:
                break
            t = in_flight[0][0]
        decompose = config.decompose if req.op == "all_reduce" else "none"
        end = issue = t
        for step in steps_for(req.op, decompose):
            cost = float(cost_model.cost_s(step, decompose, nbytes, config.world_size))
            if cost < 0:
                raise SimError(f"cost model gave a negative time for {step} of {nbytes} bytes")
            issue = max(issue, host_free)
            host_free = issue + issue_s
            start = max(issue, req.ready_s, link_free, end)
            end = link_free = start + cost
            busy += cost
            out.append(StepTiming(lane, req.key, c, step, nbytes, issue, start, end))
        heapq.heappush(in_flight, (end + credit_return_s, nbytes))
        in_flight_bytes += nbytes
    return out, busy


def _forward(profile: IterationProfile, steps: List[StepTiming]) -> Tuple[float, float]:
    """Data-parallel mode: (end of the next forward, tail left after it)."""
    group_bytes: Dict[int, int] = {}
    for r in profile.requests:
        group_bytes[r.priority] = group_bytes.get(r.priority, 0) + r.nbytes
    forward = dict(profile.forward_s) if profile.forward_s is not None else None
    if forward is None:
        total = sum(group_bytes.values())
        forward = {p: profile.tail_s * (b / total if total else 1 / len(group_bytes))
                   for p, b in group_bytes.items()}
    missing = set(group_bytes) - set(forward)
    if missing:
        raise SimError(f"forward_s has no time for priority group(s) {sorted(missing)}")
    rest = profile.tail_s - sum(forward.values())
    if rest < -1e-12:
        raise SimError(f"forward_s sums to {sum(forward.values()):.6g} s, more than the "
                       f"tail of {profile.tail_s:.6g} s")
    done: Dict[int, float] = {}
    prio = {(r.lane, r.key): r.priority for r in profile.requests}
    for s in steps:
        p = prio[(s.lane, s.key)]
        done[p] = max(done.get(p, 0.0), s.end_s)
    t = profile.compute_end_s
    for p in sorted(forward):
        t = max(t, done.get(p, 0.0)) + forward[p]
    return t, max(rest, 0.0)


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "inf"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size}{unit}" if n % size == 0 else f"{n / size:.2f}{unit}"
    return f"{n}B"
