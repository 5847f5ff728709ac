"""The recorder: the scheduler's :class:`~commsched.observer.Observer` for telemetry.

Threads of one rank and what each may do::

    training thread     on_iteration(), step()   enqueue + Event.set (+ NVTX)   never I/O
    completion thread   on_chunks()              enqueue                        never I/O
      (or the training thread, at its end of iteration, on CUDA without a credit window)
    commsched-nvml      NVML queries -> enqueue samples                         (sampler.py)
    commsched-telemetry SQLite writes and commits                               (writer.py)

``open_recorder`` is the only place that touches the file system on the caller's thread
(creating the store), so that an unwritable directory is reported at once, with one warning,
and the recorder comes back disabled instead of raising into training.
"""

from __future__ import annotations

import atexit
import os
import platform
import socket
import sqlite3
import threading
import time
import warnings
from typing import List, Optional

from .. import notices
from ..observer import ChunkRecord, IterationRecord, Observer
from . import nvtx_ranges
from .errors import TelemetryWarning
from .nvml import GpuSelector, NvmlBackend, PynvmlBackend
from .sampler import NvlinkSampler, NvmlStatus
from .store import OPTIONAL_TABLES, create_store, json_dumps, rank_path, run_name
from .writer import StepMarker, StoreWriter, TuningDecision

__all__ = ["Recorder", "open_recorder", "step", "active_recorders", "launch_run_dir"]

_active: List["Recorder"] = []
_active_lock = threading.Lock()


