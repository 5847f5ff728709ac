"""The writer wakes only for messages that may complete or end an iteration: the sampler's
several samples per iteration wait for the next wake-up (each wake-up takes the GIL, during
backward from autograd's thread), at most DEFER_S, and a flush stores them."""

import sqlite3
import time

from commsched.telemetry import writer as writer_module
from commsched.telemetry.nvml import GpuInfo, LinkInfo
from commsched.telemetry.sampler import CounterSample, HealthSample, NvmlStatus
from commsched.telemetry.store import create_store, rank_path
from commsched.telemetry.writer import StepMarker, StoreWriter

from .helpers import MS, T0


def _sampler_messages(n):
    links = [LinkInfo(l, 1, 6, 25000, "switch", None) for l in range(2)]
    yield NvmlStatus("ok", "2 active links", "580.00", GpuInfo(0, "Fake", "GPU-0",
                                                               "0000:10:00.0"), links)
    yield HealthSample(T0, {l: (1, 25000, 0, 0, 0, 0) for l in range(2)})
    for k in range(n):
        yield CounterSample(T0 + k * MS, 1000, {-1: (k, k, None, None)})


def _count(path, table):
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def _until(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_samples_wait_for_the_next_wake_up(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "DEFER_S", 60.0)     # no timed wake-up in this test
    path = rank_path(str(tmp_path), 0)
    writer = StoreWriter(create_store(path), 0)
    writer.start()
    for message in _sampler_messages(50):
        writer.put(message)
    time.sleep(0.3)
    assert writer.wakeups == 0 and _count(path, "nvlink_metrics") == 0
    writer.put(StepMarker(0, T0))                            # one wake-up stores them all
    _until(lambda: _count(path, "app_steps") == 1)
    assert writer.wakeups == 1
    assert _count(path, "nvlink_metrics") == 50 and _count(path, "nvlink_health") == 2
    assert writer.close(timeout=30) and writer.failed is None


def test_samples_alone_are_stored_within_defer_s_and_at_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "DEFER_S", 0.05)
    path = rank_path(str(tmp_path), 0)
    writer = StoreWriter(create_store(path), 0)
    writer.start()
    for message in _sampler_messages(3):
        writer.put(message)
    _until(lambda: _count(path, "nvlink_metrics") == 3)
    monkeypatch.setattr(writer_module, "DEFER_S", 60.0)
    time.sleep(0.1)                                          # (the writer's next wait is long)
    for message in list(_sampler_messages(5))[2:]:
        writer.put(message)
    assert writer.flush(timeout=30)                          # put before it: committed
    assert _count(path, "nvlink_metrics") == 8
    assert writer.close(timeout=30) and writer.failed is None


def test_where_the_application_marks_steps_only_its_steps_wake_the_writer(tmp_path,
                                                                         monkeypatch):
    """Before the first step() a lane's chunk and iteration records wake the writer (an
    application that marks no steps); after it, one wake-up per iteration, and every
    record is stored at the step that follows it."""
    from commsched.config import Config
    from commsched.telemetry import load_run, open_recorder

    from .helpers import chunk, iteration

    monkeypatch.setattr(writer_module, "DEFER_S", 60.0)
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                        nvml_period_ms=0)
    writer = rec._writer
    for k in range(5):
        b = T0 + k * 100 * MS
        rec.on_chunks([chunk(iteration=k, start=b + 20 * MS, end=b + 30 * MS,
                             submit=b + 10 * MS)])
        rec.on_iteration(iteration(iteration=k, first_submit=b + 10 * MS, flush=b + 40 * MS))
        rec.step()
    _until(lambda: writer.wakeups >= 7)
    time.sleep(0.2)
    assert writer.wakeups == 3 + 4          # iteration 0: three messages; then the steps
    path = rank_path(str(tmp_path), 0)
    _until(lambda: _count(path, "app_steps") == 5)
    assert _count(path, "iterations") == 5 and _count(path, "comm_ops") == 5
    rec.close()
    run = load_run(str(tmp_path))
    assert [i["complete"] for i in run.iterations] == [1] * 5


def test_without_steps_the_iteration_record_wakes_the_writer_for_its_chunks(tmp_path,
                                                                           monkeypatch):
    """No step() (the DDP hook user's loop): the chunk records the training thread
    completes at its end of iteration wait for the iteration record that follows them;
    chunk records from another thread (a completion thread) wake the writer."""
    import threading

    from commsched.config import Config
    from commsched.telemetry import load_run, open_recorder

    from .helpers import chunk, iteration

    monkeypatch.setattr(writer_module, "DEFER_S", 60.0)
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=1,
                        nvml_period_ms=0)
    writer = rec._writer
    path = rank_path(str(tmp_path), 0)
    for k in range(3):
        b = T0 + k * 100 * MS
        rec.on_chunks([chunk(iteration=k, start=b + 20 * MS, end=b + 30 * MS,
                             submit=b + 10 * MS)])
        rec.on_iteration(iteration(iteration=k, first_submit=b + 10 * MS, flush=b + 40 * MS))
    # iteration 0's chunks came before any iteration record: they woke the writer
    _until(lambda: writer.wakeups >= 4)
    time.sleep(0.2)
    assert writer.wakeups == 1 + 3
    _until(lambda: _count(path, "comm_ops") == 3)
    # iteration 3: its record first, its chunk (the tail) from a completion thread
    b = T0 + 300 * MS
    rec.on_iteration(iteration(iteration=3, first_submit=b + 10 * MS, flush=b + 40 * MS))
    other = threading.Thread(target=rec.on_chunks, args=([chunk(
        iteration=3, start=b + 20 * MS, end=b + 50 * MS, submit=b + 10 * MS)],))
    other.start()
    other.join()
    _until(lambda: _count(path, "comm_ops") == 4)
    assert writer.wakeups == 4 + 2           # the record, then the chunk: committed at once
    rec.close()
    run = load_run(str(tmp_path))
    assert [i["complete"] for i in run.iterations] == [1] * 4
