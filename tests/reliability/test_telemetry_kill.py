"""SIGKILL at random moments never loses a committed iteration.

A child process records iterations through the real recorder (``open_recorder``: writer
thread, SQLite store in WAL mode) as fast as it can. After ``Recorder.flush()`` returns True
(everything recorded so far is committed) it prints the last iteration's index. The parent
kills it with SIGKILL after a seeded random delay, then requires that the store opens and
holds every iteration up to the last index printed: the iteration row (complete, with its
chunk count), one comm_ops row per chunk, and the step marker.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from commsched.telemetry import load_run

from .children import iteration_shape
from .harness import count_fault, count_lost, run_parallel, start_forked

SEED = 31337
RUNS = 15
MAX_DELAY_S = 0.8


def _kill_run(tmp_path, k: int) -> dict:
    seed = SEED + k
    delay = random.Random(seed).uniform(0.0, MAX_DELAY_S)
    run_dir = tmp_path / f"run{k}"
    child = start_forked("reliability.children:recorder_loop", str(run_dir), str(seed))
    try:
        deadline = time.monotonic() + 60
        while not child.stdout_text().startswith("open\n"):
            assert child.alive(), child.wait(1).describe()
            assert time.monotonic() < deadline, "the recorder did not open within 60 s"
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        child.kill()                                      # SIGKILL
    result = child.wait(30)
    assert result.rc == -9, result.describe()           # it died by the signal, not by itself
    lines = result.stdout.split("\n")[1:-1]              # complete lines after "open"
    committed = int(lines[-1]) if lines else -1
    count_fault("SIGKILL of a recording process")

    run = load_run(str(run_dir))                          # must open, whatever was cut
    iterations = {r["iteration"]: r for r in run.iterations}
    chunks = Counter(c["iteration"] for c in run.comm_ops)
    steps = {s["step"] for s in run.rows("app_steps")}
    lost = []
    for i in range(committed + 1):
        n = iteration_shape(seed, i)
        row = iterations.get(i)
        if row is None or row["complete"] != 1 or row["chunks"] != n or chunks[i] != n \
                or i not in steps:
            lost.append(i)
    count_lost(len(lost))
    return {"run": k, "delay": delay, "committed": committed, "stored": len(iterations),
            "lost": lost}


def test_sigkill_at_random_moments_loses_no_committed_iteration(tmp_path):
    results = run_parallel(lambda k: _kill_run(tmp_path, k), range(RUNS), workers=3)
    lost = [f"run {r['run']} (killed after {r['delay']:.3f} s, {r['committed'] + 1} "
            f"committed): {len(r['lost'])} missing or incomplete, first {r['lost'][:5]}"
            for r in results if r["lost"]]
    assert not lost, "committed iterations lost after SIGKILL:\n" + "\n".join(lost)
    # Not vacuous: most runs had committed something before the kill.
    assert sum(r["committed"] >= 0 for r in results) >= RUNS // 2, results
    # And the store never claims fewer iterations than were reported committed.
    assert all(r["stored"] >= r["committed"] + 1 for r in results), results