class Recorder(Observer):
    """Records one rank's chunks, iterations, steps and NVLink samples into its store.

    Build it with :func:`open_recorder`. A disabled recorder (telemetry off, or the store
    could not be written) accepts every call and does nothing.
    """

    def __init__(self, rank: int, *, writer: Optional[StoreWriter] = None,
                 sampler: Optional[NvlinkSampler] = None, path: Optional[str] = None,
                 nvtx: bool = False, disabled_reason: str = ""):
        self.rank = rank
        self.path = path
        self.disabled_reason = disabled_reason
        self._writer = writer
        self._sampler = sampler
        self._nvtx = nvtx
        self._enabled = writer is not None
        self._closed = False
        self._close_lock = threading.Lock()
        self._steps = 0
        self._nvtx_range = None
        self._reporting_thread: Optional[int] = None    # the thread reporting iterations

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _start(self) -> None:
        if self._writer is None:
            return
        self._writer.start()
        if self._sampler is not None:
            self._sampler.start()
        if self._nvtx:
            self._nvtx_range = nvtx_ranges.range_start("commsched iteration 0")
        with _active_lock:
            _active.append(self)
        atexit.register(self.close)

    def _disable(self, reason: str) -> None:
        self._enabled = False
        self.disabled_reason = reason

    # --- Observer ----------------------------------------------------------------------------
    # One writer wake-up per iteration (see writer.py): where the application marks its
    # iterations (step()), its step markers alone wake the writer; otherwise the iteration
    # records do, and the chunk records that the thread reporting them completes (at its
    # end of iteration, just before the record) wait for it. Chunk records from another
    # thread (a completion thread) wake the writer: their iteration's communication may
    # have just finished.
    def _wakes(self) -> bool:
        return not self._steps and threading.get_ident() != self._reporting_thread

    def on_chunk(self, record: ChunkRecord) -> None:
        """A chunk step finished (completion thread or end of iteration): enqueue it."""
        if self._enabled:
            self._writer.put(record, wake=self._wakes())

    def on_chunks(self, records: List[ChunkRecord]) -> None:
        """Chunk steps that finished together (completion thread or end of iteration): one
        enqueue."""
        if self._enabled:
            self._writer.put(records, wake=self._wakes())

    def on_iteration(self, record: IterationRecord) -> None:
        """A lane's iteration was flushed (training thread): enqueue it."""
        if self._enabled:
            self._reporting_thread = threading.get_ident()
            self._writer.put(record, wake=not self._steps)
            if self._nvtx:
                nvtx_ranges.mark(f"commsched flush {record.lane} iteration {record.iteration}")

    def auto_chosen(self, choice) -> None:
        """``decompose=auto``'s table of a lane (an ``AutoChoice``; submitting thread):
        enqueue it for the ``auto_choices`` table."""
        if self._enabled:
            self._writer.put(choice)

    def on_tuning(self, entry: dict) -> None:
        """An autotuner decision (``Scheduler.tuning_log`` entry; training thread): enqueue
        it for the ``tuning`` table."""
        if self._enabled:
            self._writer.put(TuningDecision(dict(entry)))

    def step(self) -> None:
        """Mark the end of an application iteration (for custom training loops).

        Records the time, asks the sampler for an NVLink sample at this boundary, and (with
        NVTX on) closes the "commsched iteration k" range and opens the next one.
        """
        if not self._enabled:
            return
        t = time.time_ns()
        index = self._steps
        self._steps += 1
        self._writer.put(StepMarker(index, t))
        if self._sampler is not None:
            self._sampler.request()
        if self._nvtx:
            nvtx_ranges.range_end(self._nvtx_range)
            self._nvtx_range = nvtx_ranges.range_start(f"commsched iteration {index + 1}")

    # --- control -----------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Block until an NVLink sample taken now and everything recorded so far are
        committed. For tests, checks and the end of a run; not for the training hot path."""
        if self._writer is None or self._closed:
            return True
        ok = self._sampler.sync(timeout) if self._sampler is not None else True
        return self._writer.flush(timeout) and ok

    def close(self, timeout: float = 10.0) -> None:
        """Take a last sample, store every pending iteration, stop both threads. Idempotent;
        also runs at interpreter exit."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._enabled = False
        with _active_lock:
            if self in _active:
                _active.remove(self)
        atexit.unregister(self.close)
        if self._nvtx:
            nvtx_ranges.range_end(self._nvtx_range)
            self._nvtx_range = None
        if self._sampler is not None:
            self._sampler.stop(timeout)     # posts its final sample before the close marker
        if self._writer is not None:
            self._writer.close(timeout)
            if self.rank == 0 and self._writer.failed is None:
                run_dir = os.path.dirname(self.path)
                notices.say(f"telemetry written to {run_dir} (commsched report {run_dir})")

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step() -> None:
    """``commsched.step()``: mark the end of an application iteration on every open recorder
    of this process (no-op when telemetry is off).

    Example::

        for batch in loader:
            loss = model(batch).sum(); loss.backward(); opt.step(); commsched.step()
    """
    with _active_lock:
        recorders = list(_active)
    for r in recorders:
        r.step()


def active_recorders() -> List[Recorder]:
    with _active_lock:
        return list(_active)


def _forget_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) inherits the recorders but not their
    threads; it must never write the parent's store, so its copies are switched off."""
    global _active_lock
    _active_lock = threading.Lock()     # the parent may have held it while forking
    for r in _active:
        r._enabled = False
        r._closed = True
    _active.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# Knobs that belong in Config; until they are there these defaults apply. An explicit
# keyword argument of open_recorder wins over the config field.
_CONFIG_KNOBS = {
    "nvml_period_ms": ("telemetry_nvml_period_ms", 100),
    "nvml_per_link": ("telemetry_nvml_per_link", True),
    "max_db_bytes": ("telemetry_max_bytes", 0),
}


def open_rank_recorder(config, device) -> "Recorder":
    """The recorder of this process's rank in the default process group, for the tensors on
    ``device``: what every adapter (DDP hook, data-parallel mode, Megatron) opens. Its store
    goes into this launch's run directory under ``config.telemetry_dir``
    (``launch_run_dir``)."""
    import torch.distributed as dist

    local_rank = (device.index or 0) if device.type == "cuda" else 0
    if getattr(config, "telemetry_dir", None):
        config = config.replace(telemetry_dir=launch_run_dir(config.telemetry_dir))
    return open_recorder(config, rank=dist.get_rank(), world_size=dist.get_world_size(),
                         local_rank=local_rank, device=device)


