"""Joins chunk records, lane iteration records and NVLink samples into ``iterations`` rows.

Pure bookkeeping, no threads or I/O: the writer thread feeds it and stores what it returns.

A lane iteration goes through three states, each producing a full row::

    flushed     IterationRecord arrived (end of backward): submit window known
    comm done   every chunk of every request completed: communication window, exposed
                comm and bus bandwidth known (the writer then asks for an NVLink sample)
    links done  a sample at or after the last completion exists: NVLink bytes over the
                communication window, per link and direction (per link: between the
                samples that read every link, when the sampler takes such samples)

Chunk records may arrive before their IterationRecord (chunks complete during backward)
or after it (the tail of the iteration's communication).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from ..observer import ChunkRecord, IterationRecord
from .metrics import KIB, bracket, bus_factor, union_ns
from .nvml import LinkInfo
from .sampler import ALL_LINKS, CounterSample

__all__ = ["IterationAssembler", "LinkRow"]

# The steps an rs_ag-decomposed all-reduce chunk runs; any other chunk runs one step.
_RS_AG_STEPS = frozenset(("reduce_scatter", "all_gather"))
_SAMPLE_HORIZON_NS = 120 * 10**9   # samples older than this (vs the newest) are dropped
# An iteration still missing chunks when iteration i + _GIVE_UP_AFTER of its lane is flushed
# is stored as incomplete: its chunks are not coming (a failed collective, a lost record).
_GIVE_UP_AFTER = 2


@dataclass
class LinkRow:
    lane: str
    iteration: int
    link: int
    direction: str          # tx | rx
    bytes: int
    gbps: Optional[float]
    speed_gbps: Optional[float]
    utilization: Optional[float]


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
    row: dict = field(default_factory=dict)

    def comm_complete(self) -> bool:
        if self.record is None:
            return False
        if len(self.num_chunks) < self.record.requests:
            return False
        return len(self.done) >= sum(self.num_chunks.values())


class IterationAssembler:
    """Builds ``iterations`` and ``iteration_links`` rows for one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self._open: Dict[Tuple[str, int], _LaneIteration] = {}
        self._awaiting_links: List[_LaneIteration] = []
        self._closed: Set[Tuple[str, int]] = set()
        self._times: List[int] = []
        self._samples: List[CounterSample] = []
        self._link_times: List[int] = []              # the samples that read every link
        self._link_samples: List[CounterSample] = []
        self._speed_gbps: Dict[int, float] = {}
        self._nvml_active: Optional[bool] = None   # None: not known yet

    # --- inputs ------------------------------------------------------------------------------
    def set_nvml(self, active: bool, links: List[LinkInfo]) -> None:
        """NVML start-up result: link speeds (for utilization), or no NVLink data coming."""
        self._nvml_active = active
        for l in links:
            if l.state == 1 and l.speed_mbps:
                self._speed_gbps[l.link] = l.speed_mbps / 1000.0   # MB/s -> GB/s
        if self._speed_gbps:
            self._speed_gbps[ALL_LINKS] = sum(self._speed_gbps.values())
        if not active:
            self._awaiting_links.clear()

    def add_chunk(self, rec: ChunkRecord) -> Tuple[List[dict], List[LinkRow]]:
        key = (rec.lane, rec.iteration)
        if key in self._closed:
            return [], []     # arrived after the iteration was given up on; comm_ops has it
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

    def add_iteration(self, rec: IterationRecord) -> Tuple[List[dict], List[LinkRow]]:
        key = (rec.lane, rec.iteration)
        if key in self._closed:
            return [], []     # a repeated record for a stored iteration
        it = self._open.get(key) or self._begin(key)
        it.record = rec
        rows, links = self._advance(it)
        if not rows:
            rows = [self._row(it)]
        # Older iterations of this lane that still miss chunks will not get them now.
        for other in [o for o in self._open.values()
                      if o.lane == rec.lane and o.iteration <= rec.iteration - _GIVE_UP_AFTER]:
            r2, l2 = self._finalize(other)
            rows += r2
            links += l2
        return rows, links

    def add_sample(self, sample: CounterSample) -> Tuple[List[dict], List[LinkRow]]:
        _insert(self._times, self._samples, sample)
        if len(sample.links) > 1:                  # per link, not only the sums
            _insert(self._link_times, self._link_samples, sample)
        rows: List[dict] = []
        links: List[LinkRow] = []
        for it in list(self._awaiting_links):
            r2, l2 = self._try_links(it)
            rows += r2
            links += l2
        return rows, links

    def finish(self) -> Tuple[List[dict], List[LinkRow]]:
        """End of run: store every open iteration as it is (``complete = 0`` if chunks are
        missing) and compute link rows with the samples there are."""
        rows: List[dict] = []
        links: List[LinkRow] = []
        for it in list(self._open.values()):
            r2, l2 = self._finalize(it)
            rows += r2
            links += l2
        for it in list(self._awaiting_links):
            r2, l2 = self._try_links(it, final=True)
            rows += r2
            links += l2
        self._awaiting_links.clear()
        return rows, links

    @property
    def pending(self) -> int:
        """Iterations not fully stored yet (open or awaiting an NVLink sample)."""
        return len(self._open) + len(self._awaiting_links)

    # --- state transitions -------------------------------------------------------------------
    def _begin(self, key: Tuple[str, int]) -> _LaneIteration:
        it = self._open[key] = _LaneIteration(*key)
        return it

    def _advance(self, it: _LaneIteration) -> Tuple[List[dict], List[LinkRow]]:
        if not it.comm_done and it.comm_complete():
            return self._finalize(it)
        return [], []

    def _finalize(self, it: _LaneIteration) -> Tuple[List[dict], List[LinkRow]]:
        """Communication of ``it`` is over (or given up on): store the comm row, then try
        the NVLink stage."""
        it.comm_done = True
        key = (it.lane, it.iteration)
        self._open.pop(key, None)
        self._closed.add(key)
        rows = [self._row(it)]
        if it.intervals and self._nvml_active is not False:
            self._awaiting_links.append(it)
            r2, links = self._try_links(it)
            return rows + r2, links
        return rows, []

    def _try_links(self, it: _LaneIteration, final: bool = False
                   ) -> Tuple[List[dict], List[LinkRow]]:
        """NVLink bytes between the samples that enclose the communication window: the
        sums between the closest samples, each link between the closest that read every
        link (waited for when such samples are taken, unless ``final``)."""
        ij = bracket(self._times, it.t_first_start, it.t_last_end)
        if ij is None:
            return [], []                       # the enclosing sample is not there yet
        pairs = [(self._samples[ij[0]], self._samples[ij[1]], True)]
        if self._link_times:
            kl = bracket(self._link_times, it.t_first_start, it.t_last_end)
            if kl is None and not final:
                return [], []                   # the per-link sample is not there yet
            if kl is not None:
                pairs.append((self._link_samples[kl[0]], self._link_samples[kl[1]], False))
        self._awaiting_links.remove(it)
        comm_ns = union_ns(it.intervals)
        out: List[LinkRow] = []
        for before, after, sums in pairs:
            out += self._link_rows(it, before, after, sums, comm_ns)
        for r in out:
            if r.link == ALL_LINKS:
                it.row[f"nvlink_{r.direction}_bytes"] = r.bytes
                it.row[f"nvlink_{r.direction}_gbps"] = r.gbps
        it.row["nvlink_speed_gbps"] = self._speed_gbps.get(ALL_LINKS)
        return [self._row(it)], out

    def _link_rows(self, it: _LaneIteration, before: CounterSample, after: CounterSample,
                   sums: bool, comm_ns: int) -> List[LinkRow]:
        """Rows of the sums (``sums``) or of every link, from two samples."""
        out: List[LinkRow] = []
        for link, values in after.links.items():
            old = before.links.get(link)
            if old is None or (link == ALL_LINKS) != sums:
                continue
            for slot, direction in ((0, "tx"), (1, "rx")):
                if values[slot] is None or old[slot] is None or values[slot] < old[slot]:
                    continue
                nbytes = (values[slot] - old[slot]) * KIB
                gbps = nbytes / comm_ns if comm_ns > 0 else None
                speed = self._speed_gbps.get(link)
                util = gbps / speed if gbps is not None and speed else None
                out.append(LinkRow(it.lane, it.iteration, link, direction, nbytes, gbps,
                                   speed, util))
        return out

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
        row = it.row
        row.update(
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
        )
        for k in ("nvlink_tx_bytes", "nvlink_rx_bytes", "nvlink_tx_gbps", "nvlink_rx_gbps",
                  "nvlink_speed_gbps"):
            row.setdefault(k, None)
        return dict(row)


def _insert(times: List[int], samples: List[CounterSample], sample: CounterSample) -> None:
    """Add ``sample`` in time order; drop samples older than the horizon (but one)."""
    if times and sample.t_ns < times[-1]:
        i = bisect.bisect(times, sample.t_ns)       # clocks are not monotonic
        times.insert(i, sample.t_ns)
        samples.insert(i, sample)
    else:
        times.append(sample.t_ns)
        samples.append(sample)
    cut = bisect.bisect_left(times, times[-1] - _SAMPLE_HORIZON_NS)
    if cut > 1:
        del times[:cut - 1], samples[:cut - 1]


def _min(current: Optional[int], value: int) -> int:
    return value if current is None else min(current, value)
