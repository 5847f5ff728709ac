"""Launch an example script of examples/integrations/ on 2 CPU ranks the way its framework
does, and read what each rank wrote (``--out PREFIX``: ``PREFIX.rankN.json``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "integrations")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "scripts")
# A hang fails the test; a launch takes 10-30 s on CI's 2 cores.
LAUNCH_TIMEOUT_S = 150


def torchrun(tmp_path, *program) -> list:
    """``python -m torch.distributed.run`` with 2 local ranks, then ``program``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "--log-dir", str(tmp_path / "logs"), *program]


def env(**overrides) -> dict:
    """This environment without COMMSCHED settings, plus ``overrides``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    out.update(overrides)
    return out


def launch(cmd, tmp_path, environment, *, check: bool = True, mark: str = None):
    """Run ``cmd`` with ``--out`` under ``tmp_path``, in a session of its own (killed whole
    after LAUNCH_TIMEOUT_S): (finished process, {rank: what it wrote}, seconds from the
    last line of its output that contains ``mark`` (None: from the start) to its end)."""
    prefix = str(tmp_path / "out")
    start = time.monotonic()
    proc = subprocess.Popen([*cmd, "--out", prefix], env=environment, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    marked = [start]
    texts = {}

    def read(name, stream):
        lines = []
        for line in stream:
            if mark is not None and mark in line:
                marked.append(time.monotonic())
            lines.append(line)
        texts[name] = "".join(lines)

    readers = [threading.Thread(target=read, args=item, daemon=True)
               for item in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for reader in readers:
            reader.join(timeout=10)
    elapsed = time.monotonic() - max(marked)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, texts.get("out", ""),
                                       texts.get("err", ""))
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for rank in range(2):
        path = f"{prefix}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
    return proc, results, elapsed


def notices(proc) -> list:
    """commsched's one-line notices in the launch's stderr."""
    return [line for line in proc.stderr.splitlines() if line.startswith("commsched: ")]
