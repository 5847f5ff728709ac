"""What is allocated at a run's peak of GPU memory, and where it was allocated.

    python examples/bench/memory_peak.py SNAPSHOT.pickle [...] [--top 20] [--depth 3]

Reads CUDA memory snapshots with allocation history (the harness writes one per mode and
rank with ``BENCH_MEMORY=DIR``; any ``torch.cuda.memory._dump_snapshot`` taken after
``torch.cuda.memory._record_memory_history()`` works too) and replays the history:

* allocated bytes rise at each ``alloc`` and fall at each ``free_requested``, as
  ``torch.cuda.max_memory_allocated`` counts them; the blocks that were live at the
  highest point are grouped by where they were allocated (the innermost ``--depth`` Python
  frames outside torch itself) and printed, largest group first;
* blocks that were already allocated when recording started have no history: their bytes
  (``baseline_bytes``, which the harness stores in the snapshot) are added to every point
  and reported as one group.

A group that holds much at the peak and grows with the number of iterations recorded is
memory kept alive longer than it should be. Standard library only (the snapshot is a
pickle of plain dicts and lists): it runs where the snapshot was taken.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

TORCH_MARKERS = ("/torch/", "\\torch\\")


def site(frames: Sequence[dict], depth: int) -> str:
    """The allocation site: the innermost ``depth`` frames that are not torch's own."""
    own = [f for f in frames if not any(m in f.get("filename", "") for m in TORCH_MARKERS)]
    if not own:
        own = list(frames)
    if not own:
        return "<no stack>"
    parts = [f"{short(f['filename'])}:{f['line']} {f['name']}" for f in own[:depth]]
    return " < ".join(parts)


def short(path: str) -> str:
    """The last two components of a path: enough to tell files apart, short to print."""
    pieces = path.replace("\\", "/").split("/")
    return "/".join(pieces[-2:])


def replay(trace: Sequence[dict], baseline: int) -> Tuple[int, int, Dict[int, dict]]:
    """Walk the history; returns (peak bytes, index of the event that reached it, the
    blocks live right after that event, by address)."""
    live: Dict[int, dict] = {}
    total = peak = baseline
    peak_index = -1
    # Two passes keep the walk cheap: find where the peak is, then rebuild the live set
    # there (copying the live set at every new maximum is quadratic on long traces).
    for i, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif action == "free_requested":
            block = live.pop(event["addr"], None)
            if block is not None:
                total -= block["size"]
    live.clear()
    for event in trace[:peak_index + 1]:
        if event.get("action") == "alloc":
            live[event["addr"]] = event
        elif event.get("action") == "free_requested":
            live.pop(event["addr"], None)
    return peak, peak_index, live


def analyse(snapshot: dict, device: Optional[int] = None, depth: int = 3) -> dict:
    """Peak bytes, the event count, and the live bytes at the peak grouped by site.
    ``device``: which device's history; by default the one the harness stored
    (``device``), else 0."""
    if device is None:
        device = int(snapshot.get("device", 0))
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    baseline = int(snapshot.get("baseline_bytes", 0))
    peak, index, live = replay(trace, baseline)
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for block in live.values():
        group = groups[site(block.get("frames") or [], depth)]
        group[0] += block["size"]
        group[1] += 1
    if baseline:
        groups["<allocated before recording started>"] = [baseline, 0]
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"events": len(trace), "peak_bytes": peak, "peak_event": index,
            "baseline_bytes": baseline,
            "groups": [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ordered]}


def render(path: str, result: dict, top: int) -> str:
    mib = 2 ** 20
    lines = [f"{path}: {result['events']} events, peak {result['peak_bytes'] / mib:.1f} MiB "
             f"at event {result['peak_event']} "
             f"(baseline {result['baseline_bytes'] / mib:.1f} MiB)"]
    for group in result["groups"][:top]:
        lines.append(f"  {group['bytes'] / mib:10.1f} MiB {group['blocks']:6d} blocks  "
                     f"{group['site']}")
    rest = result["groups"][top:]
    if rest:
        lines.append(f"  {sum(g['bytes'] for g in rest) / mib:10.1f} MiB in "
                     f"{len(rest)} more sites")
    return "\n".join(lines)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshots", nargs="+", help="pickled memory snapshots")
    parser.add_argument("--top", type=int, default=20, help="sites to print (default 20)")
    parser.add_argument("--depth", type=int, default=3,
                        help="frames outside torch that name a site (default 3)")
    parser.add_argument("--device", type=int, default=None,
                        help="index into the snapshot's device traces (default: the "
                             "device the harness stored, else 0)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.snapshots:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        result = analyse(snapshot, args.device, args.depth)
        if result["events"] == 0:
            print(f"{path}: no allocation history (was _record_memory_history on?)",
                  file=sys.stderr)
            status = 1
            continue
        print(render(path, result, args.top))
    return status


if __name__ == "__main__":
    sys.exit(main())
