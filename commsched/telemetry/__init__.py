"""commsched telemetry: what each collective did and what the NVLinks saw while it ran.

Modules, in data-flow order::

    recorder.py   Observer implementation; open_recorder(), step()
    sampler.py    NVLink sampler thread (NVML counters, on a period and at boundaries)
    nvml.py       NVML backend interface: pynvml backend, fake backend, topology
    writer.py     writer thread: batches rows into the store
    assembly.py   joins chunks, iterations and samples into per-iteration rows
    store.py      SQLite schema, one file per rank; load_run() merges a run directory
    metrics.py    bus bandwidth, interval unions, counter interpolation, outlier statistics
    analysis.py   per-iteration table, summary and outlier attribution (used by report)
    decomposition.py  nodes x local ranks, the decompositions that ran, auto's table
    timeline.py   a torch.profiler trace's compute, exposed communication and idle time
    step_split.py a step's time above compute only, by cause, from two profiled windows
    window.py     ProfiledWindow: records one window of steps with the split's markers
    report.py     ``commsched report`` (text / JSON)      plot.py: ``--plot``
    trace.py      ``commsched trace`` (Chrome / Perfetto trace JSON)
    nvtx_ranges.py  NVTX push/pop used around dispatches
    selfcheck.py  GPU check: NVLink DATA bytes vs the ring all-reduce payload
    errors.py     TelemetryError (unreadable store), TelemetryWarning (telemetry disabled)

Example::

    rec = commsched.telemetry.open_recorder(config, rank=rank, world_size=world_size)
    scheduler = commsched.Scheduler(config, observer=rec)
    # (or both at once: commsched.adapter.build_scheduler(config, device))
"""

from __future__ import annotations

from .errors import TelemetryError, TelemetryWarning
from .nvtx_ranges import nvtx_range_pop, nvtx_range_push

# The recorder and the store (sqlite3, NVML, numpy) load on first use: the scheduler and
# the DDP hook import this package for its light modules alone.
_RECORDER = ("Recorder", "open_rank_recorder", "open_recorder", "step")
_STORE = ("RunData", "load_run")


def __getattr__(name):
    if name in _RECORDER:
        from . import recorder

        return getattr(recorder, name)
    if name in _STORE:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Recorder", "open_recorder", "open_rank_recorder", "step",
    "load_run", "RunData", "TelemetryError", "TelemetryWarning", "nvtx_range_push",
    "nvtx_range_pop", "report_main", "trace_main",
]


def report_main(argv=None) -> int:
    """``commsched report RUN_DIR ...`` (see :mod:`commsched.telemetry.report`)."""
    from .report import main
    return main(argv)


def trace_main(argv=None) -> int:
    """``commsched trace RUN_DIR -o trace.json`` (see :mod:`commsched.telemetry.trace`)."""
    from .trace import main
    return main(argv)
