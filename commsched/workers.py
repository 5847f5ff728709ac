"""Ending a spawned rank process once its work is done.

A gloo process group runs collectives on C++ worker threads of its own. Such a thread may
drop the last reference to a finished collective a moment after the Python side moved on;
if the collective's tensors were exposed to Python, that release takes the GIL. When the
main thread has begun finalizing the interpreter by then, taking the GIL ends the thread
inside C++ and the process aborts ("terminate called without an active exception"; seen
on CPU runs, with every rank's work done and the process group destroyed). ``exit_worker``
ends such a process without finalizing the interpreter: nothing is left for the race to
hit, and the exit status stays 0.

It is for processes that exist only to run one rank (``torch.multiprocessing`` workers: the
demo, the benchmarks, the tests). A training script launched by ``torchrun`` ends as usual
unless it calls it itself; with gloo it meets the same race (the launcher test's script
ends this way).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_worker"]


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
