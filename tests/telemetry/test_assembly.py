"""Per-iteration rows from chunks, iteration records and NVLink samples (no threads)."""

import pytest

from commsched.telemetry.assembly import IterationAssembler
from commsched.telemetry.nvml import LinkInfo
from commsched.telemetry.sampler import CounterSample

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


def links(n=2, speed_mbps=25000):
    return [LinkInfo(l, 1, 6, speed_mbps, "switch", None) for l in range(n)]


def sample(t_ms, per_link, total):
    d = {l: (tx, rx, None, None) for l, (tx, rx) in per_link.items()}
    d[-1] = (*total, None, None)
    return CounterSample(int(t_ms * MS), 1000, d)


def test_iteration_completes_only_when_every_step_of_every_chunk_finished():
    a = IterationAssembler(rank=0)
    a.set_nvml(False, [])
    steps = rs_ag_steps()
    for s in steps[:3]:
        rows, _ = a.add_chunk(s)
        assert rows == []
    rows, _ = a.add_iteration(iteration(first_submit=5 * MS, flush=15 * MS, requests=1,
                                        chunks=2, nbytes=2 * MIB))
    assert len(rows) == 1 and rows[0]["comm_ns"] is None and rows[0]["complete"] == 0
    rows, _ = a.add_chunk(steps[3])          # the last all-gather arrives after the flush
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


def test_nvlink_bytes_come_from_the_samples_enclosing_the_comm_window():
    a = IterationAssembler(rank=0)
    a.set_nvml(True, links(2, 25000))
    a.add_sample(sample(5, {0: (0, 0), 1: (0, 0)}, (0, 0)))
    a.add_sample(sample(15, {0: (1000, 300), 1: (500, 300)}, (1500, 600)))
    for s in rs_ag_steps():
        a.add_chunk(s)
    rows, link_rows = a.add_iteration(iteration(first_submit=5 * MS, flush=15 * MS,
                                                chunks=2, nbytes=2 * MIB))
    assert link_rows == [] and a.pending == 1      # no sample after 20 ms yet
    rows, link_rows = a.add_sample(sample(25, {0: (3000, 1000), 1: (1000, 1000)},
                                          (4000, 2000)))
    (row,) = rows
    # window [10, 20] ms -> samples at 5 and 25 ms; totals 4000 / 2000 KiB
    assert row["nvlink_tx_bytes"] == 4000 * 1024
    assert row["nvlink_rx_bytes"] == 2000 * 1024
    assert row["nvlink_tx_gbps"] == pytest.approx(4000 * 1024 / (10 * MS))
    assert row["nvlink_speed_gbps"] == pytest.approx(50.0)
    by_key = {(r.link, r.direction): r for r in link_rows}
    link0 = by_key[(0, "tx")]
    assert link0.bytes == 3000 * 1024
    assert link0.gbps == pytest.approx(3072000 / 10e6)          # 0.3072 GB/s
    assert link0.speed_gbps == pytest.approx(25.0)
    assert link0.utilization == pytest.approx(0.3072 / 25.0)
    assert by_key[(1, "rx")].bytes == 1000 * 1024
    assert by_key[(-1, "tx")].bytes == 4000 * 1024
    assert a.pending == 0


def sums_sample(t_ms, total):
    return CounterSample(int(t_ms * MS), 1000, {-1: (*total, None, None)})


def test_sums_from_the_closest_samples_links_from_the_closest_per_link_ones():
    """Periodic samples carry only the sums: the totals use the tightest bracket, each
    link the per-link samples around the window, and the row waits for the latter."""
    a = IterationAssembler(rank=0)
    a.set_nvml(True, links(2, 25000))
    a.add_sample(sample(2, {0: (0, 0), 1: (0, 0)}, (0, 0)))
    a.add_sample(sums_sample(8, (100, 50)))                   # encloses the start (10 ms)
    for s in rs_ag_steps():
        a.add_chunk(s)
    a.add_iteration(iteration(first_submit=5 * MS, flush=15 * MS, chunks=2, nbytes=2 * MIB))
    rows, link_rows = a.add_sample(sums_sample(22, (3100, 1050)))   # encloses the end
    assert (rows, link_rows) == ([], []) and a.pending == 1   # waits for every link's
    rows, link_rows = a.add_sample(sample(30, {0: (2500, 800), 1: (1000, 400)}, (3500, 1200)))
    (row,) = rows
    assert row["nvlink_tx_bytes"] == (3100 - 100) * 1024     # samples at 8 and 22 ms
    assert row["nvlink_rx_bytes"] == (1050 - 50) * 1024
    by_key = {(r.link, r.direction): r.bytes for r in link_rows}
    assert by_key == {(-1, "tx"): 3000 * 1024, (-1, "rx"): 1000 * 1024,
                      (0, "tx"): 2500 * 1024, (0, "rx"): 800 * 1024,      # 2 and 30 ms
                      (1, "tx"): 1000 * 1024, (1, "rx"): 400 * 1024}
    assert a.pending == 0


def test_at_the_end_the_sums_are_stored_without_a_per_link_sample():
    a = IterationAssembler(rank=0)
    a.set_nvml(True, links(2, 25000))
    a.add_sample(sample(2, {0: (0, 0), 1: (0, 0)}, (0, 0)))
    for s in rs_ag_steps():
        a.add_chunk(s)
    a.add_iteration(iteration(first_submit=5 * MS, flush=15 * MS, chunks=2, nbytes=2 * MIB))
    assert a.add_sample(sums_sample(22, (3000, 1000))) == ([], [])
    rows, link_rows = a.finish()
    assert rows[-1]["nvlink_tx_bytes"] == 3000 * 1024
    assert {r.link for r in link_rows} == {-1}


def test_an_iteration_missing_chunks_is_stored_incomplete_two_flushes_later():
    a = IterationAssembler(rank=0)
    a.set_nvml(False, [])
    a.add_chunk(chunk(iteration=0, key="b0", start=1 * MS, end=2 * MS))
    a.add_iteration(iteration(iteration=0, flush=1 * MS, requests=2, chunks=2))
    a.add_iteration(iteration(iteration=1, flush=10 * MS, requests=0, chunks=0))
    rows, _ = a.add_iteration(iteration(iteration=2, flush=20 * MS, requests=0, chunks=0))
    by_it = {r["iteration"]: r for r in rows}
    assert by_it[0]["complete"] == 0
    assert by_it[0]["comm_ns"] == 1 * MS
    assert by_it[2]["complete"] == 1 and by_it[2]["comm_ns"] == 0


def test_failed_step_completes_its_chunk_and_is_counted():
    a = IterationAssembler(rank=0)
    a.set_nvml(False, [])
    a.add_iteration(iteration(flush=0, requests=1, chunks=1))
    rows, _ = a.add_chunk(chunk(step="reduce_scatter", decompose="rs_ag", start=1, end=2,
                                ok=False, error="peer gone"))
    (row,) = rows
    assert row["failed_steps"] == 1 and row["complete"] == 1


def test_finish_stores_what_is_open_with_the_samples_there_are():
    a = IterationAssembler(rank=0)
    a.set_nvml(True, links(1))
    a.add_sample(sample(0, {0: (0, 0)}, (0, 0)))
    a.add_chunk(chunk(start=1 * MS, end=2 * MS))   # its iteration record never comes
    a.add_sample(sample(3, {0: (10, 5)}, (10, 5)))
    rows, link_rows = a.finish()
    assert rows[-1]["complete"] == 0 and rows[-1]["t_flush_ns"] is None
    assert rows[-1]["nvlink_tx_bytes"] == 10 * 1024
    assert a.pending == 0
