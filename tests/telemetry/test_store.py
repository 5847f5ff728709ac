"""The recorder and the store: round trip, missing NVML, failures that must not reach
training, and the reader's errors."""

import os
import sqlite3
import warnings

import pytest

import commsched.telemetry as telemetry
from commsched.config import Config
from commsched.telemetry import TelemetryError, TelemetryWarning, load_run, open_recorder
from commsched.telemetry.nvml import FakeGpu, FakeLink, FakeNvmlBackend
from commsched.telemetry.recorder import active_recorders
from commsched.telemetry.store import SCHEMA_VERSION, create_store

from .helpers import MS, T0, chunk, iteration

MIB = 1 << 20
TABLES = {"runs", "intra_node_topo", "nvlink_metrics", "nvlink_health", "comm_ops",
          "iterations", "iteration_links", "app_steps"}


def record_iterations(rec, rank, n_iters=3, batched=False):
    """Per iteration k (base b = T0 + k*100 ms): two 1 MiB chunks of bucket0 on ranks (0,1):
    [b+10, b+20] and [b+15, b+30] ms; flush at b+25 ms; then a step marker. ``batched``:
    the chunks of an iteration arrive in one ``on_chunks`` call."""
    for k in range(n_iters):
        b = T0 + k * 100 * MS
        records = [chunk(iteration=k, key="bucket0", index=idx, num_chunks=2, nbytes=MIB,
                         start=b + s * MS, end=b + e * MS, submit=b + 5 * MS, priority=rank)
                   for idx, (s, e) in enumerate([(10, 20), (15, 30)])]
        if batched:
            rec.on_chunks(records)
        else:
            for record in records:
                rec.on_chunk(record)
        rec.on_iteration(iteration(iteration=k, first_submit=b + 5 * MS, flush=b + 25 * MS,
                                   requests=1, chunks=2, nbytes=2 * MIB))
        rec.step()


def test_two_ranks_round_trip_through_one_run_directory(tmp_path):
    cfg = Config(telemetry_dir=str(tmp_path))
    recs = [open_recorder(cfg, rank=r, world_size=2, nvml_period_ms=0) for r in (0, 1)]
    for r, rec in enumerate(recs):
        record_iterations(rec, r)
    for rec in recs:
        rec.close()
    assert sorted(os.listdir(tmp_path)) == ["rank0.sqlite", "rank1.sqlite"]
    run = load_run(str(tmp_path))
    # the recorder writes the optional topology table too
    assert set(run.tables) == TABLES | {"topology"}
    assert run.ranks == [0, 1]
    for r in (0, 1):
        info = run.rows("runs", r)[0]
        assert (info["world_size"], info["nvml_status"]) == (2, "disabled")
        assert info["python_version"] and info["torch_version"]
        assert '"telemetry_dir"' in info["config_json"]
        ops = run.rows("comm_ops", r)
        assert len(ops) == 3 * 2
        first = [o for o in ops if o["iteration"] == 0 and o["chunk_index"] == 0][0]
        # 1 MiB in 10 ms: algbw 1048576 / 1e7 ns = 0.1048576 GB/s; all_reduce n=2 factor 1
        assert first["duration_ns"] == 10 * MS
        assert first["algbw_gbps"] == pytest.approx(0.1048576)
        assert first["busbw_gbps"] == pytest.approx(0.1048576)
        assert first["group_size"] == 2 and first["priority"] == r
        its = run.rows("iterations", r)
        assert [i["iteration"] for i in its] == [0, 1, 2]
        for i in its:
            assert i["complete"] == 1
            assert i["comm_ns"] == 20 * MS            # [10,20] u [15,30]
            assert i["exposed_comm_ns"] == 5 * MS     # last end 30 - flush 25
            assert i["nbytes"] == 2 * MIB
        assert [s["step"] for s in run.rows("app_steps", r)] == [0, 1, 2]


def test_batched_chunk_records_store_what_single_ones_do(tmp_path):
    cfg = Config(telemetry_dir=str(tmp_path))
    recs = [open_recorder(cfg, rank=r, world_size=2, nvml_period_ms=0) for r in (0, 1)]
    record_iterations(recs[0], 0)
    record_iterations(recs[1], 0, batched=True)
    for rec in recs:
        rec.close()
    run = load_run(str(tmp_path))
    for table in ("comm_ops", "iterations"):
        single, batched = ([{k: v for k, v in row.items() if k != "rank"}
                            for row in run.rows(table, r)] for r in (0, 1))
        assert single and single == batched, table


def test_live_store_is_readable_after_flush(tmp_path):
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                        nvml_period_ms=0)
    record_iterations(rec, 0, n_iters=2)
    assert rec.flush()
    assert len(load_run(str(tmp_path)).iterations) == 2
    rec.close()


