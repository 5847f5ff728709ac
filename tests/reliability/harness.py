"""Child processes with hard timeouts, and the suite's fault/input counters.

Two ways to run a command here:

* ``run_subprocess``: a real ``python -m ...`` process. Exact, but every one pays torch's
  import (~3 s on CI's 2 cores), so the suite uses it for a sample of cases.
* ``run_forked``: a process forked from a fork server that has already imported torch and
  commsched (``multiprocessing`` "forkserver": a fresh interpreter, not a copy of pytest).
  The child redirects its stdout/stderr to files, sets its environment and cwd, calls the
  entry point and exits the way the interpreter would: ``sys.exit`` codes as such, an
  uncaught exception printed by ``sys.excepthook`` (so "Traceback" shows up in stderr) with
  exit status 1, atexit handlers run. Milliseconds per case.

A child still running at its timeout is killed and counted as a hang.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import importlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIRS = ("commsched", "hooks", "megatron_patches")
COUNTS_ENV = "RELIABILITY_COUNTS"       # not COMMSCHED_*: Config.from_env() rejects those
COUNTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".last_counts.json")

# --- counters -------------------------------------------------------------------------------

_lock = threading.Lock()
COUNTS = {"faults_injected": collections.Counter(), "inputs_fuzzed": collections.Counter(),
          "hangs": 0, "lost_completed_iterations": 0, "child_processes": collections.Counter(),
          "notes": []}


def note(text: str) -> None:
    """Something the counts should explain (a scenario that did not apply here, ...)."""
    with _lock:
        if text not in COUNTS["notes"]:
            COUNTS["notes"].append(text)


def count_fault(kind: str, n: int = 1) -> None:
    with _lock:
        COUNTS["faults_injected"][kind] += n


def count_input(kind: str, n: int = 1) -> None:
    with _lock:
        COUNTS["inputs_fuzzed"][kind] += n


def count_hang() -> None:
    with _lock:
        COUNTS["hangs"] += 1


def count_lost(n: int) -> None:
    with _lock:
        COUNTS["lost_completed_iterations"] += n


def _count_child(kind: str) -> None:
    with _lock:
        COUNTS["child_processes"][kind] += 1


def write_counts(path: str = COUNTS_FILE) -> None:
    with _lock:
        data = {k: dict(v) if isinstance(v, collections.Counter) else
                list(v) if isinstance(v, list) else v for k, v in COUNTS.items()}
    data["faults_injected_total"] = sum(data["faults_injected"].values())
    data["inputs_fuzzed_total"] = sum(data["inputs_fuzzed"].values())
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


# --- results --------------------------------------------------------------------------------

@dataclass
class Result:
    argv: Sequence[str]
    rc: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    def describe(self) -> str:
        return (f"argv={list(self.argv)!r} rc={self.rc} timed_out={self.timed_out}\n"
                f"--- stderr (tail) ---\n{self.stderr[-1500:]}\n"
                f"--- stdout (tail) ---\n{self.stdout[-500:]}")


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without any COMMSCHED* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.pop(COUNTS_ENV, None)
    env.update(extra or {})
    return env


def problems_of_clean_failure(r: Result, mentions: Iterable[str] = (),
                              codes: Sequence[int] = (2,)) -> List[str]:
    """Why ``r`` is not "a non-zero exit with a clear message": empty when it is."""
    out = []
    if r.timed_out:
        out.append("hung (killed at its timeout)")
    elif r.rc not in codes:
        out.append(f"exit status {r.rc}, expected one of {list(codes)}")
    if "Traceback" in r.stderr or "Traceback" in r.stdout:
        out.append("printed a traceback")
    if not r.stderr.strip():
        out.append("nothing on stderr")
    for m in mentions:
        if m not in r.stderr:
            out.append(f"stderr does not mention {m!r}")
    return out


# --- real subprocesses ------------------------------------------------------------------------

def run_subprocess(argv: Sequence[str], *, env: Dict[str, str], cwd: str,
                   timeout: float = 90.0) -> Result:
    _count_child("subprocess")
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
        count_hang()
    return Result(argv, proc.returncode, out.decode("utf-8", "replace"),
                  err.decode("utf-8", "replace"), timed_out, time.monotonic() - t0)


def run_parallel(fn: Callable, items: Sequence, workers: int = 2) -> list:
    """``[fn(item) for item in items]`` on ``workers`` threads (children run meanwhile)."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


# --- forked children ------------------------------------------------------------------------

