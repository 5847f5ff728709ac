"""Per-iteration rows from chunk and iteration records (no threads)."""

import pytest

from commsched.telemetry.assembly import IterationAssembler

from .helpers import MS, chunk, iteration

MIB = 1 << 20


def rs_ag_steps():
    """Request b0: 2 chunks of 1 MiB, all-reduce decomposed into RS + AG, 2 ranks.
    chunk 0: RS [10,14] AG [14,18] ms; chunk 1: RS [12,16] AG [16,20] ms."""
    common = dict(key="b0", num_chunks=2, nbytes=MIB, decompose="rs_ag", op="all_reduce")
    return [
        chunk(index=0, step="reduce_scatter", start=10 * MS, end=14 * MS, **common),
        chunk(index=1, step="reduce_scatter", start=12 * MS, end=16 * MS, **common),
        chunk(index=0, step="all_gather", start=14 * MS, end=18 * MS, **common),
        chunk(index=1, step="all_gather", start=16 * MS, end=20 * MS, **common),
    ]


def test_iteration_completes_only_when_every_step_of_every_chunk_finished():
    a = IterationAssembler(rank=0)
    steps = rs_ag_steps()
    for s in steps[:3]:
        rows = a.add_chunk(s)
        assert rows == []
    rows = a.add_iteration(iteration(first_submit=5 * MS, flush=15 * MS, requests=1,
                                        chunks=2, nbytes=2 * MIB))
    assert len(rows) == 1 and rows[0]["comm_ns"] is None and rows[0]["complete"] == 0
    rows = a.add_chunk(steps[3])          # the last all-gather arrives after the flush
    (row,) = rows
    assert row["complete"] == 1
    assert row["chunk_steps"] == 4
    # comm = union of [10,14] [12,16] [14,18] [16,20] = [10,20] -> 10 ms
    assert row["comm_ns"] == 10 * MS
    # exposed = last completion 20 ms - flush 15 ms
    assert row["exposed_comm_ns"] == 5 * MS
    # bus bytes: 4 steps x 1 MiB x (n-1)/n with n = 2 -> 2 MiB; over 10 ms
    assert row["bus_bytes"] == pytest.approx(2 * MIB)
    assert row["busbw_gbps"] == pytest.approx(2 * MIB / (10 * MS))
    assert (row["t_first_start_ns"], row["t_last_end_ns"]) == (10 * MS, 20 * MS)
    assert a.pending == 0


def test_an_iteration_missing_chunks_is_stored_incomplete_two_flushes_later():
    a = IterationAssembler(rank=0)
    a.add_chunk(chunk(iteration=0, key="b0", start=1 * MS, end=2 * MS))
    a.add_iteration(iteration(iteration=0, flush=1 * MS, requests=2, chunks=2))
    a.add_iteration(iteration(iteration=1, flush=10 * MS, requests=0, chunks=0))
    rows = a.add_iteration(iteration(iteration=2, flush=20 * MS, requests=0, chunks=0))
    by_it = {r["iteration"]: r for r in rows}
    assert by_it[0]["complete"] == 0
    assert by_it[0]["comm_ns"] == 1 * MS
    assert by_it[2]["complete"] == 1 and by_it[2]["comm_ns"] == 0


def test_failed_step_completes_its_chunk_and_is_counted():
    a = IterationAssembler(rank=0)
    a.add_iteration(iteration(flush=0, requests=1, chunks=1))
    rows = a.add_chunk(chunk(step="reduce_scatter", decompose="rs_ag", start=1, end=2,
                                ok=False, error="peer gone"))
    (row,) = rows
    assert row["failed_steps"] == 1 and row["complete"] == 1


def test_finish_stores_what_is_open():
    a = IterationAssembler(rank=0)
    a.add_chunk(chunk(start=1 * MS, end=2 * MS))   # its iteration record never comes
    rows = a.finish()
    assert rows[-1]["complete"] == 0 and rows[-1]["t_flush_ns"] is None
    assert rows[-1]["comm_ns"] == 1 * MS
    assert a.pending == 0


def test_nvlink_columns_are_left_to_the_report():
    """NVLink bytes per iteration need the neighbouring iterations' collectives (see
    analysis): the stored row leaves them empty."""
    a = IterationAssembler(rank=0)
    for s in rs_ag_steps():
        a.add_chunk(s)
    (row,) = a.add_iteration(iteration(flush=15 * MS, chunks=2, nbytes=2 * MIB))
    assert row["complete"] == 1
    assert all(row[k] is None for k in ("nvlink_tx_bytes", "nvlink_rx_bytes",
                                        "nvlink_tx_gbps", "nvlink_rx_gbps"))
