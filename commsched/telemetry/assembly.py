"""Joins chunk records and lane iteration records into ``iterations`` rows.

Pure bookkeeping, no threads or I/O: the writer thread feeds it and stores what it returns.

A lane iteration goes through two states, each producing a full row::

    flushed     IterationRecord arrived (end of backward): submit window known
    comm done   every chunk of every request completed: communication window, exposed
                comm and bus bandwidth known (the writer then asks for an NVLink sample)

Chunk records may arrive before their IterationRecord (chunks complete during backward)
or after it (the tail of the iteration's communication).

NVLink bytes per iteration are not stored here: they are each collective's share of the
counters' increases (``analysis``), which needs the collectives of the neighbouring
iterations too, and where the host runs ahead of the GPU those arrive an iteration or
more later. The report computes them from ``nvlink_metrics`` and ``comm_ops``; the
``iterations`` table's NVLink columns and ``iteration_links`` stay empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from ..observer import ChunkRecord, IterationRecord
from .metrics import bus_factor, union_ns

__all__ = ["IterationAssembler"]

# The steps an rs_ag-decomposed all-reduce chunk runs; any other chunk runs one step.
_RS_AG_STEPS = frozenset(("reduce_scatter", "all_gather"))
# An iteration still missing chunks when iteration i + _GIVE_UP_AFTER of its lane is flushed
# is stored as incomplete: its chunks are not coming (a failed collective, a lost record).
_GIVE_UP_AFTER = 2


@dataclass
class _LaneIteration:
    lane: str
    iteration: int
    record: Optional[IterationRecord] = None
    num_chunks: Dict[str, int] = field(default_factory=dict)       # request -> chunks
    steps_seen: Dict[Tuple[str, int], Set[str]] = field(default_factory=dict)
    done: Set[Tuple[str, int]] = field(default_factory=set)
    intervals: List[Tuple[int, int]] = field(default_factory=list)
    steps: int = 0
    failed: int = 0
    bus_bytes: float = 0.0
    t_first_submit: Optional[int] = None
    t_first_dispatch: Optional[int] = None
    t_first_start: Optional[int] = None
    t_last_end: Optional[int] = None
    comm_done: bool = False

    def comm_complete(self) -> bool:
        if self.record is None:
            return False
        if len(self.num_chunks) < self.record.requests:
            return False
        return len(self.done) >= sum(self.num_chunks.values())


class IterationAssembler:
    """Builds ``iterations`` rows for one rank. Each input returns the rows to write (an
    iteration's row again, complete, when its communication is over)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._open: Dict[Tuple[str, int], _LaneIteration] = {}
        self._closed: Set[Tuple[str, int]] = set()

    # --- inputs ------------------------------------------------------------------------------
    def add_chunk(self, rec: ChunkRecord) -> List[dict]:
        key = (rec.lane, rec.iteration)
        if key in self._closed:
            return []         # arrived after the iteration was given up on; comm_ops has it
        it = self._open.get(key) or self._begin(key)
        chunk = (rec.request_key, rec.chunk_index)
        it.num_chunks[rec.request_key] = rec.num_chunks
        seen = it.steps_seen.setdefault(chunk, set())
        seen.add(rec.step)
        needs_two = rec.decompose == "rs_ag" and rec.op == "all_reduce"
        if not rec.ok or not needs_two or _RS_AG_STEPS <= seen:
            it.done.add(chunk)
        it.steps += 1
        it.failed += 0 if rec.ok else 1
        if rec.ok and rec.t_end_ns > rec.t_start_ns:
            it.intervals.append((rec.t_start_ns, rec.t_end_ns))
            it.bus_bytes += rec.nbytes * bus_factor(rec.step, len(rec.group_ranks))
        it.t_first_submit = _min(it.t_first_submit, rec.t_submit_ns)
        it.t_first_dispatch = _min(it.t_first_dispatch, rec.t_dispatch_ns)
        it.t_first_start = _min(it.t_first_start, rec.t_start_ns)
        it.t_last_end = rec.t_end_ns if it.t_last_end is None else max(it.t_last_end,
                                                                         rec.t_end_ns)
        return self._advance(it)

    def add_iteration(self, rec: IterationRecord) -> List[dict]:
        key = (rec.lane, rec.iteration)
        if key in self._closed:
            return []         # a repeated record for a stored iteration
        it = self._open.get(key) or self._begin(key)
        it.record = rec
        rows = self._advance(it) or [self._row(it)]
        # Older iterations of this lane that still miss chunks will not get them now.
        for other in [o for o in self._open.values()
                      if o.lane == rec.lane and o.iteration <= rec.iteration - _GIVE_UP_AFTER]:
            rows += self._finalize(other)
        return rows

    def finish(self) -> List[dict]:
        """End of run: store every open iteration as it is (``complete = 0`` if chunks are
        missing)."""
        rows: List[dict] = []
        for it in list(self._open.values()):
            rows += self._finalize(it)
        return rows

    @property
    def pending(self) -> int:
        """Iterations whose communication is not over yet."""
        return len(self._open)

    # --- state transitions -------------------------------------------------------------------
    def _begin(self, key: Tuple[str, int]) -> _LaneIteration:
        it = self._open[key] = _LaneIteration(*key)
        return it

    def _advance(self, it: _LaneIteration) -> List[dict]:
        if not it.comm_done and it.comm_complete():
            return self._finalize(it)
        return []

    def _finalize(self, it: _LaneIteration) -> List[dict]:
        """Communication of ``it`` is over (or given up on): its complete row."""
        it.comm_done = True
        key = (it.lane, it.iteration)
        self._open.pop(key, None)
        self._closed.add(key)
        return [self._row(it)]

    def _row(self, it: _LaneIteration) -> dict:
        """The full ``iterations`` row as currently known (written with INSERT OR REPLACE)."""
        rec = it.record
        comm_ns = union_ns(it.intervals) if it.comm_done else None
        exposed = None
        if it.comm_done and rec is not None and it.t_last_end is not None:
            # Exposed communication: what is still running after the lane's flush (end of
            # backward), when nothing but waiting for it is left to do in the iteration.
            exposed = max(0, it.t_last_end - rec.t_flush_ns)
        elif it.comm_done and rec is not None:
            exposed = 0
        return dict(
            rank=self.rank, lane=it.lane, iteration=it.iteration,
            t_first_submit_ns=rec.t_first_submit_ns if rec else it.t_first_submit,
            t_flush_ns=rec.t_flush_ns if rec else None,
            requests=rec.requests if rec else len(it.num_chunks),
            chunks=rec.chunks if rec else len(it.done),
            nbytes=rec.nbytes if rec else None,
            planned=int(rec.planned) if rec else None,
            chunk_steps=it.steps, failed_steps=it.failed,
            t_first_dispatch_ns=it.t_first_dispatch, t_first_start_ns=it.t_first_start,
            t_last_end_ns=it.t_last_end, comm_ns=comm_ns, exposed_comm_ns=exposed,
            bus_bytes=it.bus_bytes if it.comm_done else None,
            busbw_gbps=(it.bus_bytes / comm_ns) if comm_ns else None,
            complete=int(it.comm_done and it.comm_complete()),
            nvlink_tx_bytes=None, nvlink_rx_bytes=None, nvlink_tx_gbps=None,
            nvlink_rx_gbps=None, nvlink_speed_gbps=None,
        )


def _min(current: Optional[int], value: int) -> int:
    return value if current is None else min(current, value)
