"""Every stretch over 30 us where the GPU ran nothing, in a torch.profiler trace: when (ms from
the window's start), how long, how much of it the device waited for the host (the launch
call of the next activity returned after the stretch began), the launching thread and call,
the stream, and the activities before and after. For dp_regimes_2xH200_2026-11-28.md.

    python idle_stretches.py TRACE.json.gz
"""
import sys
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "bench"))
import trace_overlap as T
from collections import defaultdict
path = sys.argv[1]
ev, calls = T.load_trace(path)
cnt = defaultdict(int)
for e in ev: cnt[e.get("args", {}).get("device", 0)] += 1
dev = max(cnt, key=cnt.get)
ev = sorted((e for e in ev if e.get("args", {}).get("device", dev) == dev), key=lambda e: float(e["ts"]))
L = {e["args"]["correlation"]: e for e in calls if "correlation" in e.get("args", {})}
o = float(ev[0]["ts"]); busy = None; prev = None
rows = []
for e in ev:
    s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
    if busy is not None and s - busy > 30:
        c = L.get(e["args"].get("correlation"))
        ret = float(c["ts"]) + float(c.get("dur", 0)) if c else None
        late = 0 if ret is None else min(s - busy, max(0, ret - busy))
        rows.append(((busy - o) / 1e3, (s - busy) / 1e3, late / 1e3, c.get("tid") if c else None,
                     c["name"][:18] if c else "-", prev[:38], e["name"][:38],
                     e["args"].get("stream")))
    if busy is None or t > busy: busy, prev = t, e["name"]
print(path, "stretches > 30 us:", len(rows), "sum", round(sum(r[1] for r in rows), 2), "ms")
for r in rows:
    print(f"{r[0]:8.2f} gap {r[1]:.3f} late {r[2]:.3f} tid {r[3]} {r[4]} s{r[7]} | {r[5]} -> {r[6]}")
