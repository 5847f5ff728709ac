"""Iteration profiles from a recorded run: what the engine replays.

From a telemetry run directory (:func:`commsched.telemetry.load_run`), per lane iteration:

request readiness   ``comm_ops.t_submit_ns`` is when the adapter handed the request over
                    (host). With CUDA the host runs ahead of the device, so the device
                    readiness is estimated (``readiness="device"``, default): a request whose
                    first chunk was dispatched at once (within 100 us of submission) started
                    exactly when its data was ready (the launch stream waits for the
                    request's ready event), so ``t_start`` of that chunk is its readiness and
                    ``t_start - t_submit`` a sample of the host's lead; a request held back
                    by credit or the plan is taken as ready at ``t_submit`` + the rank's
                    median lead (at most its first chunk's start). On CPU (gloo) the lead is
                    0 and readiness is the submission time. ``readiness="host"`` uses
                    submission times as they are.
compute end         the lane's flush (``iterations.t_flush_ns``, the last request
                    submitted = end of backward in DDP hook mode; on CUDA when the device got
                    there), or the device readiness of the last request if later.
measured iteration  first submission of the lane's iteration i+1 minus that of i (the
                    iteration has no period without a successor).
tail                measured iteration - max(compute end, measured last chunk end): the
                    compute outside the backward window (optimizer, forward, backward before
                    the first gradient). Taken from the run; the simulator predicts the rest.

dispatch order      per iteration, the order of ``t_dispatch_ns`` (validation compares the
                    replayed order with it).
plan                with policy priority, the plan the scheduler used in the steady
                    iterations, rebuilt as it built it: ``lane_plan`` on the submission
                    profile of the iteration before the first planned one, with the cost per
                    byte (chunk dispatch to completion) of every chunk before it
                    (``RecordedRun.plan_for(mode)``: in mode dp, the data-parallel mode's
                    plan for the next forward where the run had ``plan_forward``).

Times are relative to the iteration's first submission on any rank when every rank ran on
one host (``runs.host``: one clock), else to the iteration's first submission on each rank;
across ranks the maximum is kept (a collective starts when the slowest rank joins). One
clock matters when one rank's host runs ahead and waits in every collective: per-rank
clocks shift its last chunk end by that lead, which shows as exposed communication and
shortens the tail by as much ([Note: recorded host timings] in docs/design.md). The
priority plan is still
rebuilt from per-rank submission times (MAX over ranks), as the scheduler measured them
(``RecordedIteration.plan_submit_s``).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..plan import LinkCost, Plan, RequestProfile, lane_plan
from ..telemetry.errors import TelemetryError
from ..telemetry.store import RunData, load_run
from .engine import IterationProfile, SimConfig, SimRequest, chunk_bytes
from .model import SimError

__all__ = ["RecordedIteration", "RecordedRun", "load_recorded_run", "recorded_run_from_data",
           "representative_profile"]

PROMPT_NS = 100_000          # dispatched within 100 us of submission: not held back
_ITEMSIZE = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
             "double": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
             "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8}


@dataclass(frozen=True)
class RecordedIteration:
    iteration: int
    profile: IterationProfile
    measured_s: Optional[float]          # period; None for the last iteration
    comm_end_s: float                    # measured last chunk end (max over ranks)
    planned: bool
    layout: Tuple[Tuple[str, int, int], ...]     # (key, bytes, chunks) in submission order
    order: Tuple[Tuple[str, int], ...] = ()      # recorded dispatch order (key, chunk)
    # per request, submission as the scheduler measured it (from the rank's own first
    # submission, MAX over ranks): what its plan was built from
    plan_submit_s: Tuple[Tuple[str, float], ...] = ()

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.comm_end_s - self.profile.compute_end_s)


@dataclass
class RecordedRun:
    """A run directory reduced to what the simulator needs."""

    run_dir: str
    lane: str
    world_size: int                      # size of the lane's process group
    ranks: List[int]
    config: dict                         # Config fields the run was recorded with
    iterations: List[RecordedIteration]
    steady: List[RecordedIteration]      # same layout, with a period (and planned if priority)
    fit_rows: List[dict]                 # comm_ops rows of the steady iterations
    notes: List[str] = field(default_factory=list)
    # priority: the profile, credit window and cost per byte the plan of the steady
    # iterations was built from (see plan_for)
    plan_inputs: Optional[tuple] = None

    def plan_for(self, mode: str) -> Optional[Dict[str, Plan]]:
        """The plan of the steady iterations as the scheduler built it for a run of
        ``mode`` ("ddp": the greedy replay; "dp": the data-parallel mode's, for the next
        forward where the run had ``plan_forward``); None where the run had no plan."""
        if self.plan_inputs is None:
            return None
        feeds_forward = mode == "dp" and bool(self.config.get("plan_forward"))
        return {self.lane: lane_plan(*self.plan_inputs, feeds_forward)}

    def sim_config(self, **changes) -> SimConfig:
        return SimConfig.from_config(self.config, self.world_size).replace(**changes)

    @property
    def measured_s(self) -> float:
        return statistics.median(it.measured_s for it in self.steady)

    def representative(self) -> IterationProfile:
        return representative_profile([it.profile for it in self.steady])


def load_recorded_run(run_dir: str, lane: Optional[str] = None,
                      readiness: str = "device") -> RecordedRun:
    """Read ``run_dir`` and build its iteration profiles. Raises :class:`SimError` with a
    one-line reason for an unreadable or unsuitable run directory."""
    try:
        data = load_run(run_dir)
    except TelemetryError as exc:
        raise SimError(str(exc)) from None
    return recorded_run_from_data(data, lane, readiness)


def recorded_run_from_data(data: RunData, lane: Optional[str] = None,
                           readiness: str = "device") -> RecordedRun:
    if readiness not in ("device", "host"):
        raise SimError(f"readiness {readiness!r}: expected device or host")
    rows = [r for r in data.comm_ops if r.get("ok", 1)]
    if not rows:
        raise SimError(f"{data.run_dir}: no completed collectives in comm_ops (was the run "
                       f"made with COMMSCHED=1 and COMMSCHED_TELEMETRY_DIR set, past the "
                       f"first iteration?)")
    lanes = Counter()
    for r in rows:
        lanes[r["lane"]] += int(r["nbytes"])
    if lane is None:
        lane = lanes.most_common(1)[0][0]
    elif lane not in lanes:
        raise SimError(f"{data.run_dir}: no lane {lane!r} (lanes: {', '.join(sorted(lanes))})")
    rows = [r for r in rows if r["lane"] == lane]
    world = Counter(int(r["group_size"] or 1) for r in rows).most_common(1)[0][0]
    notes = data.notes()        # (the stores skipped, as report and trace name them)
    if len(lanes) > 1:
        notes.append(f"lanes {', '.join(sorted(lanes))}: replaying the busiest, {lane}")
    config = _config(data, notes)

    chunks: Dict[Tuple[int, int], List[dict]] = {}
    for r in rows:
        chunks.setdefault((r["rank"], r["iteration"]), []).append(r)
    lane_iters: Dict[Tuple[int, int], dict] = {
        (r["rank"], r["iteration"]): r for r in data.iterations if r["lane"] == lane}
    ranks = sorted({rank for rank, _ in chunks})
    lead = {rank: _host_lead(rank, chunks) if readiness == "device" else 0
            for rank in ranks}
    starts = {key: (it.get("t_first_submit_ns") or min(r["t_submit_ns"] for r in chunks[key]))
              for key, it in lane_iters.items() if key in chunks}
    for key in chunks:
        starts.setdefault(key, min(r["t_submit_ns"] for r in chunks[key]))
    # One host, one clock: every rank's times are taken from the iteration's first
    # submission on any rank (see the module docstring).
    hosts = {r.get("host") for r in data.runs if r.get("rank") in ranks}
    common = len(hosts) == 1 and None not in hosts and len(
        {r.get("rank") for r in data.runs} & set(ranks)) == len(ranks)
    if common:
        origin = {}
        for (rank, i), t in starts.items():
            origin[i] = min(origin.get(i, t), t)
        origins = {(rank, i): origin[i] for rank, i in starts}
    else:
        origins = starts

    indices = sorted({i for _, i in chunks})
    out: List[RecordedIteration] = []
    skipped = 0
    for i in indices:
        per_rank = []
        for rank in ranks:
            got = _rank_iteration(rank, i, chunks.get((rank, i)), lane_iters.get((rank, i)),
                                  origins.get((rank, i)), lead[rank], readiness,
                                  starts.get((rank, i)))
            if got is None:
                break
            per_rank.append(got)
        if len(per_rank) != len(ranks) or len({p["layout"] for p in per_rank}) != 1:
            skipped += 1
            continue
        periods = [starts[(rank, i + 1)] - starts[(rank, i)] for rank in ranks
                   if (rank, i + 1) in starts]
        measured = (sum(periods) / len(periods) * 1e-9) if len(periods) == len(ranks) else None
        first = per_rank[0]
        requests = []
        for key, req in first["requests"].items():
            ready = max(p["requests"][key]["ready"] for p in per_rank)
            submit = max(p["requests"][key]["submit"] for p in per_rank)
            requests.append(SimRequest(key, req["nbytes"], ready, req["priority"],
                                       req["itemsize"], req["op"], lane, submit))
        compute_end = max(p["compute_end"] for p in per_rank)
        comm_end = max(p["comm_end"] for p in per_rank)
        tail = max(0.0, measured - max(compute_end, comm_end)) if measured is not None else 0.0
        plan_submit = tuple((key, max(p["requests"][key]["own_submit"] for p in per_rank))
                            for key in first["requests"])
        out.append(RecordedIteration(
            i, IterationProfile(tuple(requests), compute_end, tail), measured, comm_end,
            all(p["planned"] for p in per_rank), first["layout"], first["order"],
            plan_submit))
    if skipped:
        notes.append(f"{skipped} lane iteration(s) skipped: chunks missing on a rank, or "
                     f"ranks disagreeing on the requests")
    if not out:
        raise SimError(f"{data.run_dir}: no complete iteration on lane {lane}")
    steady = _steady(out, config, notes)
    steady_ids = {it.iteration for it in steady}
    # tagged with the run (rows of several runs may be pooled into one fit) and the host
    # (join_ranks compares times of one collective across ranks only on one clock)
    host = {r.get("rank"): r.get("host") for r in data.runs}
    fit_rows = [dict(r, run=data.run_dir, host=host.get(r["rank"])) for r in rows
                if r["iteration"] in steady_ids]
    run = RecordedRun(data.run_dir, lane, world, ranks, config, out, steady, fit_rows, notes)
    _check_partition(run)
    run.plan_inputs = _recorded_plan_inputs(run, chunks)
    return run


def _recorded_plan_inputs(run: RecordedRun, chunks) -> Optional[tuple]:
    """What the scheduler built the plan of the steady iterations from: the submission
    profile of the iteration before the first planned one (MAX over ranks), the credit
    window, and the cost per byte measured over every chunk before (dispatch to
    completion, MAX over ranks). None when the run is fifo or that iteration was not
    recorded whole."""
    if (run.config.get("policy") or "priority") != "priority" or not run.steady:
        return None
    by_index = {it.iteration: it for it in run.iterations}
    first = min((it.iteration for it in run.iterations if it.planned), default=None)
    source = by_index.get(first - 1) if first is not None else None
    if source is None or source.layout != run.steady[0].layout:
        run.notes.append("the plan's source iteration was not recorded: the replay builds a "
                         "plan from each iteration's own profile")
        return None
    costs = []
    for rank in run.ranks:
        # The scheduler's LinkCost over the steps completed before the plan: busy time in
        # issue order, bytes once per chunk.
        cost = LinkCost()
        rows = sorted((row for (r, i), rs in chunks.items() if r == rank and i < first
                       for row in rs), key=lambda row: row["t_dispatch_ns"])
        seen = set()
        for row in rows:
            chunk = (row["iteration"], row["request_key"], row["chunk_index"])
            cost.add(row["t_start_ns"], row["t_end_ns"],
                     0 if chunk in seen else int(row["nbytes"]))
            seen.add(chunk)
        costs.append(cost.seconds_per_byte)
    config = run.sim_config()
    submit = dict(source.plan_submit_s)
    profile = [RequestProfile(r.key, r.priority, submit.get(r.key, r.dispatchable_s),
                              chunk_bytes(r, config)) for r in source.profile.requests]
    run.notes.append(f"replaying the recorded plan: built from iteration {first - 1}'s "
                     f"profile, in force from iteration {first}")
    return profile, config.credit_bytes, max(costs)


def _config(data: RunData, notes: List[str]) -> dict:
    runs = sorted(data.runs, key=lambda r: r["rank"])
    if not runs or not runs[0].get("config_json"):
        notes.append("no recorded configuration: commsched defaults assumed")
        return {}
    try:
        config = json.loads(runs[0]["config_json"])
    except (TypeError, ValueError):
        notes.append("unreadable recorded configuration: commsched defaults assumed")
        return {}
    if not isinstance(config, dict):
        return {}
    missing = [k for k in ("partition_bytes", "credit_bytes", "policy", "decompose")
               if k not in config]
    if missing:
        notes.append(f"recorded configuration lacks {', '.join(missing)}: defaults assumed")
    return config


def _host_lead(rank: int, chunks: Dict[Tuple[int, int], List[dict]]) -> int:
    """Median (t_start - t_submit) of the rank's requests dispatched at once."""
    samples = []
    for (r, _), rows in chunks.items():
        if r != rank:
            continue
        for first in _first_chunks(rows).values():
            if first["t_dispatch_ns"] - first["t_submit_ns"] <= PROMPT_NS:
                samples.append(max(0, first["t_start_ns"] - first["t_submit_ns"]))
    return int(statistics.median(samples)) if samples else 0


