"""The narrow interface through which telemetry observes the scheduler.

The scheduler knows nothing about stores, NVML or traces: it hands finished records to an
``Observer``. ``on_chunks`` is called from the scheduler's completion thread, never from
the training thread, and must only enqueue (no I/O, no NVML).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

__all__ = ["ChunkRecord", "DeviceMark", "IterationRecord", "Observer"]


class ChunkRecord(NamedTuple):
    """One collective step that ran on one chunk. Times are ``time.time_ns()`` nanoseconds
    (wall clock, comparable across ranks and with NVML samples taken in another thread)."""

    lane: str                 # process-group label, e.g. "g0"; one lane per process group
    iteration: int            # scheduler iteration of the lane (0-based)
    request_key: str          # adapter's stable name for the request, e.g. "bucket3"
    op: str                   # the request's op: all_reduce | reduce_scatter | all_gather
    step: str                 # the collective that ran: all_reduce | reduce_scatter | all_gather
    decompose: str            # none | rs_ag
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


class Observer:
    """What observes a scheduler: subclass it and define ``on_chunk`` (and ``on_chunks``
    where a batch can be taken at once). The scheduler calls ``on_chunks`` and
    ``on_iteration`` only."""

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        """Chunk steps that finished together on the device, in issue order. Called from
        the completion thread, or, on CUDA without a credit window, from the thread that
        ends an iteration (see the scheduler's "Completion hand-off"); by default
        ``on_chunk`` for each."""
        for record in records:
            self.on_chunk(record)

    def on_chunk(self, record: ChunkRecord) -> None:
        """A chunk step finished on the device. Called where ``on_chunks`` is."""
        raise NotImplementedError

    def on_iteration(self, record: IterationRecord) -> None:
        """A lane's iteration was flushed (all its requests submitted). Training thread."""
