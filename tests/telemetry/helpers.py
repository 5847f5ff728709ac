"""Builders for synthetic telemetry inputs: chunk and iteration records, and whole run
directories written through the real writer with explicit timestamps."""

from __future__ import annotations

import os
from typing import Iterable, Optional, Tuple

from commsched.observer import ChunkRecord, IterationRecord
from commsched.telemetry.store import create_store, rank_path
from commsched.telemetry.writer import StoreWriter

MS = 1_000_000          # nanoseconds per millisecond
T0 = 1_700_000_000 * 10**9   # an arbitrary wall-clock origin


def chunk(*, lane="g0", iteration=0, key="bucket0", index=0, num_chunks=1, nbytes=1 << 20,
          start=0, end=1, op="all_reduce", step="all_reduce", decompose="none",
          ranks: Tuple[int, ...] = (0, 1), priority=0, submit=None, dispatch=None,
          ok=True, error="") -> ChunkRecord:
    return ChunkRecord(lane, iteration, key, op, step, decompose, index, num_chunks, nbytes,
                       "float32", ranks, priority,
                       start if submit is None else submit,
                       start if dispatch is None else dispatch, start, end, ok, error)


def iteration(*, lane="g0", iteration=0, first_submit=0, flush=0, requests=1, chunks=1,
              nbytes=1 << 20, planned=False, mark=None) -> IterationRecord:
    return IterationRecord(lane, iteration, first_submit, flush, requests, chunks, nbytes,
                           planned, mark)


def write_run(run_dir: str, rank: int, messages: Iterable[object], *, world_size: int = 2,
              start_ns: int = T0, host: str = "node0",
              nvml_status: Optional[str] = None, device_clock=None) -> str:
    """Write one rank's store from ``messages`` (records, StepMarker, NvmlStatus,
    CounterSample, HealthSample) through the real writer thread; returns the file.
    ``device_clock``: stands in for the writer's CUDA clock of flush marks."""
    os.makedirs(run_dir, exist_ok=True)
    path = rank_path(run_dir, rank)
    conn = create_store(path)
    conn.execute("INSERT INTO runs (rank, world_size, local_rank, host, pid, start_ns, "
                 "config_json, torch_version, nvml_status) VALUES (?, ?, 0, ?, 1, ?, '{}', "
                 "'test', ?)", (rank, world_size, host, start_ns, nvml_status or "disabled"))
    writer = StoreWriter(conn, rank, node=host)
    writer.device_clock = device_clock
    writer.start()
    for m in messages:
        writer.put(m)
    assert writer.close(timeout=30)
    assert writer.failed is None, writer.failed
    return path