_RUN_KEY = "commsched/telemetry_run"


def launch_run_dir(parent: str) -> str:
    """This launch's run directory under ``parent``, the same on every rank without a
    collective: the first rank to ask names it by its start time (``run_name``) and puts
    the name in the default process group's store, where the others read it (a
    compare-and-set, so whichever rank comes first wins). A process whose group has no
    store names it alone."""
    name = run_name(parent)
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        agreed = _get_default_store().compare_set(_RUN_KEY, "", name)
        name = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    except Exception:  # no store of this kind: this rank's own name
        pass
    return os.path.join(parent, name)


def open_recorder(config, *, rank: int, world_size: int, local_rank: int = 0, device=None,
                  nvml_period_ms: Optional[int] = None, nvml_per_link: Optional[bool] = None,
                  max_db_bytes: Optional[int] = None,
                  nvml_backend: Optional[NvmlBackend] = None) -> Recorder:
    """Open the telemetry recorder of one rank.

    ``config`` is a :class:`commsched.config.Config`; ``config.telemetry_dir`` is the run
    directory (None: a disabled recorder is returned; the adapters pass a new one per
    launch, see ``open_rank_recorder``) and ``config.nvtx`` turns on NVTX iteration
    ranges. The rank's store is ``<telemetry_dir>/rank<rank>.sqlite``.

    ``device`` is the rank's CUDA device (index, ``"cuda:1"``, ``torch.device``; None: the
    current CUDA device if CUDA is available, else no GPU). ``nvml_period_ms`` is the NVLink
    sampling period (0 turns NVML sampling off); ``nvml_per_link`` samples DATA counters per
    link (about ten times the cost of a sample of the sums) instead of only sums; ``max_db_bytes``
    caps the store (0: no cap; telemetry turns itself off with one warning when reached);
    ``nvml_backend`` replaces NVML (tests). Left as None, the three knobs come from the
    config fields ``telemetry_nvml_period_ms`` (100), ``telemetry_nvml_per_link`` (True) and
    ``telemetry_max_bytes`` (0) when the config has them, else those defaults.

    Never raises because of the file system: an unwritable directory gives one
    :class:`TelemetryWarning` and a disabled recorder.

    Example::

        rec = open_recorder(Config(telemetry_dir="runs/exp1"), rank=rank, world_size=ws)
        scheduler = commsched.Scheduler(config, observer=rec)
    """
    knobs = {}
    for arg, value in (("nvml_period_ms", nvml_period_ms), ("nvml_per_link", nvml_per_link),
                       ("max_db_bytes", max_db_bytes)):
        field_name, default = _CONFIG_KNOBS[arg]
        knobs[arg] = value if value is not None else getattr(config, field_name, default)
    nvml_period_ms, nvml_per_link, max_db_bytes = (
        int(knobs["nvml_period_ms"]), bool(knobs["nvml_per_link"]), knobs["max_db_bytes"])
    run_dir = getattr(config, "telemetry_dir", None)
    if not run_dir:
        return Recorder(rank, disabled_reason="telemetry_dir is not set")
    path = rank_path(run_dir, rank)
    try:
        os.makedirs(run_dir, exist_ok=True)
        conn = create_store(path, max_bytes=max_db_bytes)
        _insert_run_row(conn, config, rank, world_size, local_rank, nvml_period_ms,
                        nvml_per_link)
        _insert_topology_row(conn, config, rank, world_size)
    except Exception as exc:  # whatever it is, it must not reach training
        what = "cannot write" if isinstance(exc, (OSError, sqlite3.Error)) else "cannot open"
        reason = f"{what} {path}: {type(exc).__name__}: {exc}"
        warnings.warn(f"commsched telemetry disabled for rank {rank}: {reason}; training "
                      f"continues without telemetry", TelemetryWarning, stacklevel=2)
        return Recorder(rank, path=path, disabled_reason=reason)

    node = socket.gethostname()
    sampler: Optional[NvlinkSampler] = None
    writer = StoreWriter(conn, rank, node=node, request_sample=lambda: None)
    writer.max_bytes = int(max_db_bytes or 0)
    try:
        selector, selector_error = _gpu_selector(device), ""
    except Exception as exc:
        selector, selector_error = None, f"cannot tell this rank's GPU: {exc!r}"
    if nvml_period_ms <= 0:
        writer.put(NvmlStatus("disabled", "NVML sampling turned off (period 0)"))
    elif selector_error:
        writer.put(NvmlStatus("error", selector_error))
    elif selector is None:
        writer.put(NvmlStatus("no_gpu", "no CUDA device for this rank; NVLink not sampled"))
    else:
        sampler = NvlinkSampler(nvml_backend or PynvmlBackend(), selector, writer.put,
                                period_s=nvml_period_ms / 1000.0, per_link=nvml_per_link)
    recorder = Recorder(rank, writer=writer, sampler=sampler, path=path,
                        nvtx=bool(getattr(config, "nvtx", False)))
    if sampler is not None:
        # The end of an iteration's communication: the sums bound it closely; every link
        # is read at the application's boundaries (step()), or here when it marks none.
        writer.request_sample = lambda: sampler.request(per_link=recorder._steps == 0)
    writer.on_failure = recorder._disable
    recorder._start()
    return recorder


