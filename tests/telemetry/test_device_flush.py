"""The end of backward on the device: an iteration record's flush mark.

On CUDA the scheduler records a timed event where an iteration ends (its flush) and the
writer stores, as the iteration's flush, when the device got there rather than when the
host did. Exposed communication is measured from it. Here the CUDA clock is replaced by a
stand-in whose marks the test completes; tests/gpu covers the real events.
"""

import sqlite3
import time
import warnings

import pytest

from commsched.observer import DeviceMark
from commsched.telemetry import writer as writer_module
from commsched.telemetry.errors import TelemetryWarning
from commsched.telemetry.store import create_store, load_run, rank_path
from commsched.telemetry.writer import StoreWriter

from .helpers import MS, T0, chunk, iteration, write_run


class Event:
    """A stand-in CUDA event: reached once ``t_ns`` is set (None: never timed)."""

    def __init__(self, t_ns=None, reached=True):
        self.t_ns, self.reached = t_ns, reached


class Clock:
    def host_ns(self, mark):
        return (True, mark.event.t_ns) if mark.event.reached else (False, None)


def mark(t_ns=None, reached=True):
    return DeviceMark("cuda:0", Event(t_ns, reached))


def one_iteration(k, *, host_flush, device_flush=None, reached=True, end):
    """Iteration k: one chunk [k*100+1, k*100+end] ms, flushed by the host at
    ``host_flush`` ms (offsets from the iteration's base)."""
    base = T0 + k * 100 * MS
    return [chunk(iteration=k, start=base + MS, end=base + end * MS),
            iteration(iteration=k, first_submit=base, flush=base + host_flush * MS,
                      mark=None if device_flush is None and reached else
                      mark(None if device_flush is None else base + device_flush * MS,
                           reached))]


def stored(tmp_path, messages, **kw):
    write_run(str(tmp_path), 0, messages, world_size=1, device_clock=Clock(), **kw)
    return {r["iteration"]: r for r in load_run(str(tmp_path)).rows("iterations", 0)}


def test_exposed_comm_is_measured_from_where_the_device_ended_backward(tmp_path):
    # The host flushed at 10 ms; the device got there at 40; the collective ended at 45.
    rows = stored(tmp_path, one_iteration(0, host_flush=10, device_flush=40, end=45)
                  + one_iteration(1, host_flush=10, end=45))          # no mark: host time
    assert rows[0]["t_flush_ns"] == T0 + 40 * MS
    assert rows[0]["exposed_comm_ns"] == 5 * MS
    assert rows[1]["t_flush_ns"] == T0 + 110 * MS
    assert rows[1]["exposed_comm_ns"] == 35 * MS


def test_an_untimable_mark_keeps_the_host_time(tmp_path):
    rows = stored(tmp_path, one_iteration(0, host_flush=10, device_flush=None, end=45))
    assert rows[0]["t_flush_ns"] == T0 + 10 * MS
    assert rows[0]["exposed_comm_ns"] == 35 * MS


def test_records_wait_in_order_for_a_mark_the_device_reaches_later(tmp_path):
    late = one_iteration(0, host_flush=10, device_flush=40, reached=False, end=45)
    messages = late + one_iteration(1, host_flush=10, device_flush=20, end=25)
    path = rank_path(str(tmp_path), 0)
    writer = StoreWriter(create_store(path), 0)
    writer.device_clock = Clock()
    t_start = time.monotonic()
    writer.start()
    for m in messages:
        writer.put(m)

    def flushes(expected=None):
        """The stored flushes, once they are ``expected`` (polled: the writer may get the
        CPU late on a loaded machine), else after 0.3 s."""
        deadline = time.monotonic() + (30 if expected is not None else 0.3)
        while True:
            time.sleep(0.05)
            with sqlite3.connect(path) as conn:
                got = dict(conn.execute("SELECT iteration, t_flush_ns FROM iterations"))
            if got == expected or time.monotonic() > deadline:
                return got

    # Iteration 1's record waits behind iteration 0's, whose mark is not reached yet. The
    # writer looks at it less and less often, up to one look per MARK_POLL_MAX_S
    # (each look takes the GIL from a training thread): not one every 2 ms.
    assert all(t is None for t in flushes().values())
    waited = time.monotonic() - t_start
    assert 1 <= writer.mark_polls <= waited / writer_module.MARK_POLL_MAX_S + 10, (
        writer.mark_polls, waited)
    late[1].flush_mark.event.reached = True          # the writer sees it while polling
    expected = {0: T0 + 40 * MS, 1: T0 + 120 * MS}
    assert flushes(expected) == expected
    assert writer.close(timeout=30) and writer.failed is None