def _first_chunks(rows: List[dict]) -> Dict[str, dict]:
    first: Dict[str, dict] = {}
    for r in rows:
        cur = first.get(r["request_key"])
        if cur is None or (r["t_dispatch_ns"], r["t_start_ns"]) < (cur["t_dispatch_ns"],
                                                                     cur["t_start_ns"]):
            first[r["request_key"]] = r
    return first


def _rank_iteration(rank, i, rows, it_row, t0, lead, readiness, own_t0=None
                    ) -> Optional[dict]:
    if not rows or t0 is None:
        return None
    own_t0 = t0 if own_t0 is None else own_t0
    if it_row is not None and not it_row.get("complete", 1):
        return None
    by_key: Dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: (r["t_submit_ns"], r["chunk_index"])):
        req = by_key.setdefault(r["request_key"], {
            "chunks": {}, "num_chunks": r["num_chunks"], "priority": r["priority"],
            "op": r["op"], "itemsize": _itemsize(r["dtype"]), "t_submit": r["t_submit_ns"]})
        req["chunks"][r["chunk_index"]] = int(r["nbytes"])
    firsts = _first_chunks(rows)
    requests = {}
    for key, req in by_key.items():
        if len(req["chunks"]) != req["num_chunks"]:
            return None
        first = firsts[key]
        submit = req["t_submit"]
        if readiness == "host":
            ready = submit
        elif first["t_dispatch_ns"] - submit <= PROMPT_NS:
            ready = max(submit, first["t_start_ns"])
        else:
            ready = max(submit, min(submit + lead, first["t_start_ns"]))
        requests[key] = {"nbytes": sum(req["chunks"].values()), "priority": req["priority"],
                         "op": req["op"], "itemsize": req["itemsize"],
                         "ready": (ready - t0) * 1e-9, "submit": (submit - t0) * 1e-9,
                         "own_submit": (submit - own_t0) * 1e-9,
                         "chunk_bytes": tuple(req["chunks"][c] for c in sorted(req["chunks"]))}
    flush = it_row.get("t_flush_ns") if it_row else None
    last_ready = max(r["ready"] for r in requests.values())
    compute_end = max(last_ready, (flush - t0) * 1e-9 if flush else 0.0)
    comm_end = (max(r["t_end_ns"] for r in rows) - t0) * 1e-9
    layout = tuple((k, r["nbytes"], len(r["chunk_bytes"])) for k, r in requests.items())
    order = tuple(dict.fromkeys(
        (r["request_key"], r["chunk_index"])
        for r in sorted(rows, key=lambda r: (r["t_dispatch_ns"], r["chunk_index"]))))
    return {"requests": requests, "compute_end": compute_end, "comm_end": comm_end,
            "planned": bool(it_row.get("planned")) if it_row else False, "layout": layout,
            "order": order}


