"""Online tuning of a lane's partition size, credit window and decomposition
(``COMMSCHED_AUTOTUNE=1``): profile, search on the simulator, try, keep or revert.

One tuning round of a lane (process group); n = ``Config.autotune_iters``, indices are the
lane's iterations::

  layout stable, a plan of it in force (fifo: layout stable)
  ├─ baseline   b0 .. b0+n profiled: every rank notes when each began; rank 0 also keeps
  │             its chunk records (submit, dispatch, device start / end)
  ├─ decide     at the head of every iteration from b0+n+1 on, one all_reduce(MAX) until
  │             rank 0's search has an answer (commsched.sim.tune on the profile and a cost
  │             model fitted to it, in a thread, off the dispatch path); the choice applies
  │             from X = max over ranks of (iterations begun) + 1
  ├─ replan     the existing mechanism: new chunk layout -> profile_iters -> new plan
  ├─ trial      t0 .. t0+n, t0 = one after the first iteration >= X that ran under a plan
  │             of its own layout (fifo: X + 1)
  └─ evaluate   at the head of t0+n+1, one all_reduce(MAX) of the trial's mean iteration
                time; keep the choice if it beat the baseline's, else revert from
                X' = max(iterations begun) + 1. Then nothing until the layout changes.

The exchanged vector (int64, reduced with MAX; ranks other than 0 send -1 where rank 0
answers)::

  [status, partition, credit, decompose, predicted us, predicted-old us | begun, measured ns]
   └──────────────── rank 0 (decide) ──────────────────────────────────┘  └─ every rank ─┘

How it keeps invariant 1 (same collective sequence on every rank):

* What a setting changes for the sequence: partition and decomposition decide the chunks
  and steps of a request, at submit time; the credit window enters the plan (the window
  itself only decides *when* a chunk goes). So a setting must be known, on every rank,
  before the first request of the iteration it applies to is submitted, and plans must be
  built with the window of their own iteration.
* The tuner changes state only at two of its lane's extension points, events every rank
  passes in the same order: D(i), iteration i fully dispatched (``dispatched``), and H(k),
  iteration k at the head of the order (``at_head``) (D(0) H(1) D(1) H(2) ...). It looks only at rank-invariant facts there: the
  request layouts, whether an iteration ran under a plan of its layout, iteration indices,
  and values that came out of its all-reduces (identical on every rank afterwards). Timing
  enters only through those values; rank 0's readiness only changes what rank 0 sends.
* A switch applies from X = max(begun) + 1. Each rank sends its count of iterations begun
  while it holds the lane lock, so no rank can begin iteration max(begun) before it knows
  the result; the + 1 covers a submit() that read its settings just before the exchange
  (it partitions before it joins its iteration under the lock). Hence the settings of
  iteration i + 1 are final on every rank by the time iteration i ends, which is what
  the dispatch order reads to replan after a switched credit window.

Every decision is appended to ``Scheduler.tuning_log(group)`` (and handed to an observer
with an ``on_tuning(dict)`` method, e.g. the telemetry recorder: table ``tuning``), with the
fields of :func:`Tuner._entry`.

Example::
    sched, recorder = commsched.adapter.build_scheduler(
        commsched.Config(autotune=True, autotune_iters=5), device)
    ...  # train; then
    print(sched.tuning_log())
"""

from __future__ import annotations

import collections
import json
import threading
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .config import DECOMPOSITIONS
from .errors import CommschedWarning
from .observer import ChunkRecord, Extension, LaneInfo
from .threads import start_thread

__all__ = ["Settings", "Tuner", "TuningWarning", "search", "mean_iteration_ns",
           "SEARCH_DECOMPOSITIONS"]


class TuningWarning(CommschedWarning, RuntimeWarning):
    """The tuner's search failed; the lane keeps its settings."""


SEARCH_DECOMPOSITIONS = ("none", "rs_ag")     # the decompositions the simulator models