PRELOAD = ["commsched.run", "commsched.cli", "commsched.telemetry",
           "commsched.telemetry.report", "commsched.telemetry.trace",
           "commsched.megatron_patches.launch_script", "reliability.harness",
           "reliability.children"]
_ctx = None
_ctx_lock = threading.Lock()
# A forkserver child's exit status is 4 bytes on its sentinel pipe, and whoever polls first
# consumes them: a second poller meanwhile reads EOF and records 255. Process.start() polls
# every live child (multiprocessing's _cleanup), so with children started and awaited from
# several threads, every start() and every poll goes through this lock.
_status_lock = threading.Lock()


def _context():
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _ctx = ctx
        return _ctx


ENTRIES = {
    # name: (module, function); the function's return value is the exit status, as in
    # `sys.exit(main())`.
    "cli": ("commsched.cli", "main"),                       # the `commsched` command
    "run": ("commsched.run", "main"),                       # python -m commsched.run
}


def _exit_status(code) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(entry: str, args: tuple, env: Optional[Dict[str, str]], cwd: str, out: str,
           err: str, limits: Optional[dict]) -> None:
    """Body of a forked child: redirect, set up, run ``entry``, exit like the interpreter."""
    os.setsid()     # its own process group: a kill reaches whatever it started too
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # What a fresh interpreter has here (C.UTF-8): strict-ish stdout, backslashreplace stderr.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="surrogateescape", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    code = 1
    try:
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if limits and "fsize" in limits:
            import resource
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past it fails (EFBIG)
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (limits["fsize"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        module, function = ENTRIES.get(entry) or entry.split(":")
        sys.argv = [module] + [str(a) for a in (args[0] if entry in ENTRIES else args)]
        try:
            fn = getattr(importlib.import_module(module), function)
            code = _exit_status(fn(*args))
        except SystemExit as exc:
            code = _exit_status(exc.code)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        try:
            atexit._run_exitfuncs()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


class Forked:
    """A started forked child: ``process`` (``.pid``, ``.kill()``), and its output files."""

    def __init__(self, argv, process, out: str, err: str, tmp: str):
        self.argv, self.process, self.out, self.err, self._tmp = argv, process, out, err, tmp
        self.t0 = time.monotonic()

    def _read(self, path: str) -> str:
        try:
            with open(path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:       # the child has not opened it yet
            return ""

    def stdout_text(self) -> str:
        return self._read(self.out)

    def alive(self) -> bool:
        with _status_lock:
            return self.process.is_alive()

    def _join(self, timeout: float) -> None:
        multiprocessing.connection.wait([self.process.sentinel], timeout)
        with _status_lock:
            self.process.join(0)

    def kill(self) -> None:
        """SIGKILL the child and everything in its process group."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()

    def wait(self, timeout: float) -> Result:
        self._join(timeout)
        timed_out = self.alive()
        if timed_out:
            self.kill()
            self._join(30)
            count_hang()
        with _status_lock:
            rc = self.process.exitcode
        r = Result(self.argv, rc, self.stdout_text(), self._read(self.err), timed_out,
                   time.monotonic() - self.t0)
        _live.discard(self)
        shutil.rmtree(self._tmp, ignore_errors=True)
        return r


_live: "set[Forked]" = set()


@atexit.register
def _kill_leftovers() -> None:
    """A test that failed half-way may leave a child running: kill it, or multiprocessing
    would wait for it at exit (these children are not daemons)."""
    for child in list(_live):
        if child.alive():
            child.kill()


def start_forked(entry: str, *args, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, limits: Optional[dict] = None) -> Forked:
    """Start ``entry`` ("cli", "run" or "module:function") in a forked child."""
    _count_child("forked")
    tmp = tempfile.mkdtemp(prefix="reliability-child-")
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    env = clean_env() if env is None else env
    # Not a daemon: `commsched demo` starts processes of its own.
    p = _context().Process(target=_child, args=(entry, args, env, cwd or tmp, out, err, limits))
    with _status_lock:
        p.start()
    argv = [entry, *(args[0] if entry in ENTRIES else args)]
    child = Forked(argv, p, out, err, tmp)
    _live.add(child)
    return child


def run_forked(entry: str, *args, env: Optional[Dict[str, str]] = None,
               cwd: Optional[str] = None, timeout: float = 60.0,
               limits: Optional[dict] = None) -> Result:
    return start_forked(entry, *args, env=env, cwd=cwd, limits=limits).wait(timeout)