def _gpu_selector(device) -> Optional[GpuSelector]:
    """Which GPU this rank's NVLinks belong to, or None when it has none."""
    import torch

    cuda = torch.cuda.is_available()
    if device is None:
        if not cuda:
            return None
        index = torch.cuda.current_device()
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            return None
        index = dev.index if dev.index is not None else (
            torch.cuda.current_device() if cuda else 0)
    uuid = None
    if cuda:
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            uuid = None     # older torch: fall back to the index
    return GpuSelector(index, uuid)


def _versions() -> dict:
    import torch

    nccl = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = None
    try:
        from importlib.metadata import version
        commsched_version = version("commsched")
    except Exception:
        commsched_version = None
    return {"python_version": platform.python_version(), "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda, "nccl_version": nccl,
            "commsched_version": commsched_version}


def _config_json(config) -> str:
    import dataclasses

    if dataclasses.is_dataclass(config):
        return json_dumps(dataclasses.asdict(config))
    return json_dumps(getattr(config, "__dict__", str(config)))


def _insert_run_row(conn: sqlite3.Connection, config, rank: int, world_size: int,
                    local_rank: int, nvml_period_ms: int, nvml_per_link: bool) -> None:
    v = _versions()
    conn.execute(
        "INSERT INTO runs (rank, world_size, local_rank, host, pid, start_ns, config_json, "
        "python_version, torch_version, cuda_version, nccl_version, commsched_version, "
        "nvml_status, nvml_period_ms, nvml_per_link) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (rank, world_size, local_rank, socket.gethostname(), os.getpid(), time.time_ns(),
         _config_json(config), v["python_version"], v["torch_version"], v["cuda_version"],
         v["nccl_version"], v["commsched_version"], "pending", nvml_period_ms,
         int(nvml_per_link)))


def _insert_topology_row(conn: sqlite3.Connection, config, rank: int,
                         world_size: int) -> None:
    """The ``topology`` row: nodes x ranks per node as the topology-aware decompositions
    would see them (``node_layout``), whatever the decomposition."""
    from ..topology import node_layout

    layout = node_layout(int(getattr(config, "local_size", 0) or 0), world_size, rank)
    conn.execute(f"CREATE TABLE IF NOT EXISTS topology ({OPTIONAL_TABLES['topology']})")
    conn.execute(
        "INSERT OR REPLACE INTO topology (rank, world_size, nodes, local_size, node, "
        "local_rank, local_size_from) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (rank, world_size, layout["nodes"], layout["local_size"], layout["node"],
         layout["local_rank"], layout["local_size_from"]))