# Positions in the exchanged vector, and rank 0's status codes.
_STATUS, _PARTITION, _CREDIT, _DECOMPOSE, _PREDICTED, _PREDICTED_OLD, _BEGUN, _MEASURED = range(8)
_NOT_READY, _CHOSEN, _FAILED = 0, 1, 2


class Settings(NamedTuple):
    """What the tuner chooses: the Config fields that shape a lane's communication."""

    partition_bytes: int
    credit_bytes: int
    decompose: str


# --- the two functions tests replace (seams): search and measurement ----------------------

def search(profile, cost_model, current: Settings, *, policy: str, world_size: int,
           decompositions: Sequence[str]) -> Tuple[Settings, float, float]:
    """The fastest settings for ``profile`` (a :class:`commsched.sim.IterationProfile`)
    under ``cost_model`` by :func:`commsched.sim.tune`: returns (settings, predicted ms,
    predicted ms of ``current``).

    ``decompositions``: those searched (``none``/``rs_ag``); empty keeps ``current``'s
    decomposition (hier / leader / auto, which the simulator replays as ``none``). The
    current settings are the first candidate, so a tie keeps them.
    """
    from . import sim

    sim_decompose = current.decompose if current.decompose in SEARCH_DECOMPOSITIONS else "none"
    base = sim.SimConfig(current.partition_bytes, current.credit_bytes, policy, sim_decompose,
                         world_size)
    candidates = [base] + [
        c for c in sim.default_candidates(profile, policy=policy, world_size=world_size,
                                          decompositions=decompositions or (sim_decompose,))
        if c != base]
    ranked = sim.tune(profile, cost_model, candidates)
    best, ms = ranked[0]
    old_ms = next(m for c, m in ranked if c == base)
    decompose = best.decompose if decompositions else current.decompose
    return Settings(best.partition_bytes, best.credit_bytes, decompose), ms, old_ms


def mean_iteration_ns(kind: str, first_submit_ns: Sequence[int]) -> int:
    """Mean time between consecutive first submissions of a window's iterations (this
    rank); ``kind`` is ``baseline`` or ``trial``. Reduced with MAX over the ranks."""
    return (first_submit_ns[-1] - first_submit_ns[0]) // (len(first_submit_ns) - 1)


def _profile_and_search(lane_name: str, rank: int, current: Settings, policy: str,
                        decompositions: Sequence[str], iterations: List[dict],
                        records: List[ChunkRecord]) -> Tuple[Settings, float, float]:
    """Rank 0, search thread: the baseline window as a recorded run (the simulator's own
    reader: device readiness, tail, steady iterations), a cost model fitted on it, the
    search."""
    from .sim import fit_cost_model
    from .sim.profile import recorded_run_from_data
    from .telemetry.store import RunData

    rows = []
    for record in records:
        row = record._asdict()
        row.update(rank=rank, group_size=len(record.group_ranks), ok=int(record.ok))
        rows.append(row)
    config = {"partition_bytes": current.partition_bytes, "credit_bytes": current.credit_bytes,
              "policy": policy, "decompose": current.decompose
              if current.decompose in SEARCH_DECOMPOSITIONS else "none"}
    data = RunData(f"lane {lane_name} (autotune baseline)", [], {
        "runs": [{"rank": rank, "config_json": json.dumps(config)}],
        "comm_ops": rows, "iterations": iterations})
    run = recorded_run_from_data(data, lane_name)
    model = fit_cost_model(run.fit_rows, source="autotune baseline")
    return search(run.representative(), model, current, policy=policy,
                  world_size=run.world_size, decompositions=decompositions)


class _SearchJob:
    """Rank 0's search, in a daemon thread so that dispatch never waits for it."""

    __slots__ = ("thread", "done", "result", "error")

    def __init__(self, fn, *args):
        self.done = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None

        def run():
            try:
                self.result = fn(*args)
            except Exception as exc:  # a profile the simulator rejects: the round ends
                self.error = exc
            finally:
                self.done.set()

        self.thread = start_thread(run, "commsched-autotune", "cs-autotune")


