"""examples/bench/beyond_plain.py: a mode's kernel time per step beyond the plain loop's,
by kernel, from Chrome traces built by hand, against the sums worked out on paper; and the
summary of a harness document against plain and DDP."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bench"))

import beyond_plain  # noqa: E402


def kernel(name, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur,
            "args": {"device": 0, "stream": 7}}


def write(path: Path, events) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_kernels_beyond_plain_are_per_step_differences_averaged_over_rounds(tmp_path):
    # plain: 2 steps per window, one GEMM of 1000 us each
    write(tmp_path / "nvlink_plain_rank0.json.gz", [kernel("gemm", 1000)] * 2)
    # the mode, two rounds: the same GEMMs, a copy of 300 us per step in round 1 and
    # 500 us in round 2, and an NCCL kernel of 100 us per step
    write(tmp_path / "nvlink_commsched_dp_rank0.json.gz",
          [kernel("gemm", 1000)] * 2 + [kernel("void copy_kernel<float>(int)", 300)] * 2
          + [kernel("ncclDevKernel_AllReduce", 100)] * 2)
    write(tmp_path / "nvlink_commsched_dp_rank0_r2.json.gz",
          [kernel("gemm", 1000)] * 2 + [kernel("void copy_kernel<float>(int)", 500)] * 2
          + [kernel("ncclDevKernel_AllReduce", 100)] * 2)
    rows = beyond_plain.profile_rows(tmp_path, iters=2, min_ms=0.01)["commsched_dp"]
    by_name = {r["kernel"]: r for r in rows}
    assert by_name["void copy_kernel<float>(int)"]["beyond_ms"] == pytest.approx(0.4)
    assert by_name["void copy_kernel<float>(int)"]["launches"] == pytest.approx(1.0)
    assert by_name["ncclDevKernel_AllReduce"]["beyond_ms"] == pytest.approx(0.1)
    assert "gemm" not in by_name                          # the same as plain's
    assert by_name["(all but NCCL)"]["beyond_ms"] == pytest.approx(0.4)
    assert by_name["(NCCL)"]["beyond_ms"] == pytest.approx(0.1)
    assert beyond_plain.short_name("void copy_kernel<float>(int)") == "copy_kernel<float>"


def _mode(name, ms, peak, losses, status="ok"):
    return {"name": name, "status": status, "median_ms": ms, "round_medians_ms": [ms],
            "peak_mem_bytes_max_rank": peak, "peak_reserved_bytes_max_rank": 2 * peak,
            "alloc_retries_max_rank": 0, "losses": losses}


def test_the_summary_holds_each_mode_against_plain_and_its_losses_against_ddp():
    document = {"launches": [{"runs": [{"model": "m", "modes": {
        "plain": _mode("plain", 100.0, 10 << 30, [[2.0, 1.0]]),
        "ddp_default": _mode("ddp_default", 104.0, 12 << 30, [[2.0, 1.0]]),
        "ddp_bf16_hook": _mode("ddp_bf16_hook", 103.0, 11 << 30, [[2.0, 1.5]]),
        "commsched_dp": _mode("commsched_dp", 101.0, 10 << 30, [[2.0, 1.25]]),
        "commsched_dp_bf16": _mode("commsched_dp_bf16", 102.0, 11 << 30, [[2.0, 1.5]]),
    }}]}]}
    rows = {r["mode"]: r for r in beyond_plain.summary_rows(document)}
    assert rows["commsched_dp"]["x_plain"] == pytest.approx(1.01)
    assert rows["ddp_default"]["peak_x_plain"] == pytest.approx(1.2)
    assert rows["commsched_dp"]["reserved_gib"] == pytest.approx(20.0)
    assert rows["commsched_dp"]["loss_vs_ddp"] == pytest.approx(0.25)
    # bfloat16 all-reduces are held against DDP doing the same
    assert rows["commsched_dp_bf16"]["loss_reference"] == "ddp_bf16_hook"
    assert rows["commsched_dp_bf16"]["loss_vs_ddp"] == 0.0
