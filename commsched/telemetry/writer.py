"""The writer thread: the only code that touches a rank's SQLite file after it is created.

Producers (completion thread, training thread, sampler thread) only ``put`` messages on a
queue. Each message that wakes the writer takes the GIL, during backward from autograd's
thread; so only the messages that may complete or end an iteration wake it: iteration
records and chunk records from a completion thread (where the application marks its
iterations with ``step()``, only its step markers), flush and close. The others (the
sampler's NVLink samples, link health and NVML status; tuning decisions and auto's
choices; chunk records
the training thread hands over before its iteration record; chunk and iteration records
of an application that marks steps) wait in a deque for the next wake-up, at most
``DEFER_S`` (the recorder decides, see ``Recorder.on_chunks``). The writer batches rows
into transactions and commits

* at once after an iteration record (on CUDA once the device got to its flush: see
  ``device_clock``), a step marker or an iteration whose communication
  finished (so a SIGKILLed process leaves every completed iteration in the store, up to
  its last step where the application marks steps),
* otherwise every ``commit_interval_s`` (0.1 s) or ``batch_rows`` rows, whichever first.

On a write error (disk full, file removed, size cap reached) it warns once, tells the
recorder to stop enqueueing and keeps draining the queue so producers never block.
"""

from __future__ import annotations

import collections
import queue
import sqlite3
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import UnsupportedError
from ..observer import AutoChoice, ChunkRecord, IterationRecord
from ..threads import start_thread
from .assembly import IterationAssembler
from .device_clock import DeviceClock
from .errors import TelemetryWarning
from .metrics import algbw_gbps, busbw_gbps
from .sampler import CounterSample, HealthSample, NvmlStatus
from .store import OPTIONAL_TABLES, TABLES, json_dumps

__all__ = ["StepMarker", "TuningDecision", "StoreWriter"]


@dataclass(frozen=True)
class StepMarker:
    """``commsched.step()``: the application finished iteration ``step`` at ``t_ns``."""

    step: int
    t_ns: int


@dataclass(frozen=True)
class TuningDecision:
    """One entry of ``Scheduler.tuning_log`` (a dict with the ``tuning`` table's columns
    but ``rank``)."""

    entry: dict


@dataclass(frozen=True)
class _Control:
    kind: str                   # flush | close
    done: threading.Event


def _columns(table: str) -> List[str]:
    spec = {**TABLES, **OPTIONAL_TABLES}[table].split("PRIMARY KEY (")[0]     # the table constraint is not a column
    return [part.split()[0] for part in spec.split(",") if part.strip()]


def _insert_sql(table: str, verb: str = "INSERT") -> str:
    cols = _columns(table)
    return f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"


_ITER_COLS = _columns("iterations")
_TUNING_COLS = _columns("tuning")
_SQL = {name: _insert_sql(name) for name in [*TABLES, *OPTIONAL_TABLES] if name != "meta"}
_SQL["iterations"] = _insert_sql("iterations", "INSERT OR REPLACE")
_SQL["intra_node_topo"] = _insert_sql("intra_node_topo", "INSERT OR REPLACE")

# An iteration record with a flush mark waits until the device got there: the writer looks
# after MARK_POLL_S, then at intervals doubling up to MARK_POLL_MAX_S while the device has
# not got there, and a flush or close waits up to MARK_WAIT_S for it. Each look takes the
# GIL from the training thread, and where the host runs far ahead of a busy GPU the mark
# is reached tens of milliseconds later: a fixed short interval would take it dozens of
# times per iteration. It also looks whenever an iteration record is stored, which
# (steps marked) is at each step. The interval decides when the record is stored, not
# its times.
MARK_POLL_S = 0.016
MARK_POLL_MAX_S = 0.128
# The longest a message that does not wake the writer waits (see the module docstring);
# also the writer's longest sleep.
DEFER_S = 0.25
MARK_WAIT_S = 2.0


