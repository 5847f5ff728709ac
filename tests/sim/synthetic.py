"""A synthetic telemetry run directory whose timeline is worked out by hand.

Written through the real store writer (``StoreWriter`` fed ``ChunkRecord`` /
``IterationRecord``), as a CPU run would write it (``t_start = t_dispatch``).

Recorded setting: partition 4 MiB, credit 4 MiB, fifo, no decomposition, 2 ranks (only
rank 0's file). Cost of one all-reduce chunk: 0.1 ms + 1 ms per 4 MiB, so 4 MiB -> 1.1 ms,
2 MiB -> 0.6 ms. Every iteration, times in ms after its first submission::

    bucket "0" (8 MiB, priority 1) submitted at 0.0
        chunk 0  dispatch 0.0  [0.0, 1.1]
        chunk 1  dispatch 1.1  [1.1, 2.2]   (credit: waits for chunk 0)
    bucket "1" (2 MiB, priority 0) submitted at 2.5
        chunk 0  dispatch 2.5  [2.5, 3.1]
    flush (end of backward) at 2.7; next iteration's first submission at 10.0

so: backward end 2.7, last chunk end 3.1, exposed 0.4, iteration 10.0, tail
10.0 - 3.1 = 6.9, compute-only 2.7 + 6.9 = 9.6.
"""

from __future__ import annotations

import json
import os

from commsched.observer import ChunkRecord, IterationRecord
from commsched.telemetry.store import create_store, rank_path
from commsched.telemetry.writer import StoreWriter

MS = 1_000_000
MIB = 1 << 20
T0 = 1_700_000_000 * 10**9
PERIOD_MS = 10.0
CONFIG = {"enabled": True, "partition_bytes": 4 * MIB, "credit_bytes": 4 * MIB,
          "policy": "fifo", "decompose": "none", "profile_iters": 2}
# (key, chunk, nbytes, priority, submit, dispatch, end) in ms after the iteration start
CHUNKS = [("0", 0, 4 * MIB, 1, 0.0, 0.0, 1.1),
          ("0", 1, 4 * MIB, 1, 0.0, 1.1, 2.2),
          ("1", 0, 2 * MIB, 0, 2.5, 2.5, 3.1)]
FLUSH_MS = 2.7


def _ns(ms: float) -> int:
    return int(round(ms * MS))


def write_run(run_dir: str, iterations: int = 6, config: dict = CONFIG) -> str:
    os.makedirs(run_dir, exist_ok=True)
    conn = create_store(rank_path(run_dir, 0))
    conn.execute("INSERT INTO runs (rank, world_size, local_rank, host, pid, start_ns, "
                 "config_json, torch_version, nvml_status) VALUES (0, 2, 0, 'node0', 1, ?, ?, "
                 "'test', 'disabled')", (T0, json.dumps(config)))
    writer = StoreWriter(conn, 0, node="node0")
    writer.start()
    for i in range(iterations):
        base = T0 + _ns(i * PERIOD_MS)
        nums = {"0": 2, "1": 1}
        for key, c, nbytes, prio, submit, dispatch, end in CHUNKS:
            writer.put(ChunkRecord("g0", i, key, "all_reduce", "all_reduce", "none", c,
                                   nums[key], nbytes, "float32", (0, 1), prio,
                                   base + _ns(submit), base + _ns(dispatch),
                                   base + _ns(dispatch), base + _ns(end)))
        writer.put(IterationRecord("g0", i, base, base + _ns(FLUSH_MS), 2, 3, 10 * MIB, False))
    assert writer.close(timeout=30)
    assert writer.failed is None, writer.failed
    return run_dir
