"""The telemetry store: one SQLite file per rank in a run directory, and the reader that
merges them.

Tables (in the spirit of OSU INAM's):

=================  ==========================================================================
runs               one row: rank, world size, host, versions, config JSON, NVML status
intra_node_topo    one row per NVLink of the rank's GPU: state, version, speed, remote end
nvlink_metrics     cumulative NVLink counters (KiB) per sample per link; link -1 = sum
nvlink_health      per-link state, speed and error counters, sampled about once a second
comm_ops           one row per ChunkRecord, with algorithm and bus bandwidth
iterations         one row per lane iteration: flush, communication window, exposed comm,
                   bytes (its NVLink columns stay empty: the report computes them)
iteration_links    (left empty, see iterations)
app_steps          application iteration markers (``commsched.step()``)
tuning             the autotuner's decisions (``Scheduler.tuning_log``); created by the
                   first one, so absent from runs without ``COMMSCHED_AUTOTUNE=1``
topology           one row: nodes x ranks per node, the rank's node and local rank, and
                   where the node size came from (``topology.node_layout``)
auto_choices       ``decompose=auto``'s measured table per lane: per calibrated size the
                   time of each candidate and the one chosen (present where auto measured)
=================  ==========================================================================

Each rank writes its own file (``rank{r}.sqlite``) so that processes never contend for
SQLite's write lock; WAL mode lets ``commsched report`` read a run that is still going, and a
committed transaction survives the writer being SIGKILLed.

Run directories: each launch writes into a new directory under ``COMMSCHED_TELEMETRY_DIR``,
named by its start time (``run_name``), so that a reused directory is never overwritten and
runs of different sizes never mix. :func:`load_run` takes either one run directory or a
directory of them, where it reads the newest (the last by name) and lists the others. A
rank's store that cannot be read is skipped and reported, as long as another one can be.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .errors import TelemetryError

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "TABLES", "OPTIONAL_TABLES", "create_store",
           "rank_path", "run_name", "find_runs",
           "RunData", "load_run", "json_dumps"]

SCHEMA_NAME = "commsched-telemetry"
SCHEMA_VERSION = 1

TABLES: Dict[str, str] = {
    "meta": "key TEXT PRIMARY KEY, value TEXT",
    "runs": """rank INTEGER PRIMARY KEY, world_size INTEGER, local_rank INTEGER, host TEXT,
        pid INTEGER, start_ns INTEGER, end_ns INTEGER, config_json TEXT,
        python_version TEXT, torch_version TEXT, cuda_version TEXT, nccl_version TEXT,
        commsched_version TEXT, driver_version TEXT, nvml_status TEXT, nvml_detail TEXT,
        gpu_index INTEGER, gpu_name TEXT, gpu_uuid TEXT, gpu_pci_bus_id TEXT,
        nvml_period_ms INTEGER, nvml_per_link INTEGER""",
    "intra_node_topo": """rank INTEGER, node TEXT, gpu_index INTEGER, link INTEGER,
        state INTEGER, version INTEGER, speed_mbps INTEGER, remote_type TEXT,
        remote_pci_bus_id TEXT, peer_gpu_index INTEGER, PRIMARY KEY (rank, link)""",
    "nvlink_metrics": """rank INTEGER, sample INTEGER, t_ns INTEGER, latency_ns INTEGER,
        link INTEGER, data_tx_kib INTEGER, data_rx_kib INTEGER, raw_tx_kib INTEGER,
        raw_rx_kib INTEGER""",
    "nvlink_health": """rank INTEGER, t_ns INTEGER, link INTEGER, state INTEGER,
        speed_mbps INTEGER, crc_flit INTEGER, crc_data INTEGER, replay INTEGER,
        recovery INTEGER""",
    "comm_ops": """rank INTEGER, lane TEXT, iteration INTEGER, request_key TEXT, op TEXT,
        step TEXT, decompose TEXT, chunk_index INTEGER, num_chunks INTEGER, nbytes INTEGER,
        dtype TEXT, group_ranks TEXT, group_size INTEGER, priority INTEGER,
        t_submit_ns INTEGER, t_dispatch_ns INTEGER, t_start_ns INTEGER, t_end_ns INTEGER,
        ok INTEGER, error TEXT, duration_ns INTEGER, algbw_gbps REAL, busbw_gbps REAL""",
    "iterations": """rank INTEGER, lane TEXT, iteration INTEGER, t_first_submit_ns INTEGER,
        t_flush_ns INTEGER, requests INTEGER, chunks INTEGER, nbytes INTEGER, planned INTEGER,
        chunk_steps INTEGER, failed_steps INTEGER, t_first_dispatch_ns INTEGER,
        t_first_start_ns INTEGER, t_last_end_ns INTEGER, comm_ns INTEGER,
        exposed_comm_ns INTEGER, bus_bytes REAL, busbw_gbps REAL, complete INTEGER,
        nvlink_tx_bytes INTEGER, nvlink_rx_bytes INTEGER, nvlink_tx_gbps REAL,
        nvlink_rx_gbps REAL, nvlink_speed_gbps REAL,
        PRIMARY KEY (rank, lane, iteration)""",
    "iteration_links": """rank INTEGER, lane TEXT, iteration INTEGER, link INTEGER,
        direction TEXT, bytes INTEGER, gbps REAL, speed_gbps REAL, utilization REAL""",
    "app_steps": "rank INTEGER, step INTEGER, t_ns INTEGER, PRIMARY KEY (rank, step)",
}

# Tables created on first use (CREATE TABLE IF NOT EXISTS by the writer) and read when
# present: a store written without them, or by an older commsched, stays readable.
OPTIONAL_TABLES: Dict[str, str] = {
    "tuning": """rank INTEGER, lane TEXT, round INTEGER, event TEXT, decided_at INTEGER,
        iteration INTEGER, baseline_from INTEGER, trial_from INTEGER,
        old_partition_bytes INTEGER, old_credit_bytes INTEGER, old_decompose TEXT,
        candidate_partition_bytes INTEGER, candidate_credit_bytes INTEGER,
        candidate_decompose TEXT, predicted_ms REAL, predicted_old_ms REAL, baseline_ms REAL,
        trial_ms REAL, kept INTEGER""",
    "topology": """rank INTEGER PRIMARY KEY, world_size INTEGER, nodes INTEGER,
        local_size INTEGER, node INTEGER, local_rank INTEGER, local_size_from TEXT""",
    "auto_choices": """rank INTEGER, lane TEXT, dtype TEXT, nodes INTEGER, local_size INTEGER,
        margin REAL, bytes INTEGER, none_us REAL, hier_us REAL, leader_us REAL,
        chosen TEXT""",
}

INDEXES = (
    "CREATE INDEX IF NOT EXISTS comm_ops_iter ON comm_ops (lane, iteration)",
    "CREATE INDEX IF NOT EXISTS nvlink_metrics_t ON nvlink_metrics (link, t_ns)",
)

_RANK_FILE = re.compile(r"^rank(\d+)\.sqlite$")


def rank_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.sqlite")


def run_name(parent: str, now: Optional[float] = None) -> str:
    """A new run directory's name under ``parent``: its start time, local, to the
    millisecond (``20261128-214502-123``), so that names sort by start; a suffix where
    ``parent`` already holds one so named."""
    now = time.time() if now is None else now
    name = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{int(now * 1000) % 1000:03d}"
    taken, n = name, 1
    while os.path.exists(os.path.join(parent, taken)):
        n += 1
        taken = f"{name}-{n}"
    return taken


def _has_stores(path: str) -> bool:
    try:
        return any(_RANK_FILE.match(entry) for entry in os.listdir(path))
    except OSError:
        return False


def find_runs(path: str) -> List[str]:
    """The run directories in ``path``, oldest first: ``path`` itself where it holds rank
    stores (a run written before run directories, or by ``open_recorder`` directly), then
    its subdirectories holding them, by name (their start time)."""
    subdirs = []
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        entries = []
    for entry in entries:
        sub = os.path.join(path, entry)
        if os.path.isdir(sub) and _has_stores(sub):
            subdirs.append(sub)
    return ([path] if _has_stores(path) else []) + subdirs


def create_store(path: str, *, max_bytes: Optional[int] = None) -> sqlite3.Connection:
    """Create (or truncate) a rank's store and return a connection usable from another thread.

    Raises OSError / sqlite3.Error when the file cannot be written; the recorder turns those
    into one warning. A previous run's file of the same rank is replaced, not appended to:
    mixing two runs in one file would make every iteration number ambiguous.
    """
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives a process crash (only power loss can undo
        # it) and costs no fsync, so committing every iteration stays cheap.
        conn.execute("PRAGMA synchronous=NORMAL")
        if max_bytes:
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={max(16, int(max_bytes) // page)}")
        conn.execute("BEGIN")
        for name, columns in TABLES.items():
            conn.execute(f"CREATE TABLE IF NOT EXISTS {name} ({columns})")
        for stmt in INDEXES:
            conn.execute(stmt)
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                         [("schema", SCHEMA_NAME), ("version", str(SCHEMA_VERSION))])
        conn.execute("COMMIT")
    except BaseException:
        conn.close()
        raise
    return conn


# --- reading ---------------------------------------------------------------------------------

@dataclass
class RunData:
    """Every rank of a run directory, as plain dicts (one per row), ordered by rank and time.

    ``tables[name]`` lists the rows of table ``name`` from all ranks; each row has a ``rank``
    key. Tools such as a simulator can use ``comm_ops`` directly: per chunk step it has
    ``t_submit_ns`` (ready), ``t_dispatch_ns``, ``t_start_ns``, ``t_end_ns`` and ``nbytes``.
    """

    run_dir: str
    files: List[str]
    tables: Dict[str, List[dict]] = field(default_factory=dict)
    other_runs: List[str] = field(default_factory=list)     # beside it, oldest first
    skipped: List[str] = field(default_factory=list)        # "file: why it was not read"

    def notes(self) -> List[str]:
        """One line per thing a reader should know besides the tables: the other runs of
        the directory it was asked for, and the stores skipped."""
        lines = []
        if self.other_runs:
            parent = os.path.dirname(self.run_dir)
            lines.append(
                f"read {self.run_dir}, the newest of {len(self.other_runs) + 1} runs in "
                f"{parent}; the others: "
                + ", ".join(os.path.relpath(r, parent) if r != parent else
                            "the rank stores in it" for r in self.other_runs))
        lines += [f"skipped {reason}" for reason in self.skipped]
        return lines

    @property
    def ranks(self) -> List[int]:
        return sorted(r["rank"] for r in self.tables.get("runs", []))

    def rows(self, table: str, rank: Optional[int] = None) -> List[dict]:
        rows = self.tables.get(table, [])
        return rows if rank is None else [r for r in rows if r["rank"] == rank]

    @property
    def runs(self) -> List[dict]:
        return self.rows("runs")

    @property
    def comm_ops(self) -> List[dict]:
        return self.rows("comm_ops")

    @property
    def iterations(self) -> List[dict]:
        return self.rows("iterations")


_ORDER = {
    "runs": "rank", "intra_node_topo": "link", "nvlink_metrics": "t_ns, link",
    "nvlink_health": "t_ns, link", "comm_ops": "t_end_ns, t_start_ns",
    "iterations": "lane, iteration", "iteration_links": "lane, iteration, link, direction",
    "app_steps": "step", "tuning": "lane, decided_at", "topology": "rank",
    "auto_choices": "lane, bytes",
}


def load_run(run_dir: str) -> RunData:
    """Open every ``rank*.sqlite`` of a run read-only and merge their tables: of
    ``run_dir`` itself, or of the newest run directory in it (see the module docstring;
    ``RunData.other_runs`` lists the others).

    A store that is not a SQLite database, or is a database of something else, or of a
    newer schema, is skipped (``RunData.skipped`` says why). Raises
    :class:`TelemetryError` with a one-line reason when the directory holds no store or
    none that can be read.
    """
    if not os.path.isdir(run_dir):
        raise TelemetryError(f"{run_dir}: not a directory")
    runs = find_runs(run_dir)
    if not runs:
        raise TelemetryError(f"{run_dir}: no telemetry store (expected rank<N>.sqlite files, "
                             f"or run directories holding them; is COMMSCHED_TELEMETRY_DIR "
                             f"pointing here?)")
    chosen = runs[-1]
    files = sorted((p for p in glob.glob(os.path.join(glob.escape(chosen), "rank*.sqlite"))
                    if _RANK_FILE.match(os.path.basename(p))),
                   key=lambda p: int(_RANK_FILE.match(os.path.basename(p)).group(1)))
    run = RunData(chosen, [], {name: [] for name in TABLES if name != "meta"},
                  other_runs=runs[:-1])
    for path in files:
        try:
            tables = _read_file(path)
        except TelemetryError as exc:
            run.skipped.append(str(exc))
            continue
        run.files.append(path)
        for name, rows in tables.items():
            run.tables.setdefault(name, []).extend(rows)
    if not run.files:
        more = len(run.skipped) - 1
        raise TelemetryError(run.skipped[0] + (f" (and {more} more unreadable)" if more else ""))
    _check_one_launch(run)
    return run


def _launch_of(row: dict) -> tuple:
    """What names the launch that wrote a store: its run directory's name (the same on
    every rank of a launch, ``launch_run_dir``) and its world size."""
    try:
        config = json.loads(row.get("config_json") or "{}")
    except ValueError:
        config = {}
    run_dir = config.get("telemetry_dir") if isinstance(config, dict) else None
    return (os.path.basename(os.path.normpath(run_dir)) if run_dir else None,
            row.get("world_size"))


def _check_one_launch(run: RunData) -> None:
    """Refuse a run directory whose stores were written by different launches (copied
    together by hand): their iterations and clocks do not belong together, and every
    figure computed across them would be wrong."""
    launches: Dict[tuple, List[dict]] = {}
    for row in run.tables.get("runs", []):
        launches.setdefault(_launch_of(row), []).append(row)
    if len(launches) <= 1:
        return
    t0 = min(r.get("start_ns") or 0 for r in run.tables["runs"])
    parts = []
    for (name, world), rows in launches.items():
        ranks = ", ".join(str(r["rank"]) for r in rows)
        start = min(r.get("start_ns") or 0 for r in rows)
        parts.append(f"rank(s) {ranks}: run {name or 'unnamed'}, world size {world}, "
                     f"started {(start - t0) / 1e9:+.1f} s")
    raise TelemetryError(f"{run.run_dir}: its rank stores come from {len(launches)} different "
                         f"launches ({'; '.join(parts)}): a run directory holds one launch's "
                         f"stores; move the others into a directory of their own")


def _read_file(path: str) -> Dict[str, List[dict]]:
    if not os.path.isfile(path):    # SQLite would only say "disk I/O error"
        raise TelemetryError(f"{path}: not a telemetry store (a directory, not a file)"
                             if os.path.isdir(path) else f"{path}: not a regular file")
    tmp = None
    try:
        conn, tmp = _connect_readonly(path)
    except sqlite3.Error as exc:
        if _shorter_than_a_page(path):
            raise TelemetryError(f"{path}: {_CUT_SHORT} ({exc})") from None
        raise TelemetryError(f"{path}: cannot open: {exc}") from None
    try:
        _check_schema(conn, path)
        out = {}
        for name in TABLES:
            if name == "meta":
                continue
            cur = conn.execute(f"SELECT * FROM {name} ORDER BY {_ORDER[name]}")
            cols = [d[0] for d in cur.description]
            out[name] = [dict(zip(cols, row)) for row in cur.fetchall()]
        present = {row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        for name in OPTIONAL_TABLES:
            if name in present:
                cur = conn.execute(f"SELECT * FROM {name} ORDER BY {_ORDER[name]}")
                cols = [d[0] for d in cur.description]
                out[name] = [dict(zip(cols, row)) for row in cur.fetchall()]
        return out
    except sqlite3.DatabaseError as exc:
        raise TelemetryError(f"{path}: not a readable commsched telemetry store ({exc})") from None
    finally:
        conn.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _connect_readonly(path: str):
    """A read-only connection, and the temporary directory to remove afterwards (or None).

    A store left in WAL mode by a killed writer needs its -shm file; when that cannot be
    created (read-only directory) the file and its WAL are read from a private copy instead,
    so that committed iterations still in the WAL are not lost."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn, None
    except sqlite3.OperationalError as exc:
        conn.close()
        if "unable to open" not in str(exc) and "readonly" not in str(exc):
            raise
    tmp = tempfile.mkdtemp(prefix="commsched-read-")
    copy = os.path.join(tmp, os.path.basename(path))
    for suffix in ("", "-wal"):
        if os.path.exists(path + suffix):
            shutil.copyfile(path + suffix, copy + suffix)
    return sqlite3.connect(copy), tmp


