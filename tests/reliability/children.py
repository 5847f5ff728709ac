"""Entry points that the reliability tests run in forked children (``harness.run_forked``
with ``"reliability.children:NAME"``). Each returns an exit status or never returns."""

from __future__ import annotations

import os
import random
import sys

from commsched.config import Config
from commsched.observer import ChunkRecord, IterationRecord

T0 = 1_700_000_000 * 10**9      # wall-clock origin of the synthetic records (ns)
MS = 1_000_000


def iteration_shape(seed: int, k: int) -> int:
    """How many chunks iteration ``k`` of recorder run ``seed`` has (1..6)."""
    return random.Random(seed * 1_000_003 + k).randint(1, 6)


def record_iteration(rec, seed: int, k: int) -> None:
    """One lane iteration: its chunks (completion thread's records), the flush, a step."""
    n = iteration_shape(seed, k)
    t = T0 + k * 10 * MS
    for c in range(n):
        rec.on_chunk(ChunkRecord("g0", k, "bucket0", "all_reduce", "all_reduce", "none",
                                 c, n, 4096 * (c + 1), "float32", (0, 1), 0, t, t + c,
                                 t + 2 * c, t + 2 * c + MS))
    rec.on_iteration(IterationRecord("g0", k, t, t + n, 1, n, 4096 * n * (n + 1) // 2,
                                     False))
    rec.step()


def recorder_loop(run_dir: str, seed: str) -> int:
    """Record iterations forever; after each ``flush()`` that reported success, print the
    index of the last iteration recorded: it and every earlier one are committed.
    The parent SIGKILLs this process at a random moment."""
    from commsched.telemetry import open_recorder

    seed = int(seed)
    rng = random.Random(seed)
    rec = open_recorder(Config(telemetry_dir=run_dir), rank=0, world_size=2,
                        nvml_period_ms=0)
    assert rec.enabled, rec.disabled_reason
    print("open", flush=True)
    k = 0
    while True:
        record_iteration(rec, seed, k)
        # Flush after most iterations, sometimes let several pile up uncommitted first.
        if rng.random() < 0.7 and rec.flush(timeout=30):
            print(k, flush=True)
        k += 1


def write_store(run_dir: str, iterations: str, close: str = "1") -> int:
    """A short telemetry run: ``iterations`` iterations through the real recorder and
    writer; closed normally (one self-contained file) or, with close=0, left as a killed
    writer leaves it (WAL file next to it)."""
    from commsched.telemetry import open_recorder

    rec = open_recorder(Config(telemetry_dir=run_dir), rank=0, world_size=2,
                        nvml_period_ms=0)
    assert rec.enabled, rec.disabled_reason
    for k in range(int(iterations)):
        record_iteration(rec, 7, k)
    if close == "1":
        rec.close()
    else:
        assert rec.flush(timeout=30)
        sys.stdout.flush()
        os._exit(0)     # no close: the WAL stays, as after a crash
    return 0


def open_recorder_here(run_dir: str) -> int:
    """Open a rank-0 recorder for ``COMMSCHED_TELEMETRY_DIR``-style ``run_dir`` taken from
    the environment, relative to the cwd, record one iteration and close."""
    from commsched.telemetry import open_recorder

    config = Config.from_env()
    assert config.telemetry_dir == run_dir, (config.telemetry_dir, run_dir)
    rec = open_recorder(config, rank=0, world_size=1, nvml_period_ms=0)
    if not rec.enabled:
        print(f"disabled: {rec.disabled_reason}", file=sys.stderr)
        return 3
    record_iteration(rec, 1, 0)
    rec.close()
    return 0
