"""commsched's background threads, named for the operating system too.

A thread started by ``threading`` shows in ``top -H``, ``ps -L``, py-spy, perf and
``/proc/<pid>/task/*/comm`` under the name of the thread that created it: commsched's
lanes are created at the first gradient hook, so without this their threads would all
show as ``pt_autograd_0``, indistinguishable from autograd's own. Linux only (prctl);
elsewhere threads keep their inherited OS name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from typing import Callable

__all__ = ["start_thread"]

_PR_SET_NAME = 15
_OS_NAME_BYTES = 15          # the kernel keeps 15 bytes and a terminating NUL
_prctl = None


def _set_os_name(name: str) -> None:
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                 use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    if _prctl:
        _prctl(_PR_SET_NAME, name.encode()[:_OS_NAME_BYTES], 0, 0, 0)


def start_thread(target: Callable[[], None], name: str, os_name: str) -> threading.Thread:
    """Start a daemon thread running ``target``; ``name`` is its Python name,
    ``os_name`` (at most 15 bytes kept) the name the operating system shows."""
    def run() -> None:
        _set_os_name(os_name)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