class Tuner(Extension):
    """The autotuner of one lane, an extension of it (``Scheduler(extensions=[Tuner])``).
    ``at_head`` and ``dispatched`` run with the lane lock held; ``settings_for`` may be
    read without it (the schedule is replaced whole, never mutated)."""

    provides = ("autotune",)
    tunes = True

    def __init__(self, lane: LaneInfo):
        config = lane.config
        self.lane = lane
        self.n = config.autotune_iters
        self.policy = config.policy
        self.min_stable = max(2, config.profile_iters)
        self.decompositions = (SEARCH_DECOMPOSITIONS
                               if config.decompose in SEARCH_DECOMPOSITIONS else ())
        # (first iteration, settings), ascending; replaced whole, never mutated, so that
        # submit() may read it without the lock.
        self.schedule: Tuple[Tuple[int, Settings], ...] = (
            (0, Settings(config.partition_bytes, config.credit_bytes, config.decompose)),)
        self.phase = "wait"     # wait baseline decide switching trial evaluate abort done
        self.layout = None      # request layout (key, bytes, op) of the last iteration
        self.stable = 0         # iterations with that layout in a row
        self.round = -1
        self.first = 0          # first iteration of the current window
        self.starts: Dict[int, int] = {}      # window iteration -> its first submission (ns)
        self.old: Optional[Settings] = None   # the baseline's settings
        self.candidate: Optional[Settings] = None
        self.switch_at = 0
        self.baseline_from = None
        self.trial_from = None
        self.predicted: Tuple[Optional[float], Optional[float]] = (None, None)
        self.baseline_ms: Optional[float] = None
        self.baseline_ns = 0
        self.log: List[dict] = []
        self.unreported: "collections.deque[dict]" = collections.deque()
        self.observer = lane.observer
        self.reports = self.observer is not None and hasattr(self.observer, "on_tuning")
        # rank 0: while collecting, the baseline's chunk records and iteration rows, and
        # the search
        self.collecting = False
        self.records: List[ChunkRecord] = []
        self.iteration_rows: List[dict] = []
        self.expected_steps = 0
        self.window = (0, -1)                 # iterations whose chunk records are kept
        self.job: Optional[_SearchJob] = None
        self.last_error: Optional[str] = None

    # --- settings ------------------------------------------------------------------------------
    def settings_for(self, index: int) -> Settings:
        for first, settings in reversed(self.schedule):
            if index >= first:
                return settings
        return self.schedule[0][1]

    def _switch(self, first: int, settings: Settings) -> None:
        self.schedule = self.schedule + ((first, settings),)

    # --- D(i): an iteration was fully dispatched ---------------------------------------------
    def dispatched(self, it) -> None:
        layout = tuple((r.key, r.tensor.numel() * r.tensor.element_size(), r.op)
                       for r in it.requests)
        if layout != self.layout:
            self.layout, self.stable = layout, 1
            self._layout_changed()
        else:
            self.stable += 1
        i, phase = it.index, self.phase
        if phase == "wait":
            # A window lies within one setting: the latest switch must be in force already.
            if (self.stable >= self.min_stable and i >= self.schedule[-1][0]
                    and self._ran_as_planned(it)):
                self._start_window("baseline", i + 1)
        elif phase in ("baseline", "trial"):
            self.starts[i] = it.t_first_ns
            if phase == "baseline" and self.lane.rank == 0:
                self._keep_iteration(it)
            if i == self.first + self.n:
                self.phase = "decide" if phase == "baseline" else "evaluate"
        elif phase == "switching":
            if i >= self.switch_at and self._ran_as_planned(it):
                self._start_window("trial", i + 1)

    def _ran_as_planned(self, it) -> bool:
        """Ran under a plan built for exactly its chunk layout (fifo: always)."""
        if self.policy != "priority":
            return True
        plan = it.plan
        return (plan is not None and len(plan.layout) == len(it.requests)
                and all(plan.layout.get(r.key) == len(r.chunks) for r in it.requests))

    def _start_window(self, kind: str, first: int) -> None:
        self.phase, self.first, self.starts = kind, first, {}
        if kind == "trial":
            self.trial_from = first
            return
        self.round += 1
        self.baseline_from, self.trial_from = first, None
        self.old, self.candidate = self.schedule[-1][1], None
        if self.lane.rank == 0:
            self.records, self.iteration_rows, self.expected_steps = [], [], 0
            self.window = (first, first + self.n)
            self.job = None
            self.collecting = True

    def _keep_iteration(self, it) -> None:
        self.iteration_rows.append({
            "rank": self.lane.rank, "lane": self.lane.name, "iteration": it.index,
            "t_first_submit_ns": it.t_first_ns, "t_flush_ns": None, "complete": 1,
            "planned": int(it.plan is not None)})
        self.expected_steps += sum(len(r.chunks) * len(r.steps) for r in it.requests)

    def _layout_changed(self) -> None:
        phase = self.phase
        if phase in ("baseline", "decide"):
            self._stop_collecting()
            self.phase = "wait"                 # nothing was switched: just start over
        elif phase in ("switching", "trial", "evaluate"):
            self.phase = "abort"                # revert at the next head
        elif phase == "done":
            self.phase = "wait"                 # a new layout gets its own round

    def _stop_collecting(self) -> None:
        self.collecting = False
        self.window = (0, -1)
        self.job = None

    # --- H(k): an iteration reached the head of the dispatch order ---------------------------
    def at_head(self, it) -> None:
        k = it.index
        schedule = self.schedule
        while len(schedule) > 1 and schedule[1][0] <= k:   # no submission can need them
            schedule = schedule[1:]
        self.schedule = schedule         # (the lane takes its credit window from it next)
        if self.phase == "decide":
            self._decide(k)
        elif self.phase == "evaluate":
            self._evaluate(k)
        elif self.phase == "abort":
            self._abort(k)

    def _decide(self, k: int) -> None:
        if not self.baseline_ns:
            self.baseline_ns = mean_iteration_ns(
                "baseline", [self.starts[i] for i in range(self.first, self.first + self.n + 1)])
        values = [-1] * 8
        if self.lane.rank == 0:
            values[:_BEGUN] = self._rank0_answer()
        values[_BEGUN], values[_MEASURED] = self.lane.begun(), self.baseline_ns
        out = self.lane.exchange(values, "decide")
        if out[_STATUS] == _NOT_READY:
            return                              # ask again at the next head
        self.baseline_ns = 0
        self.baseline_ms = out[_MEASURED] / 1e6
        self._stop_collecting()
        if out[_STATUS] == _FAILED:
            self.phase = "done"
            self._entry(k, "failed")
            return
        self.candidate = Settings(out[_PARTITION], out[_CREDIT], DECOMPOSITIONS[out[_DECOMPOSE]])
        self.predicted = (out[_PREDICTED] / 1e3, out[_PREDICTED_OLD] / 1e3)
        if self.candidate == self.old:
            self.phase = "done"
            self._entry(k, "unchanged")
            return
        self.switch_at = out[_BEGUN] + 1
        self._switch(self.switch_at, self.candidate)
        self.phase = "switching"
        self._entry(k, "trial", iteration=self.switch_at)

    def _rank0_answer(self) -> List[int]:
        """Rank 0's part of the decide exchange: not ready until its baseline chunks all
        completed and the search (started then, in a thread) finished."""
        job = self.job
        if job is None:
            if len(self.records) < self.expected_steps:
                return [_NOT_READY] + [0] * 5
            self.collecting = False
            records, self.records, self.window = self.records, [], (0, -1)
            self.job = _SearchJob(_profile_and_search, self.lane.name, self.lane.rank,
                                  self.old, self.policy, self.decompositions,
                                  self.iteration_rows, records)
            return [_NOT_READY] + [0] * 5
        if not job.done.is_set():
            return [_NOT_READY] + [0] * 5
        if job.error is not None:
            self.last_error = f"{type(job.error).__name__}: {job.error}"
            warnings.warn(f"commsched autotune, lane {self.lane.name}: the search failed "
                          f"({self.last_error}); settings unchanged", TuningWarning,
                          stacklevel=1)
            return [_FAILED] + [0] * 5
        settings, ms, old_ms = job.result
        return [_CHOSEN, int(settings.partition_bytes), int(settings.credit_bytes),
                DECOMPOSITIONS.index(settings.decompose), round(ms * 1e3), round(old_ms * 1e3)]

    def _evaluate(self, k: int) -> None:
        trial_ns = mean_iteration_ns(
            "trial", [self.starts[i] for i in range(self.first, self.first + self.n + 1)])
        out = self.lane.exchange([-1] * _BEGUN + [self.lane.begun(), trial_ns],
                                 "evaluate")
        trial_ms = out[_MEASURED] / 1e6
        self.phase = "done"
        if trial_ms < self.baseline_ms:
            self._entry(k, "keep", iteration=self.switch_at, trial_ms=trial_ms, kept=True)
        else:
            revert_at = out[_BEGUN] + 1
            self._switch(revert_at, self.old)
            self._entry(k, "revert", iteration=revert_at, trial_ms=trial_ms, kept=False)

    def _abort(self, k: int) -> None:
        """The request layout changed during a trial: back to the baseline's settings."""
        out = self.lane.exchange([-1] * _BEGUN + [self.lane.begun(), 0], "abort")
        revert_at = out[_BEGUN] + 1
        self._switch(revert_at, self.old)
        self.phase = "wait"
        self._entry(k, "abandoned", iteration=revert_at, kept=False)

    # --- records -------------------------------------------------------------------------------
    def _entry(self, k: int, event: str, *, iteration: Optional[int] = None,
               trial_ms: Optional[float] = None, kept: Optional[bool] = None) -> None:
        """One decision; every field is the same on every rank.

        event        trial (switch to the candidate), keep, revert, unchanged (the search
                     chose the current settings), failed (the search raised, on rank 0),
                     abandoned (the request layout changed during the trial: reverted)
        decided_at   the iteration at the head of the order when it was agreed
        iteration    from which iteration the resulting settings apply (None: no change)
        baseline_from / trial_from   first iteration of each window
        old_*, candidate_*   the baseline's settings and the search's choice
        predicted_ms, predicted_old_ms   the simulator's iteration time for each (rank 0)
        baseline_ms, trial_ms   measured mean iteration time of each window (MAX over ranks)
        kept         True / False once the trial was judged, else None
        """
        old, cand = self.old, self.candidate
        predicted, predicted_old = self.predicted if cand is not None else (None, None)
        entry = {
            "lane": self.lane.name, "round": self.round, "event": event, "decided_at": k,
            "iteration": iteration, "baseline_from": self.baseline_from,
            "trial_from": self.trial_from if event in ("keep", "revert") else None,
            "old_partition_bytes": old.partition_bytes, "old_credit_bytes": old.credit_bytes,
            "old_decompose": old.decompose,
            "candidate_partition_bytes": cand.partition_bytes if cand else None,
            "candidate_credit_bytes": cand.credit_bytes if cand else None,
            "candidate_decompose": cand.decompose if cand else None,
            "predicted_ms": predicted, "predicted_old_ms": predicted_old,
            "baseline_ms": self.baseline_ms, "trial_ms": trial_ms, "kept": kept,
        }
        self.log.append(entry)
        if self.reports:
            self.unreported.append(entry)

    def wants_records(self) -> bool:
        return self.collecting

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        """Chunk steps finished (completion thread, lock not held): rank 0 keeps the
        baseline window's records."""
        lo, hi = self.window
        for record in records:
            if lo <= record.iteration <= hi:
                self.records.append(record)

    def on_iteration(self, record) -> None:
        self._report()

    def drained(self) -> None:
        self._report()

    def _report(self) -> None:
        """Hand new decisions to the observer's ``on_tuning`` (training thread, lock not
        held)."""
        if not self.reports:
            return
        while self.unreported:
            try:
                entry = self.unreported.popleft()
            except IndexError:
                return
            self.observer.on_tuning(dict(entry))
