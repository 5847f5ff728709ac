"""Run a function on N CPU processes with gloo, failing fast on a hang.

Every multi-process test goes through ``run_workers``: a worker that hangs (a mismatched
collective, a deadlock) makes the test fail after ``timeout`` seconds instead of eating
CI's time budget.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commsched.workers import exit_worker

DEFAULT_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args, env):
    # A worker killed by a signal (an abort in C++, say) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    # The ranks share CI's 2 cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Leave together: a rank that exits while its peer still talks to it turns a
        # clean result into a connection error on the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A worker that succeeded ends without finalizing the interpreter (see
    # commsched/workers.py); closing schedulers at exit is tested on its own
    # (test_completion.py).
    exit_worker()


def run_workers(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, env=None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    Raises if any worker raised, or ``TimeoutError`` if they have not all finished within
    ``timeout`` seconds (the workers are killed).
    """
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, env or {}),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish "
                               f"within {timeout:.0f}s (hang?)")


def run_group(cmd, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: on
    a timeout the whole process group is killed (a launcher's ranks too, not only the
    launcher), then ``TimeoutExpired`` is raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class SmallNet(torch.nn.Module):
    """Three linear layers (16 -> 64 -> 64 -> 3): with ``bucket_cap_mb=0.01`` DDP cuts its
    gradients into several buckets."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64),
                                    nn.Tanh(), nn.Linear(64, 3))

    def forward(self, x):
        return self.layers(x)
