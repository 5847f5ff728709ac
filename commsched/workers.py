"""Ending a spawned rank process once its work is done.

A gloo process group runs collectives on C++ worker threads of its own. Such a thread may
drop the last reference to a finished collective a moment after the Python side moved on;
if the collective's tensors were exposed to Python, that release takes the GIL. When the
main thread has begun finalizing the interpreter by then, taking the GIL ends the thread
inside C++ and the process aborts ("terminate called without an active exception"; seen
on CPU runs, with every rank's work done and the process group destroyed). ``exit_worker``
ends such a process without finalizing the interpreter: nothing is left for the race to
hit, and the exit status stays 0.

``exit_worker`` is for processes that exist only to run one rank (``torch.multiprocessing``
workers: the demo, the benchmarks, the tests). A training script launched by ``torchrun``
ends as usual unless it calls it itself. The collectives commsched issues are kept from
the race there too (``retain``); a script's own and DDP's are not (the launcher test's
script ends with ``exit_worker``'s steps for that reason).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import sys
from typing import NoReturn

__all__ = ["exit_worker", "retain", "keep_past_exit"]


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