_CUT_SHORT = ("a telemetry store cut short as it was created (holds no table: the disk "
              "full, or the process stopped, when the rank opened it); nothing was recorded "
              "for this rank")


def _shorter_than_a_page(path: str) -> bool:
    """A store whose file ends before its first page: its writer stopped while creating
    it (a page is at least 512 bytes)."""
    try:
        return os.path.getsize(path) < 512
    except OSError:
        return False


def _check_schema(conn: sqlite3.Connection, path: str) -> None:
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as exc:
        if "no such table" in str(exc):
            if not conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise TelemetryError(f"{path}: {_CUT_SHORT}") from None
            raise TelemetryError(f"{path}: a SQLite database, but not a commsched telemetry "
                                 f"store (no meta table)") from None
        if _shorter_than_a_page(path):
            raise TelemetryError(f"{path}: {_CUT_SHORT} ({exc})") from None
        raise TelemetryError(f"{path}: not a commsched telemetry store ({exc})") from None
    if meta.get("schema") != SCHEMA_NAME:
        raise TelemetryError(f"{path}: not a commsched telemetry store "
                             f"(schema {meta.get('schema')!r})")
    try:
        version = int(meta.get("version", ""))
    except ValueError:
        raise TelemetryError(f"{path}: unreadable schema version {meta.get('version')!r}") from None
    if version > SCHEMA_VERSION:
        raise TelemetryError(f"{path}: written by a newer commsched (schema version {version}, "
                             f"this reader knows {SCHEMA_VERSION}); upgrade commsched")


def json_dumps(obj) -> str:
    """JSON for config/args columns: dataclasses and other objects fall back to ``str``."""
    return json.dumps(obj, default=str, sort_keys=True)