def test_fake_nvml_fills_topology_and_samples(tmp_path):
    backend = FakeNvmlBackend([FakeGpu(links=[FakeLink(tx_kib=4, rx_kib=4)] * 2)])
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1, device=0,
                        nvml_backend=backend, nvml_period_ms=5)
    record_iterations(rec, 0, n_iters=2)
    threads = [rec._writer._thread, rec._sampler._thread]
    assert all(t.is_alive() and t.daemon for t in threads)
    rec.close()
    assert not any(t.is_alive() for t in threads)      # close() stops both threads
    run = load_run(str(tmp_path))
    assert run.runs[0]["nvml_status"] == "ok"
    assert run.runs[0]["driver_version"] == "580.00"
    assert [t["link"] for t in run.rows("intra_node_topo")] == [0, 1]
    samples = [s for s in run.rows("nvlink_metrics") if s["link"] == -1]
    assert len(samples) >= 2
    # per-link samples sum to the link -1 row of the same sample
    per = {}
    for s in run.rows("nvlink_metrics"):
        per.setdefault(s["sample"], {})[s["link"]] = s["data_tx_kib"]
    for links in per.values():
        assert links[-1] == links[0] + links[1]


@pytest.mark.parametrize("device, status", [(None, "no_gpu"), ("cpu", "no_gpu"),
                                            (0, {"no_nvml", "no_pynvml"})])
def test_missing_gpu_or_nvml_is_recorded_once_in_runs(tmp_path, device, status):
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                        device=device)
    record_iterations(rec, 0, n_iters=1)
    rec.close()
    run = load_run(str(tmp_path))
    got = run.runs[0]["nvml_status"]
    assert got in status if isinstance(status, set) else got == status
    assert run.rows("nvlink_metrics") == []
    assert len(run.iterations) == 1


def test_unwritable_directory_gives_one_warning_and_a_disabled_recorder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = open_recorder(Config(telemetry_dir=str(blocker / "run")), rank=0, world_size=1)
        rec.on_chunk(chunk())
        rec.on_iteration(iteration())
        rec.step()
        rec.close()
    assert [w.category for w in caught] == [TelemetryWarning]
    assert "cannot write" in str(caught[0].message)
    assert not rec.enabled


def test_full_disk_midway_gives_one_warning_and_training_goes_on(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (a store holds 17 pages of 4 KiB before its first row)
        rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                            nvml_period_ms=0, max_db_bytes=96 << 10)
        for k in range(2000):
            rec.on_chunk(chunk(iteration=k, key=f"bucket{k}" * 20, start=k, end=k + 1))
            if k % 100 == 0:
                rec.flush()
        rec.flush()
        rec.close()
    assert [w.category for w in caught] == [TelemetryWarning]
    # (the cap stands in for a full disk, and is named as the cause)
    assert "size cap, COMMSCHED_TELEMETRY_MAX_BYTES=98304 bytes" in str(caught[0].message)
    assert not rec.enabled
    assert len(load_run(str(tmp_path)).comm_ops) > 0     # what was committed stays readable


def test_telemetry_dir_unset_gives_a_disabled_recorder(tmp_path):
    rec = open_recorder(Config(), rank=0, world_size=1)
    assert not rec.enabled
    rec.on_chunk(chunk())
    rec.close()


def test_module_step_reaches_every_open_recorder_and_close_is_idempotent(tmp_path):
    telemetry.step()                                  # no recorder: nothing happens
    recs = [open_recorder(Config(telemetry_dir=str(tmp_path)), rank=r, world_size=2,
                          nvml_period_ms=0) for r in (0, 1)]
    assert all(r in active_recorders() for r in recs)
    telemetry.step()
    telemetry.step()
    for rec in recs:
        rec.close()
        rec.close()
    telemetry.step()                                  # closed: no-op
    assert not any(r in active_recorders() for r in recs)
    run = load_run(str(tmp_path))
    assert [(s["rank"], s["step"]) for s in run.rows("app_steps")] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]


# --- reader errors -----------------------------------------------------------------------

def test_corrupt_file_is_a_clear_telemetry_error(tmp_path):
    (tmp_path / "rank0.sqlite").write_bytes(b"\x00garbage" * 512)
    with pytest.raises(TelemetryError, match=r"rank0\.sqlite"):
        load_run(str(tmp_path))


def test_foreign_sqlite_database_is_rejected(tmp_path):
    conn = sqlite3.connect(tmp_path / "rank0.sqlite")
    conn.execute("CREATE TABLE songs (title TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(TelemetryError, match="not a commsched telemetry store"):
        load_run(str(tmp_path))


def test_newer_schema_asks_for_an_upgrade(tmp_path):
    conn = create_store(str(tmp_path / "rank0.sqlite"))
    conn.execute("UPDATE meta SET value = ? WHERE key = 'version'", (str(SCHEMA_VERSION + 1),))
    conn.close()
    with pytest.raises(TelemetryError, match="newer commsched"):
        load_run(str(tmp_path))


def test_empty_or_missing_directory(tmp_path):
    with pytest.raises(TelemetryError, match="no telemetry store"):
        load_run(str(tmp_path))
    with pytest.raises(TelemetryError, match="not a directory"):
        load_run(str(tmp_path / "missing"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_never_writes_the_parents_store(tmp_path):
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                        nvml_period_ms=0)
    pid = os.fork()
    if pid == 0:                            # child: every call must be a silent no-op
        code = 0
        try:
            telemetry.step()
            rec.on_chunk(chunk())
            rec.close()
            code = 0 if not rec.enabled and not active_recorders() else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rec.step()
    rec.close()
    run = load_run(str(tmp_path))
    assert [s["step"] for s in run.rows("app_steps")] == [0]
    assert run.comm_ops == []
