"""The narrow interface through which instruments (telemetry, the tuner, NVTX ranges) see
the scheduler: the records it hands over, and ``Extension``, the one protocol they
implement.

The scheduler knows nothing about stores, NVML, traces or tuning: a lane calls its
extension at a few named points, and a lane without one calls nothing (``lean``).
``on_chunks`` is called from the scheduler's completion thread or the thread that ends an
iteration, and must only enqueue (no I/O, no NVML).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from .errors import NotSupportedError

__all__ = ["AutoChoice", "ChunkRecord", "DeviceMark", "IterationRecord", "Extension",
           "Extensions", "LaneInfo", "Observer", "as_extension"]


class ChunkRecord(NamedTuple):
    """One collective step that ran on one chunk. Times are ``time.time_ns()`` nanoseconds
    (wall clock, comparable across ranks and with NVML samples taken in another thread)."""

    lane: str                 # process-group label, e.g. "g0"; one lane per process group
    iteration: int            # scheduler iteration of the lane (0-based)
    request_key: str          # adapter's stable name for the request, e.g. "bucket3"
    op: str                   # the request's op: all_reduce | reduce_scatter | all_gather
    step: str                 # the collective that ran: all_reduce | reduce_scatter | all_gather
    decompose: str            # the request's: none | rs_ag | hier | leader (auto's choice)
    chunk_index: int          # index of the chunk within its request
    num_chunks: int           # chunks in the request
    nbytes: int               # payload bytes of the chunk (the full-size tensor, before any split)
    dtype: str                # e.g. "float32"
    group_ranks: Tuple[int, ...]  # global ranks of the process group
    priority: int             # lower = needed earlier by the next forward
    t_submit_ns: int          # request handed to the scheduler
    t_dispatch_ns: int        # collective call issued (host)
    t_start_ns: int           # device start (CUDA, see docs/telemetry.md), or dispatch on CPU
    t_end_ns: int             # device completion (CUDA, see there) / work.wait() returned
    ok: bool = True           # False when the collective raised
    error: str = ""


class DeviceMark(NamedTuple):
    """A point in a CUDA stream: a timed event recorded there, and its device."""

    device: object            # torch.device
    event: object             # torch.cuda.Event(enable_timing=True)


class IterationRecord(NamedTuple):
    """An iteration of a lane: from its first submission to the end-of-iteration flush."""

    lane: str
    iteration: int
    t_first_submit_ns: int
    t_flush_ns: int           # when end_iteration() was called (host)
    requests: int
    chunks: int
    nbytes: int
    planned: bool             # dispatched by a priority plan (False: fifo order)
    # On CUDA, with an observer: the flush in the caller's stream. Where the host runs
    # ahead of the GPU, the device gets there (ends backward) after t_flush_ns.
    flush_mark: Optional[DeviceMark] = None


class AutoChoice(NamedTuple):
    """``decompose=auto`` measured a lane's candidates and chose per chunk size (the same
    table on every rank, see calibrate.py)."""

    lane: str
    dtype: str                # of the request that was measured, e.g. "float32"
    nodes: int
    local_size: int           # ranks per node
    margin: float             # calibrate.AUTO_MARGIN in force
    rows: Tuple[dict, ...]    # per size: bytes, <candidate>_us, chosen (AutoTable.rows())


class LaneInfo(NamedTuple):
    """What a lane tells the extensions made for it (``Scheduler(extensions=...)``)."""

    name: str                 # the lane's label, e.g. "g0"
    rank: int                 # this process's rank in the lane's group
    world_size: int
    config: object            # the lane's commsched.Config
    observer: Optional["Extension"]     # the scheduler's observer (telemetry), if any
    # exchange(values, what): one all_reduce(MAX) of int64 ``values`` over the lane's group,
    # in its collective sequence (call only where every rank calls it, see the tuner)
    exchange: Callable[[Sequence[int], str], List[int]]
    begun: Callable[[], int]  # iterations begun on the lane so far


class Extension:
    """What instruments a lane, called at named points; the base does nothing, so an
    extension defines only the points it needs. Lane state is never written from here:
    what an extension decides comes back through ``settings_for``.

    Points, in the order a request meets them:

    * ``settings_for(index)``: the settings (partition, credit window, decomposition) of
      lane iteration ``index`` (the tuner), or None for the config's. Read at submission,
      when an iteration reaches the head of the order, and when its layout is noted.
    * ``at_head(it)``: iteration ``it`` reached the head of the dispatch order (lock held;
      every rank passes here in the same order).
    * ``dispatched(it)``: every step of ``it`` was issued (lock held; likewise).
    * ``issuing(name)`` / ``issued()``: around each collective step issued.
    * ``wants_records()``: whether the steps completing now are wanted as ChunkRecords.
    * ``on_chunks(records)``: steps that finished on the device, in issue order.
    * ``on_iteration(record)``: an iteration was ended (caller's thread).
    * ``auto_chosen(choice)``: ``decompose=auto`` chose per chunk size (an ``AutoChoice``;
      the submitting thread, once per lane).
    * ``drained()``: the lane was drained (caller's thread).

    ``timed``: the lane times every step on the device (events), for its records.
    ``tunes``: ``settings_for`` may change the lane's settings from one iteration to the
    next (the tuner); the lane then completes each step as it finishes."""

    timed = False
    tunes = False

    def settings_for(self, index: int):
        return None

    def at_head(self, it) -> None:
        pass

    def dispatched(self, it) -> None:
        pass

    def issuing(self, name: str) -> None:
        pass

    def issued(self) -> None:
        pass

    def wants_records(self) -> bool:
        return self.timed

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        pass

    def on_iteration(self, record: IterationRecord) -> None:
        pass

    def auto_chosen(self, choice: AutoChoice) -> None:
        pass

    def drained(self) -> None:
        pass


class Extensions(Extension):
    """Several extensions of one lane as one, each point called on each in order."""

    def __init__(self, parts: Sequence[Extension]):
        self.parts = tuple(parts)
        self.timed = any(p.timed for p in self.parts)
        self.tunes = any(p.tunes for p in self.parts)

    def settings_for(self, index: int):
        for part in self.parts:
            settings = part.settings_for(index)
            if settings is not None:
                return settings
        return None

    def at_head(self, it) -> None:
        for part in self.parts:
            part.at_head(it)

    def dispatched(self, it) -> None:
        for part in self.parts:
            part.dispatched(it)

    def issuing(self, name: str) -> None:
        for part in self.parts:
            part.issuing(name)

    def issued(self) -> None:
        for part in reversed(self.parts):
            part.issued()

    def wants_records(self) -> bool:
        return any(p.wants_records() for p in self.parts)

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        for part in self.parts:
            if part.wants_records():
                part.on_chunks(records)

    def on_iteration(self, record: IterationRecord) -> None:
        for part in self.parts:
            part.on_iteration(record)

    def auto_chosen(self, choice: AutoChoice) -> None:
        for part in self.parts:
            part.auto_chosen(choice)

    def drained(self) -> None:
        for part in self.parts:
            part.drained()


class Observer(Extension):
    """What observes a scheduler (telemetry): subclass it and define ``on_chunk`` (and
    ``on_chunks`` where a batch can be taken at once) and ``on_iteration``. It times every
    step and wants every record; one observer serves all the lanes of a scheduler."""

    timed = True

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        """Chunk steps that finished together on the device, in issue order. Called from
        the completion thread, or, on CUDA without a credit window, from the thread that
        ends an iteration (see [Note: completion hand-off] in docs/design.md); by default
        ``on_chunk`` for each."""
        for record in records:
            self.on_chunk(record)

    def on_chunk(self, record: ChunkRecord) -> None:
        """A chunk step finished on the device. Called where ``on_chunks`` is."""
        raise NotSupportedError(f"{type(self).__name__}: an Observer implements on_chunk "
                                "or on_chunks")

    def on_iteration(self, record: IterationRecord) -> None:
        """A lane's iteration was flushed (all its requests submitted). Training thread."""


class _Observing(Observer):
    """An object with ``on_chunks`` and ``on_iteration`` as an observer."""

    def __init__(self, target):
        self.target = target

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        self.target.on_chunks(records)

    def on_iteration(self, record: IterationRecord) -> None:
        self.target.on_iteration(record)


def as_extension(observer) -> Extension:
    """``observer`` as a lane extension: an ``Extension`` is one; any other object with
    ``on_chunks`` and ``on_iteration`` is observed as an ``Observer`` would be."""
    return observer if isinstance(observer, Extension) else _Observing(observer)