def _itemsize(dtype: Optional[str]) -> int:
    name = (dtype or "float32").replace("torch.", "")
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    try:
        import torch
        return torch.empty(0, dtype=getattr(torch, name)).element_size()
    except Exception:  # an unknown dtype name: bytes still partition sensibly at 1 B
        return 1


def _steady(its: List[RecordedIteration], config: dict, notes: List[str]):
    layouts = Counter(it.layout for it in its if it.measured_s is not None)
    if not layouts:
        raise SimError("no iteration has a successor to time it by (need at least 2 "
                       "recorded iterations)")
    modal = layouts.most_common(1)[0][0]
    steady = [it for it in its if it.layout == modal and it.measured_s is not None]
    if (config.get("policy") or "priority") == "priority":
        planned = [it for it in steady if it.planned]
        if planned:
            steady = planned
        else:
            notes.append("policy priority, but no iteration ran under a plan: the replay "
                         "uses a plan anyway")
    dropped = len(its) - len(steady)
    if dropped:
        notes.append(f"{len(steady)} steady iterations used ({dropped} others: warm-up, "
                     f"another request layout, or the last one)")
    return steady


def representative_profile(profiles: List[IterationProfile]) -> IterationProfile:
    """The median iteration: per request (matched by lane and key) the median readiness and
    submission time; median compute end and tail. Requests in the first profile's order."""
    if not profiles:
        raise SimError("no iteration profiles to summarise")
    med = statistics.median
    by_key: Dict[tuple, List[SimRequest]] = {}
    for p in profiles:
        for r in p.requests:
            by_key.setdefault((r.lane, r.key), []).append(r)
    requests = []
    for r in profiles[0].requests:
        same = by_key[(r.lane, r.key)]
        submits = [x.submit_s for x in same if x.submit_s is not None]
        requests.append(SimRequest(r.key, r.nbytes, med(x.ready_s for x in same), r.priority,
                                   r.itemsize, r.op, r.lane,
                                   med(submits) if submits else None))
    return IterationProfile(tuple(requests), med(p.compute_end_s for p in profiles),
                            med(p.tail_s for p in profiles), profiles[0].forward_s)


def _check_partition(run: RecordedRun) -> None:
    """The recorded chunk sizes must be what the engine's partitioning gives for the
    recorded configuration; otherwise the configuration was not what config_json says."""
    if not run.steady:
        return
    try:
        config = run.sim_config()
    except SimError as exc:
        run.notes.append(f"recorded configuration unusable ({exc}); defaults assumed")
        run.config = {}
        return
    it = run.steady[0]
    mismatched = [r.key for r, (_, _, n) in zip(it.profile.requests, it.layout)
                  if len(chunk_bytes(r, config)) != n]
    if mismatched:
        run.notes.append(f"chunk counts of request(s) {', '.join(map(str, mismatched[:5]))} "
                         f"differ from the recorded configuration's partitioning")
