"""examples/bench/memory_peak.py on an allocation history built by hand, against the peak
and the live blocks worked out on paper."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bench"))

import memory_peak  # noqa: E402

MIB = 2 ** 20


def frames(*sites):
    """Innermost first, as CUDA snapshots list them; a torch frame on top of each stack."""
    stack = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1,
              "name": "linear"}]
    stack += [{"filename": f"/repo/pkg/{f}", "line": n, "name": name}
              for f, n, name in sites]
    return stack


GRAD = frames(("engine.py", 10, "reduce"), ("hooks.py", 5, "hook"))
FLAT = frames(("scheduler.py", 77, "all_gather"), ("engine.py", 20, "issue"))
ACT = frames(("model.py", 3, "forward"))


def alloc(addr, mib, stack):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "stream": 0,
            "frames": stack}


def free(addr, mib, action="free_requested"):
    return {"action": action, "addr": addr, "size": mib * MIB, "stream": 0, "frames": []}


# Baseline 100 MiB. Running total after each event:
#   act 40 -> 140; grad 8 -> 148; flat 16 -> 164; act freed -> 124 (its free_completed
#   changes nothing); flat 16 -> 140; grad 8 -> 148; act 30 -> 178 (peak); act freed
#   -> 148; grad freed -> 140; a free of an address never seen (allocated before
#   recording started) changes nothing.
# Live at the peak: two flats (32 MiB), two grads (16), one activation (30).
HISTORY = [alloc(1, 40, ACT), alloc(2, 8, GRAD), alloc(3, 16, FLAT), free(1, 40),
           free(1, 40, "free_completed"), alloc(4, 16, FLAT), alloc(5, 8, GRAD),
           alloc(6, 30, ACT), free(6, 30), free(2, 8), free(99, 64),
           {"action": "segment_alloc", "addr": 1000, "size": 512 * MIB, "frames": []}]


def snapshot(device=1):
    traces = [[], []]
    traces[device] = HISTORY
    return {"device_traces": traces, "segments": [], "baseline_bytes": 100 * MIB,
            "device": device}


def test_peak_and_what_was_live_there_match_the_history():
    r = memory_peak.analyse(snapshot())        # device 1, as the snapshot says
    assert r["events"] == len(HISTORY)
    assert r["peak_bytes"] == 178 * MIB
    assert r["peak_event"] == 7
    by_site = {g["site"]: (g["bytes"] // MIB, g["blocks"]) for g in r["groups"]}
    assert by_site == {
        "<allocated before recording started>": (100, 0),
        "pkg/scheduler.py:77 all_gather < pkg/engine.py:20 issue": (32, 2),
        "pkg/model.py:3 forward": (30, 1),
        "pkg/engine.py:10 reduce < pkg/hooks.py:5 hook": (16, 2),
    }
    # Largest group first.
    assert [g["bytes"] for g in r["groups"]] == sorted(
        (g["bytes"] for g in r["groups"]), reverse=True)


def test_depth_and_device_arguments():
    r = memory_peak.analyse(snapshot(), depth=1)
    sites = {g["site"] for g in r["groups"]}
    assert "pkg/scheduler.py:77 all_gather" in sites
    assert "pkg/engine.py:10 reduce" in sites
    # Device 0 of this snapshot has no history: only the baseline.
    r0 = memory_peak.analyse(snapshot(), device=0)
    assert r0["events"] == 0 and r0["peak_bytes"] == 100 * MIB


def test_command_line(tmp_path, capsys):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    assert memory_peak.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak 178.0 MiB at event 7 (baseline 100.0 MiB)" in out
    assert "100.0 MiB      0 blocks  <allocated before recording started>" in out
    assert "46.0 MiB in 2 more sites" in out
    empty = tmp_path / "e.pickle"
    empty.write_bytes(pickle.dumps({"device_traces": [[]], "segments": []}))
    assert memory_peak.main([str(empty)]) == 1
