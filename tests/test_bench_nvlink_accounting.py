"""Smoke test of examples/bench/nvlink_accounting.py in its CPU mode (gloo, tiny model,
fake NVML whose counters move by each collective's ring share as it is reported): the
script trains with the hook and with the data-parallel mode, reads both runs with the
report's code and prints the table last. Not a check of NVLink (that needs GPUs)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_nvlink_accounting_quick_mode_reports_both_modes(tmp_path):
    out = tmp_path / "nvlink.json"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "bench" /
                                               "nvlink_accounting.py"),
                           "--quick", "--steps", "6", "--timeout", "150", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("| dp | 1 |"), proc.stdout
    document = json.loads(out.read_text())
    assert document["status"] == "ok" and document["settings"]["backend"] == "gloo"
    for mode in ("hook", "dp"):
        ranks = document["modes"][mode]["ranks"]
        assert sorted(ranks) == ["0", "1"]
        for r in ranks.values():
            assert r["iterations"] >= 5
            assert r["expected_bytes"] > 0 and r["counted_bytes"] > 0
            # the fake counters move by exactly the expected bytes, a little late
            assert 0.8 < r["ratio_run"] < 1.2, r
