"""A writer process SIGKILLed mid-run leaves a readable store with every committed iteration."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from commsched.telemetry import load_run

# The child records iterations as fast as it can; after each flush() (everything so far is
# committed) it prints the iteration number, so the parent knows what must survive.
CHILD = textwrap.dedent("""
    import sys
    from commsched.config import Config
    from commsched.observer import ChunkRecord, IterationRecord
    from commsched.telemetry import open_recorder

    rec = open_recorder(Config(telemetry_dir=sys.argv[1]), rank=0, world_size=1,
                        nvml_period_ms=0)
    k = 0
    while True:
        t = k * 1000
        for c in range(4):
            rec.on_chunk(ChunkRecord("g0", k, "b0", "all_reduce", "all_reduce", "none", c, 4,
                                     4096, "float32", (0,), 0, t, t, t + c, t + c + 1))
        rec.on_iteration(IterationRecord("g0", k, t, t + 2, 1, 4, 16384, False))
        rec.step()
        if k % 10 == 0:
            rec.flush()
            print(k, flush=True)
        k += 1
""")


def test_sigkilled_writer_leaves_every_committed_iteration(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    committed = []
    deadline = time.monotonic() + 60
    try:
        while len(committed) < 5:
            line = proc.stdout.readline()
            assert line, f"child exited early with {proc.poll()}"
            committed.append(int(line))
            assert time.monotonic() < deadline, "child too slow"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    run = load_run(str(tmp_path))
    its = {i["iteration"]: i for i in run.iterations}
    steps = {s["step"] for s in run.rows("app_steps")}
    chunks_per_it = {}
    for c in run.comm_ops:
        chunks_per_it[c["iteration"]] = chunks_per_it.get(c["iteration"], 0) + 1
    for k in range(committed[-1] + 1):     # everything up to the last flush
        assert its[k]["complete"] == 1, k
        assert chunks_per_it[k] == 4
        assert k in steps
    assert run.runs[0]["end_ns"] is None    # it never closed
