"""The harness's both-at-once mode and its BENCH_SPLIT windows (examples/bench/harness.py),
in process on one gloo rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bench"))

import harness  # noqa: E402
from commsched.telemetry import step_split  # noqa: E402


def window(span, kernels, exposed=0.0, collectives=None):
    return {"span_ms": span, "exposed_ms": exposed, "tail_ms": exposed, "tail_note": None,
            "host_late_ms": 0.0, "kernels": kernels, "collectives": collectives or {}}


class FakeBench:
    def __init__(self):
        self.cache = {}
        self.window = None
        self.window_reason = "not measured: the mode recorded no window"


def mode(name):
    return next(m for m in harness.MODES if m.name == name)


def test_every_mode_after_compute_only_is_split_against_its_window():
    bench, results = FakeBench(), {}
    compute = window(80.0, {"gemm": [4, 70.0]})
    comm = window(20.0, {}, collectives={"nccl": [2, 18.0]})
    both = window(95.0, {"gemm": [4, 76.0]}, exposed=4.0, collectives={"nccl": [2, 19.0]})
    hook = window(90.0, {"gemm": [4, 72.0], "copy": [1, 2.0]}, exposed=5.0)
    # timed medians: compute only 81, the hook 93: 12 above it (the windows say 10)
    for name, w, ms in (("compute_only", compute, 81.0), ("comm_only", comm, 21.0),
                        ("both_at_once", both, 96.0), ("ddp_commsched", hook, 93.0),
                        ("comm_only_bf16", comm, 11.0)):
        bench.window = w
        results[name] = {"median_ms": ms}
        harness.attach_split(bench, mode(name), results[name])
    for name in ("compute_only", "comm_only", "comm_only_bf16"):
        assert set(results[name]) == {"median_ms"}
    assert results["ddp_commsched"]["split"] == step_split.split(hook, compute,
                                                                 timed_above_ms=12.0)
    assert (results["ddp_commsched"]["split"]["above_ms"],
            results["ddp_commsched"]["split"]["window_above_ms"],
            results["ddp_commsched"]["split"]["own_ms"]) == pytest.approx((12.0, 10.0, 2.0))
    assert results["ddp_commsched"]["split_verdict"].startswith("of 12.0 ms above compute")
    assert results["both_at_once"]["both_at_once"] == step_split.both_at_once(both, compute,
                                                                             comm)
    bench.window = None                 # a mode without a window (CPU) gets nothing
    result = {"median_ms": 90.0}
    harness.attach_split(bench, mode("commsched_dp"), result)
    assert result == {"median_ms": 90.0}


def test_both_at_once_gives_the_reason_comm_only_recorded_no_window():
    bench = FakeBench()
    bench.window = window(80.0, {"gemm": [4, 70.0]})
    harness.attach_split(bench, mode("compute_only"), {"median_ms": 80.0})
    bench.window, bench.window_reason = None, "not measured: the window ran no device activity"
    harness.attach_split(bench, mode("comm_only"), {"median_ms": 1.0})
    bench.window = window(82.0, {"gemm": [4, 72.0]})
    result = {"median_ms": 83.0}
    harness.attach_split(bench, mode("both_at_once"), result)
    assert result["both_at_once"]["compute_slowed_ms"] == pytest.approx(2.0)
    assert result["both_at_once"]["not_measured"] == (
        "the comm only window: not measured: the window ran no device activity")


def test_both_at_once_runs_compute_only_with_the_buckets_beside_it(world1, monkeypatch):
    monkeypatch.delenv("BENCH_WINDOW", raising=False)
    bench = harness.Bench(0, 1, "gloo", harness.gpt_workload(quick=True), warmup=1, iters=2)
    buckets = [4096, 1024, 64]
    bench.cache["buckets"] = (buckets, "test")
    group = dist.group.WORLD

    def collectives(run):
        before = group._get_sequence_number_for_group()
        result = run(bench)
        return result, group._get_sequence_number_for_group() - before

    result, both = collectives(harness.run_both_at_once)
    _, compute = collectives(harness.run_compute_only)
    assert len(result["iter_ms"]) == 2 and result["buckets"] == 3
    # compute only's collectives (DDP's start, the timing barrier) and, in each of the 3
    # steps (1 warm-up, 2 timed), the three buckets
    assert both - compute == 3 * len(buckets)


def test_the_gpu_checks_hand_reading_agrees_with_the_package_on_the_fixture_traces():
    """examples/bench/step_split_check.py reads kernel time by name on its own; on the
    recorded fixture windows (tests/fixtures/traces) it finds the constructed own work
    (a 4 us copy) and slowdown (a 36 us kernel that takes 30 in compute only)."""
    import step_split_check
    from commsched.telemetry import timeline

    traces = Path(__file__).resolve().parent / "fixtures" / "traces"
    step, compute = str(traces / "step_window.json.gz"), str(traces / "compute_window.json.gz")
    hand = step_split_check.hand_read(step, compute, iters=2)
    assert hand == pytest.approx({"own_ms": 0.004, "slowed_ms": 0.006,
                                  "kernel_change_ms": 0.010})

    def figures(path):
        return step_split.window_figures(*timeline.load_trace(path), 2)

    parts = step_split.split(figures(step), figures(compute), timed_above_ms=0.040)
    row = step_split_check.compare("fixture", parts, hand)
    assert (row["above_ms"], row["window_above_ms"]) == pytest.approx((0.040, 0.032))
    assert row["own_diff_ms"] == pytest.approx(0.0, abs=1e-12)
    assert row["kernel_change_diff_ms"] == pytest.approx(0.0, abs=1e-12)
    assert row["parts_sum_vs_above"] == pytest.approx(1.0)