def test_a_mark_never_reached_gives_up_at_close_with_the_host_time(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "MARK_WAIT_S", 0.1)
    rows = stored(tmp_path, one_iteration(0, host_flush=10, device_flush=40, reached=False,
                                          end=45)
                  + one_iteration(1, host_flush=10, device_flush=20, end=25))
    assert rows[0]["t_flush_ns"] == T0 + 10 * MS and rows[0]["exposed_comm_ns"] == 35 * MS
    assert rows[1]["t_flush_ns"] == T0 + 120 * MS and rows[1]["exposed_comm_ns"] == 5 * MS


def test_a_failed_writer_keeps_no_record_waiting_for_a_mark(tmp_path):
    """A write error disables the writer; a record still waiting for its mark then goes
    too, instead of being polled for every few milliseconds until the end of the run."""
    writer = StoreWriter(create_store(rank_path(str(tmp_path), 0)), 0)
    writer.device_clock = Clock()
    writer.start()
    for m in one_iteration(0, host_flush=10, device_flush=40, reached=False, end=45):
        writer.put(m)
    deadline = time.monotonic() + 10
    while not writer._marked and time.monotonic() < deadline:
        time.sleep(0.001)
    assert writer._marked                     # the record waits for its mark
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.conn.close()                   # the next commit fails: the writer disables
        while writer.failed is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert writer.failed is not None
    assert [w.category for w in caught] == [TelemetryWarning]
    assert not writer._marked
    assert writer.close(timeout=30)


def test_the_writer_s_clock_maps_a_reached_mark_from_an_anchor_it_renews(monkeypatch):
    import torch

    from commsched.observer import DeviceMark
    from commsched.telemetry import device_clock

    anchors = []

    class Event:
        """A device timer reading in ms (None: not reached); elapsed_time as CUDA's."""

        def __init__(self, ms=None, enable_timing=False):
            self.ms = ms

        def query(self):
            return self.ms is not None

        def record(self, stream):
            self.ms = stream.now_ms

        def synchronize(self):
            anchors.append(self.ms)

        def elapsed_time(self, other):
            return other.ms - self.ms

    class Stream:
        now_ms = 100.0

        def __init__(self, device=None):
            pass

    now = [10 * MS]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(device_clock.time, "time_ns", lambda: now[0])
    clock = device_clock.DeviceClock()
    assert clock.host_ns(DeviceMark("cuda:0", Event())) == (False, None)
    assert anchors == []                               # (nothing to map yet)
    # Device 100 ms is host 10 ms: a mark the device reached at 98 ms was host 8 ms.
    assert clock.host_ns(DeviceMark("cuda:0", Event(98.0))) == (True, 8 * MS)
    assert clock.host_ns(DeviceMark("cuda:0", Event(130.0))) == (True, 40 * MS)
    assert anchors == [100.0]                          # one anchor for both
    Stream.now_ms, now[0] = 1200.0, 1110 * MS + 500    # over a second later: renewed
    assert clock.host_ns(DeviceMark("cuda:0", Event(1199.0))) == (True, 1109 * MS + 500)
    assert anchors == [100.0, 1200.0]


def test_event_clock_maps_events_from_its_anchor_and_waits_only_to_renew_it(monkeypatch):
    import torch

    from commsched.telemetry import device_clock

    waits = []

    class Event:
        """A device timer reading in ms; ``elapsed_time`` as CUDA: ``other`` less this."""

        def __init__(self, ms=None, enable_timing=False):
            self.ms = ms

        def record(self, stream):
            self.ms = stream.now_ms

        def synchronize(self):
            waits.append(self.ms)

        def elapsed_time(self, other):
            return other.ms - self.ms

    class Stream:
        now_ms = 100.0

    now = [10 * MS]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(device_clock.time, "time_ns", lambda: now[0])
    stream = Stream()
    clock = device_clock.EventClock(stream)
    assert clock.age_s() == float("inf")
    # The first mapping waits for an anchor: device 100 ms is host 10 ms.
    assert clock.host_times_ns([Event(102.0), Event(99.5)]) == [12 * MS, int(9.5 * MS)]
    assert waits == [100.0]
    # Later mappings read elapsed times from the anchor, without a wait.
    assert clock.host_times_ns([Event(130.0)]) == [40 * MS]
    assert waits == [100.0]
    now[0] = 510 * MS
    assert clock.age_s() == pytest.approx(0.5)
    # A renewed anchor (the device timer ran 1 us slow against the host's): mappings
    # follow it, events from before it included.
    stream.now_ms, now[0] = 1100.0, 1010 * MS + 1000
    clock.refresh()
    assert waits == [100.0, 1100.0]
    assert clock.host_times_ns([Event(1099.0), Event(1101.0)]) == [
        1009 * MS + 1000, 1011 * MS + 1000]