class StoreWriter:
    """Owns ``conn`` from :meth:`start` on. ``request_sample`` is called when an iteration's
    communication has finished, so that the next NVLink sample encloses it closely."""

    commit_interval_s = 0.1
    batch_rows = 2000

    def __init__(self, conn: sqlite3.Connection, rank: int, *, node: str = "",
                 request_sample: Callable[[], object] = lambda: None,
                 on_failure: Callable[[str], None] = lambda reason: None):
        self.conn = conn
        self.rank = rank
        self.node = node
        self.request_sample = request_sample
        self.on_failure = on_failure
        self.assembler = IterationAssembler(rank)
        self.failed: Optional[str] = None
        self.max_bytes = 0              # the store's size cap (create_store), 0: none
        self._q: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._later: "collections.deque[object]" = collections.deque()    # (_DEFERRED)
        self._thread: Optional[threading.Thread] = None
        self._in_tx = False
        self._rows = 0
        self._deadline = 0.0
        self._sample_no = 0
        self._created = set()           # optional tables created in this store
        # Rows by table, inserted with one executemany per table at the next commit (rows
        # not committed are lost on a kill whether or not they were inserted).
        self._pending: Dict[str, list] = {}
        self._ranks_json: Dict[tuple, str] = {}
        # Iteration records waiting, in order, for the device to reach their flush mark.
        self._marked: "collections.deque[IterationRecord]" = collections.deque()
        self.device_clock: Optional[DeviceClock] = None     # created at the first mark
        self.mark_polls = 0                 # looks at a mark the device had not reached
        self.wakeups = 0                    # returns from the wait for a message
        self._mark_poll_s = MARK_POLL_S

    # --- producer side -----------------------------------------------------------------------
    def put(self, message: object, wake: bool = True) -> None:
        """Hand ``message`` to the writer thread. ``wake=False``, and for the sampler's
        messages: no wake-up, it waits for the next one (at most ``DEFER_S``)."""
        if not wake or type(message) in _DEFERRED:
            self._later.append(message)       # (see the module docstring)
        else:
            self._q.put(message)

    def start(self) -> None:
        self._thread = start_thread(self._run, "commsched-telemetry", "cs-telemetry")

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until everything put so far is committed (False on timeout)."""
        return self._control("flush", timeout)

    def close(self, timeout: float = 10.0) -> bool:
        ok = self._control("close", timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        return ok

    def _control(self, kind: str, timeout: float) -> bool:
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._q.put(_Control(kind, done))
        return done.wait(timeout)

    # --- writer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            timeout = DEFER_S
            if self._in_tx:
                timeout = min(timeout, max(0.0, self._deadline - time.monotonic()))
            if self._marked:
                timeout = min(timeout, self._mark_poll_s)
            try:
                msg = self._q.get(timeout=timeout)
            except queue.Empty:
                msg = None
            self.wakeups += 1
            if self._later:
                self._drain_later()           # (put before msg, or at most DEFER_S ago)
            if msg is None:
                resolved = self._guarded(self._resolve_marks)
                self._mark_poll_s = (MARK_POLL_S if resolved or not self._marked
                                     else min(2 * self._mark_poll_s, MARK_POLL_MAX_S))
                if resolved or (self._in_tx and time.monotonic() >= self._deadline):
                    self._guarded(self._commit)
                continue
            if isinstance(msg, _Control):
                self._guarded(lambda: self._resolve_marks(MARK_WAIT_S))
                if msg.kind == "close":
                    self._guarded(self._close_store)
                    try:
                        self.conn.close()
                    except sqlite3.Error:
                        pass
                    msg.done.set()
                    return
                self._guarded(self._commit)
                msg.done.set()
                continue
            if self.failed is not None:
                continue        # disabled: drain so that producers never block
            self._commit_if(self._guarded(lambda: self._handle(msg)))

    def _drain_later(self) -> None:
        """Store the messages that did not wake the writer, in the order they came."""
        later = self._later
        urgent = False
        while later:
            msg = later.popleft()
            if self.failed is None:           # (disabled: dropped, as the queue's)
                urgent = self._guarded(lambda: self._handle(msg)) or urgent
        self._commit_if(urgent)

    def _commit_if(self, urgent: bool) -> None:
        """Commit after a message that asks for it, or once the batch is full."""
        if urgent or self._rows >= self.batch_rows:
            self._guarded(self._commit)

    def _resolve_marks(self, wait_s: float = 0.0) -> bool:
        """Hand the waiting iteration records to the assembler, in order, each with its
        flush at the time the device got there (see device_clock). A record whose mark the
        device has not reached stops the others behind it, for up to ``wait_s`` (then it
        keeps the host time); True when any was handed over."""
        deadline = time.monotonic() + wait_s
        handed = False
        while self._marked:
            record = self._marked[0]
            mark = record.flush_mark
            if mark is not None:
                if self.device_clock is None:
                    self.device_clock = DeviceClock()
                done, t_device = self.device_clock.host_ns(mark)
                if not done:
                    self.mark_polls += 1
                    if time.monotonic() < deadline:
                        time.sleep(MARK_POLL_S / 4)
                        continue
                    if wait_s <= 0:
                        break
                record = record._replace(
                    t_flush_ns=record.t_flush_ns if t_device is None else t_device,
                    flush_mark=None)
            self._marked.popleft()
            self._store(self.assembler.add_iteration(record))
            handed = True
        return handed

    def _guarded(self, fn) -> bool:
        if self.failed is not None:
            return False
        try:
            return bool(fn())
        except Exception as exc:  # disk full, file removed, ... or a bug: never reach training
            self._fail(exc)
            return False

    def _fail(self, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, sqlite3.Error) and self._at_size_cap():
            # SQLite says "database or disk is full" for both: name the one that it is
            self.failed = (f"the store reached its size cap, COMMSCHED_TELEMETRY_MAX_BYTES="
                           f"{self.max_bytes} bytes (the disk is not full); raise or unset it "
                           f"for longer runs")
        warnings.warn(f"commsched telemetry disabled for rank {self.rank}: writing the store "
                      f"failed ({self.failed}); training continues without telemetry",
                      TelemetryWarning, stacklevel=1)
        self.on_failure(self.failed)
        self._pending.clear()
        self._marked.clear()          # nothing is stored any more: stop polling for marks
        try:
            if self._in_tx:
                self.conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        self._in_tx = False

    def _at_size_cap(self) -> bool:
        """Whether the store's pages reached ``max_bytes``'s page cap
        (``create_store``)."""
        if not self.max_bytes:
            return False
        try:
            pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
            cap = self.conn.execute("PRAGMA max_page_count").fetchone()[0]
        except sqlite3.Error:
            return False
        return pages >= cap - 4      # (a write needing the last few pages fails too)

    def _execute(self, table: str, rows: Sequence[Sequence[object]]) -> None:
        if not rows:
            return
        self._begin()
        pending = self._pending.get(table)
        if pending is None:
            self._pending[table] = list(rows)
        else:
            pending.extend(rows)
        self._rows += len(rows)

    def _begin(self) -> None:
        if not self._in_tx:
            self.conn.execute("BEGIN")
            self._in_tx = True
            self._deadline = time.monotonic() + self.commit_interval_s

    def _commit(self) -> None:
        if self._in_tx:
            for table, rows in self._pending.items():
                self.conn.executemany(_SQL[table], rows)
            self._pending.clear()
            self.conn.execute("COMMIT")
            self._in_tx = False
            self._rows = 0

    def _handle(self, msg: object) -> bool:
        """Store one message; True when it should be committed at once."""
        if isinstance(msg, list):               # chunk records completed together
            urgent = False
            for record in msg:
                urgent = self._handle(record) or urgent
            return urgent
        if isinstance(msg, ChunkRecord):
            self._execute("comm_ops", [self._comm_op(msg)])
            return self._store(self.assembler.add_chunk(msg))
        if isinstance(msg, IterationRecord):
            self._marked.append(msg)
            return self._resolve_marks()
        if isinstance(msg, StepMarker):
            self._execute("app_steps", [(self.rank, msg.step, msg.t_ns)])
            return True
        if isinstance(msg, CounterSample):
            self._sample_no += 1
            self._execute("nvlink_metrics", [
                (self.rank, self._sample_no, msg.t_ns, msg.latency_ns, link, *values)
                for link, values in msg.links.items()])
            return False
        if isinstance(msg, HealthSample):
            self._execute("nvlink_health", [(self.rank, msg.t_ns, link, *values)
                                            for link, values in msg.links.items()])
            return False
        if isinstance(msg, NvmlStatus):
            self._nvml_status(msg)
            return True
        if isinstance(msg, AutoChoice):
            self._create("auto_choices")
            self._execute("auto_choices", [
                (self.rank, msg.lane, msg.dtype, msg.nodes, msg.local_size, msg.margin,
                 row["bytes"], row.get("none_us"), row.get("hier_us"), row.get("leader_us"),
                 row["chosen"]) for row in msg.rows])
            return True
        if isinstance(msg, TuningDecision):
            self._create("tuning")
            entry = dict(msg.entry, rank=self.rank)
            self._execute("tuning", [[entry.get(c) for c in _TUNING_COLS]])
            return True
        raise UnsupportedError(f"unexpected telemetry message {type(msg).__name__}")

    def _store(self, rows: List[dict]) -> bool:
        """Write iteration rows; returns True (commit now) when an iteration's communication
        finished, and asks for an NVLink sample that follows it closely."""
        if not rows:
            return False
        self._execute("iterations", [[r[c] for c in _ITER_COLS] for r in rows])
        finished = any(r["comm_ns"] is not None for r in rows)
        if finished:
            self.request_sample()
        return finished

    def _comm_op(self, c: ChunkRecord) -> tuple:
        n = len(c.group_ranks)
        dur = c.t_end_ns - c.t_start_ns
        ranks = self._ranks_json.get(c.group_ranks)
        if ranks is None:
            ranks = self._ranks_json[c.group_ranks] = json_dumps(list(c.group_ranks))
        return (self.rank, c.lane, c.iteration, c.request_key, c.op, c.step, c.decompose,
                c.chunk_index, c.num_chunks, c.nbytes, c.dtype, ranks,
                n, c.priority, c.t_submit_ns, c.t_dispatch_ns, c.t_start_ns, c.t_end_ns,
                int(c.ok), c.error, dur, algbw_gbps(c.nbytes, dur) if c.ok else None,
                busbw_gbps(c.step, c.nbytes, dur, n) if c.ok else None)

    def _nvml_status(self, s: NvmlStatus) -> None:
        gpu = s.gpu
        self._execute_sql(
            "UPDATE runs SET nvml_status = ?, nvml_detail = ?, "
            "driver_version = COALESCE(?, driver_version), gpu_index = ?, gpu_name = ?, "
            "gpu_uuid = ?, gpu_pci_bus_id = ? WHERE rank = ?",
            (s.status, s.detail, s.driver, gpu.index if gpu else None,
             gpu.name if gpu else None, gpu.uuid if gpu else None,
             gpu.pci_bus_id if gpu else None, self.rank))
        if s.links and gpu is not None:
            self._execute("intra_node_topo", [
                (self.rank, self.node, gpu.index, l.link, l.state, l.version, l.speed_mbps,
                 l.remote_type, l.remote_pci_bus_id, l.peer_gpu_index) for l in s.links])

    def _create(self, table: str) -> None:
        if table not in self._created:
            self._execute_sql(f"CREATE TABLE IF NOT EXISTS {table} ({OPTIONAL_TABLES[table]})",
                              ())
            self._created.add(table)

    def _execute_sql(self, sql: str, args: tuple) -> None:
        self._begin()
        self.conn.execute(sql, args)

    def _close_store(self) -> None:
        self._store(self.assembler.finish())
        self._execute_sql("UPDATE runs SET end_ns = ? WHERE rank = ?",
                          (time.time_ns(), self.rank))
        self._commit()
        try:
            # A closed store should be one self-contained file, readable from a read-only
            # copy of the run directory: leave WAL mode (this checkpoints and drops the WAL).
            self.conn.execute("PRAGMA journal_mode=DELETE")
        except sqlite3.Error:
            pass        # a reader still has it open; the WAL stays, which is also readable


# The messages that wait for the writer's next wake-up (see the module docstring).
_DEFERRED = frozenset((CounterSample, HealthSample, NvmlStatus, TuningDecision, AutoChoice))
