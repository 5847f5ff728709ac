"""Ending a spawned rank process once its work is done.

A gloo process group runs collectives on C++ worker threads of its own. Such a thread
destroys a finished collective a moment after reporting it complete, when its reference is
the last; a collective issued from Python, or while torch keeps Python objects in
thread-local state (it captures that state with the collective: during backward, for
one), then holds Python objects, and destroying it takes the GIL. When the main thread has
begun finalizing the interpreter by then, taking the GIL ends the thread inside C++ and the
process aborts ("terminate called without an active exception"). Stock DDP on gloo meets
this too: its own all-reduces are destroyed by the worker thread, and a script that ends
within a few milliseconds of its last backward, on a loaded machine, aborts now and then
(seen on CPU runs, with every rank's work done and the process group destroyed).

Three defences, by who ends the process:
- ``exit_worker`` ends a process that exists only to run one rank (``torch.multiprocessing``
  workers: the demo, the benchmarks, the tests) without finalizing the interpreter: nothing
  is left for the race to hit, and the exit status stays 0.
- ``retain`` keeps the collectives commsched issues referenced, past the interpreter's end
  for the newest (``keep_past_exit``), so no gloo worker's release of them is the last.
- ``settle_gloo_workers``, at exit where commsched was used (the scheduler's exit handler),
  waits until every gloo worker thread is back waiting for work, so that what the
  worker threads still had to destroy (DDP's own collectives, the script's) is destroyed
  while the interpreter still hands out the GIL.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import sys
import time
from typing import List, NoReturn, Optional

__all__ = ["exit_worker", "retain", "keep_past_exit", "settle_gloo_workers"]


def exit_worker(code: int = 0) -> NoReturn:
    """Run the exit handlers (they close open schedulers and telemetry), flush stdout and
    stderr, and end the process with ``code`` without finalizing the interpreter. Call it
    after ``dist.destroy_process_group()``, as the worker's last statement."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass        # closed or replaced by something without flush()
    os._exit(code)



# How many of the gloo collectives commsched issued last stay referenced (``retain``).
RECENT_WORKS = 64
_recent_works: "collections.deque" = collections.deque(maxlen=RECENT_WORKS)


def retain(work) -> None:
    """Keep ``work``, a collective commsched issued on a CPU (gloo) process group,
    referenced until ``RECENT_WORKS`` newer ones were issued, and past the interpreter's
    end if it is among them then (``keep_past_exit``).

    A gloo worker thread lets go of each collective it ran a moment after reporting it
    complete. When its reference is the last, it destroys the collective, and a collective
    issued from Python holds Python objects (the views of the tensors it reduces; during
    backward, the context torch keeps in thread-local state), so destroying it takes the
    GIL. A thread that asks for the GIL after the interpreter began finalizing is ended
    inside C++, and the process aborts ("terminate called without an active exception").
    The end of a script comes a few milliseconds after its last backward, so without this
    the worker's release of the last collectives raced the interpreter's end (seen with a
    read-only telemetry directory, whose telemetry then costs nothing at exit)."""
    _recent_works.append(work)


def keep_past_exit() -> None:
    """At exit, once the schedulers are closed: the collectives ``retain`` still holds are
    never released (the process is ending), so no gloo worker's release is the last."""
    while _recent_works:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_recent_works.popleft()))


# The name a gloo process group gives its worker threads (c10d's ProcessGroupGloo::runLoop).
GLOO_WORKER_THREAD = "pt_gloo_runloop"
SETTLE_POLL_S = 0.001
SETTLE_TIMEOUT_S = 1.0


def settle_gloo_workers(timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait, up to ``timeout_s``, until every gloo worker thread of this process is asleep
    (back waiting for work) on two polls in a row with the GIL free in between; returns
    whether they settled. A worker that was between completing a collective and destroying
    it is then either done, or was waiting for the GIL and got it while this thread slept.
    Immediate where the process has no gloo worker threads. Linux only (``/proc``):
    elsewhere one short sleep lets a waiting worker take the GIL."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        states = _gloo_worker_states()
        if states is None:
            time.sleep(SETTLE_POLL_S * 10)
            return False
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        if not states or quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(SETTLE_POLL_S)             # (the GIL is free while this thread sleeps)


def _gloo_worker_states() -> Optional[List[str]]:
    """The scheduler states ("R", "S", ...) of this process's gloo worker threads, from
    ``/proc/self/task``; None where there is no such directory."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue                          # (the thread ended meanwhile)
        # "tid (name) state ...": the name may hold spaces and parentheses
        close = stat.rfind(")")
        if stat[stat.find("(") + 1:close] == GLOO_WORKER_THREAD:
            states.append(stat[close + 2:close + 3])
    return states
