"""Helpers shared by ``harness.py`` and ``microbench.py``: launching workers with a
watchdog, process-group setup, statistics, system/environment capture, commsched imports
and markdown tables.

Nothing here measures anything; the scripts read top to bottom and call into this file for
the plumbing.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent.parent

# The scripts run as ``python examples/bench/<script>.py`` from a checkout that may not be
# installed: put the checkout first so the working tree's commsched is the one measured.
for _path in (str(BENCH_DIR), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# Environment variables worth recording with every result.
ENV_PREFIXES = ("NCCL_", "COMMSCHED", "TORCH_NCCL_", "TORCH_DISTRIBUTED", "GLOO_",
                "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING",
                "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "BENCH_")


class ModeUnavailable(Exception):
    """A benchmark mode cannot run here (API not implemented, model not supported); the
    message is the reason reported as "n/a"."""


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_ms(times_ms: Sequence[float]) -> Dict[str, float]:
    """Median, mean, p10, p90, min and max of per-iteration times in milliseconds."""
    return {
        "median_ms": statistics.median(times_ms),
        "mean_ms": statistics.fmean(times_ms),
        "p10_ms": percentile(times_ms, 10),
        "p90_ms": percentile(times_ms, 90),
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
    }


# ---------------------------------------------------------------------------------------
# Launching workers
# ---------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchOutcome:
    """How a group of spawned workers ended."""

    ok: bool
    error: Optional[str]
    wall_s: float


def launch(fn: Callable, args: tuple, nprocs: int, timeout_s: float) -> LaunchOutcome:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and wait for them.

    A worker that raises or dies ends the group (torch terminates the others). A group
    still running after ``timeout_s`` seconds (a hung collective) is terminated, so that
    the caller can still report what was measured before the hang; each of its workers
    first prints every thread's Python stack on stderr (where each one waited). A worker
    whose ``fn`` returned ends without finalizing the interpreter (see ``_worker``).
    """
    start = time.monotonic()
    # ready[rank] = 1 once the worker can print its stacks: a worker still starting
    # (importing torch on a loaded machine) would be ended by the signal instead.
    ready = mp.get_context("spawn").Array("b", nprocs, lock=False)
    context = mp.start_processes(_worker, args=(ready, fn, *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() - start > timeout_s:
                _terminate(context.processes, ready)
                return LaunchOutcome(False, f"timed out after {timeout_s:.0f} s (a hung "
                                     "collective, or more work than the timeout allows); "
                                     "workers terminated",
                                     time.monotonic() - start)
    except mp.ProcessRaisedException as exc:
        text = str(exc)
        print(text, file=sys.stderr, flush=True)
        return LaunchOutcome(False, f"worker {exc.error_index} raised: {_last_line(text)}",
                             time.monotonic() - start)
    except mp.ProcessExitedException as exc:
        return LaunchOutcome(False, f"worker died: {exc}", time.monotonic() - start)
    return LaunchOutcome(True, None, time.monotonic() - start)


def _worker(rank: int, ready, fn: Callable, *args) -> None:
    """A spawned worker: ``fn(rank, *args)``, then, if it returned, the end of the process
    without finalizing the interpreter (``commsched.workers.exit_worker``: a gloo thread
    may otherwise abort the finished process). Without commsched the worker exits as
    usual. ``DUMP_SIGNAL`` makes it print every thread's Python stack on stderr."""
    if DUMP_SIGNAL is not None:
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
    ready[rank] = 1
    fn(rank, *args)
    try:
        from commsched.workers import exit_worker
    except ImportError:
        return
    exit_worker()


# The signal a hung worker gets before it is terminated: it dumps its threads' stacks.
DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


# How long a terminated worker that has not started yet is given to get there (and to be
# able to print its stacks) before it is signalled anyway.
START_GRACE_S = 60.0


def _terminate(processes: Iterable, ready) -> None:
    """Terminate the workers still alive (``processes`` in rank order), each after it
    printed its threads' stacks."""
    alive = [(rank, p) for rank, p in enumerate(processes) if p.is_alive()]
    if DUMP_SIGNAL is not None:
        # One worker at a time: dumps written together would interleave on the shared
        # stderr. Each is written from the signal handler, at once.
        deadline = time.monotonic() + START_GRACE_S
        for rank, p in alive:
            while not ready[rank] and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"[bench] rank {rank} (pid {p.pid}) is still running; its threads:",
                  file=sys.stderr, flush=True)
            os.kill(p.pid, DUMP_SIGNAL)
            time.sleep(0.3)
    processes = [p for _, p in alive]
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _last_line(text: str) -> str:
    """The exception line that ends a formatted traceback."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def init_process_group(rank: int, world_size: int, port: int, backend: str,
                       timeout_s: float) -> None:
    """Join a process group on 127.0.0.1:``port``. With NCCL, rank r uses GPU r.

    The timeout bounds every collective, so a rank left waiting by a failed peer errors
    out instead of hanging until the launcher's watchdog fires.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ \
            and os.path.exists("/sys/class/net/lo"):
        # All workers are local; keep gloo off interfaces the hostname may resolve to.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def barrier(backend: str) -> None:
    """A barrier that names the device under NCCL (avoids the guessed-device warning)."""
    if backend == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def choose_backend(force_cpu: bool, world_size: int) -> str:
    """``nccl`` when CUDA has a GPU for every worker (and CPU is not forced), else ``gloo``."""
    if not force_cpu and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def write_json(path: Path, document: Any) -> None:
    """Write ``document`` as JSON atomically (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(document), indent=2, allow_nan=False, default=str)
                   + "\n")
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------
# Environment and system
# ---------------------------------------------------------------------------------------

def relevant_env(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The NCCL_*, COMMSCHED*, TORCH_NCCL_* (and similar) variables that are set, and the
    benchmarks' own BENCH_* knobs (window, micro-batch, probes)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(ENV_PREFIXES)}


def system_info() -> Dict[str, Any]:
    """Card, driver, torch/CUDA/NCCL versions and host facts. Every field is filled when
    it can be found and ``None`` otherwise; nothing here raises."""
    info: Dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "gpu_count": 0,
        "gpu_name": None,
        "gpus": [],
        "driver": None,
        "cpu_count": os.cpu_count(),
        "commsched_version": None,
        "commsched_path": None,
        "git_commit": None,
    }
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
        info["gpu_name"] = info["gpus"][0] if info["gpus"] else None
        info["cudnn"] = _safe(torch.backends.cudnn.version)
        nccl = _safe(torch.cuda.nccl.version)
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        info["driver"] = _driver_version()
    try:
        import commsched
        info["commsched_version"] = getattr(commsched, "__version__", None)
        info["commsched_path"] = str(Path(commsched.__file__).parent)
    except Exception:  # noqa: BLE001 - the core may be absent or broken; report, go on
        pass
    info["git_commit"] = _run_quietly(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    return info


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def _driver_version() -> Optional[str]:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        out = _run_quietly(["nvidia-smi", "--query-gpu=driver_version",
                            "--format=csv,noheader"])
        return out.splitlines()[0].strip() if out else None


def _run_quietly(cmd: List[str]) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except Exception:  # noqa: BLE001
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ---------------------------------------------------------------------------------------
# commsched imports (the core is developed in parallel; a missing API is "n/a")
# ---------------------------------------------------------------------------------------

def import_commsched():
    """The ``commsched`` package, or :class:`ModeUnavailable` saying why not."""
    try:
        return importlib.import_module("commsched")
    except Exception as exc:  # noqa: BLE001
        raise ModeUnavailable(f"commsched is not importable: {exc!r}") from None


def import_commsched_hooks():
    """``commsched.hooks``, or :class:`ModeUnavailable` saying why not.

    setup.py installs the top-level ``hooks/`` folder as ``commsched.hooks``. In an
    uninstalled checkout that name may not resolve, so this loads ``hooks/`` under that
    name, the way an installation would.
    """
    commsched = import_commsched()
    try:
        return importlib.import_module("commsched.hooks")
    except ModuleNotFoundError as exc:
        if exc.name != "commsched.hooks":
            raise ModeUnavailable(f"commsched.hooks is not importable: {exc!r}") from None
    except Exception as exc:  # noqa: BLE001
        raise ModeUnavailable(f"commsched.hooks is not importable: {exc!r}") from None
    init = REPO_ROOT / "hooks" / "__init__.py"
    if not init.exists():
        raise ModeUnavailable("commsched.hooks is not implemented yet (no hooks/__init__.py)")
    spec = importlib.util.spec_from_file_location(
        "commsched.hooks", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["commsched.hooks"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        del sys.modules["commsched.hooks"]
        raise ModeUnavailable(f"hooks/ (as commsched.hooks) failed to import: {exc!r}") from None
    commsched.hooks = module
    return module


def commsched_site(tmp: Path) -> Path:
    """A directory holding the commsched package as installed (hooks/ and
    megatron_patches/ inside it), for the PYTHONPATH of processes that import it by name
    (torchrun workers under ``-m commsched.run`` or ``commsched floor``)."""
    site = Path(tmp) / "site"
    shutil.copytree(REPO_ROOT / "commsched", site / "commsched",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("hooks", "megatron_patches"):
        shutil.copytree(REPO_ROOT / folder, site / "commsched" / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return site


def close_quietly(*objects: Any) -> None:
    """Call ``close()`` on each object (or on its ``scheduler``) if it has one, ignoring
    errors: used to stop scheduler threads between modes."""
    for obj in objects:
        for target in (obj, getattr(obj, "scheduler", None)):
            close = getattr(target, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001
                    print(f"[bench] warning: {type(target).__name__}.close() raised {exc!r}",
                          file=sys.stderr, flush=True)
                break


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; ``None`` cells print as empty."""
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Optional[float], digits: int = 1) -> Optional[str]:
    """``value`` with ``digits`` decimals, or ``None``."""
    return None if value is None else f"{value:.{digits}f}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
