"""Smoke test of the benchmark scripts (examples/bench/) on CPU with gloo.

The harness and the micro-benchmark run end to end as subprocesses, in their quickest
settings, and must write the documented JSON and print a markdown table last. Timings are
not checked: CI timings are noise (see benchmarks/README.md); speed is judged on the GPU machine.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "examples" / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import models  # noqa: E402

# Modes the harness measures itself, with no commsched API involved: these must run.
HARNESS_OWN_MODES = ("plain", "compute_only", "ddp_default", "comm_only", "floor", "both_at_once")
# The canonical set, in table order.
ALL_MODES = ("plain", "compute_only", "ddp_default", "comm_only", "floor", "both_at_once",
             "comm_only_bf16",
             "floor_bf16", "ddp_bf16_hook", "ddp_commsched", "ddp_commsched_telemetry",
             "commsched_dp", "commsched_dp_bf16", "commsched_dp_zero")
# Modes that run another mode's code with other settings (not run by the smoke test).
VARIANT_MODES = ("comm_only_bf16", "commsched_dp_bf16")
# A variant the smoke test runs: the tuner, with telemetry.
AUTOTUNE = "ddp_commsched_telemetry@autotune=1"
RESULT_KEYS = ("name", "label", "status", "reason", "median_ms", "mean_ms", "p10_ms",
               "p90_ms", "min_ms", "max_ms", "iter_ms", "peak_mem_bytes", "throughput",
               "throughput_unit", "efficiency")
ITERS = 2
WINDOW = 3      # BENCH_WINDOW of the harness run: one interior step per window


def run_script(script: str, args: list, timeout: float,
               env: dict = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"exit status {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr (tail) ---\n{proc.stderr[-5000:]}")


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@pytest.fixture(scope="module")
def harness_tmpdir(tmp_path_factory):
    """TMPDIR of the harness run: what its modes leave behind."""
    return tmp_path_factory.mktemp("bench_tmpdir")


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, harness_tmpdir):
    out = tmp_path_factory.mktemp("bench") / "harness.json"
    # Every mode but the ones that only vary another's settings (kept out for CI time).
    modes = [m for m in ALL_MODES if m not in ("floor", "floor_bf16") and m not in VARIANT_MODES]
    modes.append(AUTOTUNE)
    proc = run_script("harness.py", ["--model", "gpt", "--quick", "--cpu", "--warmup", "1",
                                     "--iters", str(ITERS), "--timeout", "200",
                                     "--modes", ",".join(modes), "--out", str(out)],
                      timeout=240, env={"TMPDIR": str(harness_tmpdir),
                                        "BENCH_WINDOW": str(WINDOW)})
    document = json.loads(out.read_text()) if out.exists() else None
    return proc, document


@pytest.fixture(scope="module")
def microbench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "microbench.json"
    proc = run_script("microbench.py", ["--chunks", "32", "--chunks-per-iter", "8",
                                        "--repeats", "1", "--mlp-warmup", "1",
                                        "--mlp-iters", "2", "--timeout", "150",
                                        "--out", str(out)], timeout=180)
    document = json.loads(out.read_text()) if out.exists() else None
    return proc, document


# --- harness ------------------------------------------------------------------------------

def test_harness_exits_cleanly_and_prints_the_table_last(harness_run):
    proc, document = harness_run
    assert proc.returncode == 0, explain(proc)
    assert document is not None, explain(proc)
    assert last_line(proc.stdout).startswith("| "), explain(proc)
    table = proc.stdout[proc.stdout.index("| regime |"):]
    for mode in harness.MODES:
        assert (mode.label in table) == (mode.name not in VARIANT_MODES), mode.name


def test_harness_json_describes_system_settings_and_environment(harness_run):
    _, document = harness_run
    assert document["schema"] == "commsched.bench.harness/1"
    for key in ("torch", "cuda", "nccl", "gpu_name", "driver", "cpu_count"):
        assert key in document["system"]
    assert document["settings"]["iters"] == ITERS
    assert document["settings"]["backend"] == "gloo"
    [launch] = document["launches"]
    assert launch["status"] == "ok" and launch["error"] is None
    assert launch["regime"] == "nvlink"
    assert launch["env"]["NCCL_NVLS_ENABLE"] == "0"


def test_harness_reports_every_mode_with_a_number_or_a_reason(harness_run):
    _, document = harness_run
    [run] = document["launches"][0]["runs"]
    assert run["model"] == "gpt" and is_number(run["params"]) and run["unit"] == "tokens"
    assert tuple(run["modes"]) == (*ALL_MODES, AUTOTUNE)
    for name, result in run["modes"].items():
        assert set(RESULT_KEYS) <= set(result), name
        assert result["status"] in ("ok", "n/a"), f"{name}: {result['status']}: {result['reason']}"
        if result["status"] == "ok":
            assert is_number(result["median_ms"]) and result["median_ms"] > 0, name
            assert is_number(result["efficiency"]), name
            if name != "floor":
                assert len(result["iter_ms"]) == ITERS, name
                assert all(is_number(t) for t in result["iter_ms"]), name
                assert result["p10_ms"] <= result["median_ms"] <= result["p90_ms"], name
                steady = result["steady_ms"]
                assert len(steady) == ITERS * (WINDOW - 2), name
                assert all(is_number(t) and t > 0 for t in steady), name
                assert result["steady_median_ms"] == statistics.median(steady), name
                assert is_number(result["steady_efficiency"]), name
        else:
            assert isinstance(result["reason"], str) and result["reason"].strip(), name
            assert result["median_ms"] is None, name


def test_harness_measures_its_own_modes_and_derives_the_floor(harness_run):
    _, document = harness_run
    modes = document["launches"][0]["runs"][0]["modes"]
    for name in HARNESS_OWN_MODES:
        assert modes[name]["status"] == "ok", f"{name}: {modes[name]['reason']}"
    floor = modes["floor"]
    assert floor["median_ms"] == max(modes["compute_only"]["median_ms"],
                                     modes["comm_only"]["median_ms"])
    assert floor["efficiency"] == 1.0
    assert floor["steady_median_ms"] == max(modes["compute_only"]["steady_median_ms"],
                                            modes["comm_only"]["steady_median_ms"])
    assert floor["steady_efficiency"] == 1.0
    ddp = modes["ddp_default"]
    assert ddp["efficiency"] == pytest.approx(floor["median_ms"] / ddp["median_ms"])
    assert modes["comm_only"]["buckets"] == len(modes["comm_only"]["bucket_bytes"]) >= 1
    assert is_number(modes["compute_only"]["throughput"])


def test_harness_notes_that_the_data_parallel_modes_send_whole_layer_groups(harness_run):
    # The default config sets no partition size: `none` does not cut its groups, and rs_ag
    # never does; the table says so instead of the unused partition size. Neither runs
    # under a window by default.
    proc, document = harness_run
    modes = document["launches"][0]["runs"][0]["modes"]
    assert modes["commsched_dp"]["commsched_config"]["credit_bytes"] == 0
    labels = {m.name: m.label for m in harness.MODES}
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for name in ("commsched_dp", "commsched_dp_zero"):
        assert modes[name]["whole_groups"] is True, name
        [row] = [r for r in rows if f"| {labels[name]} |" in r]
        assert "whole layer groups" in row and "partition " not in row, row
    # no window by default: the plan orders the groups
    assert modes["commsched_dp"]["credit_window_bytes"] == 0
    assert modes["commsched_dp_zero"]["credit_window_bytes"] == 0


def test_harness_removes_the_temporary_telemetry_of_its_modes(harness_run, harness_tmpdir):
    proc, document = harness_run
    assert proc.returncode == 0, explain(proc)
    modes = document["launches"][0]["runs"][0]["modes"]
    recorded = ("ddp_commsched_telemetry", AUTOTUNE)
    assert all(modes[name]["status"] == "ok" for name in recorded), explain(proc)
    assert sorted(p.name for p in harness_tmpdir.glob("commsched-bench-*")) == []


def test_harness_autotune_mode_is_timed_after_the_tuner_judged(harness_run):
    _, document = harness_run
    result = document["launches"][0]["runs"][0]["modes"][AUTOTUNE]
    assert result["status"] == "ok", result["reason"]
    events = [entry["event"] for entry in result["tuning_log"]]
    assert set(events) & {"keep", "revert", "unchanged", "failed"}, events
    assert 1 <= result["settle_steps"] <= 120
    assert set(result["tuned"]) == {"partition_bytes", "credit_bytes", "decompose"}


@pytest.fixture(scope="module")
def harness_options_run(tmp_path_factory):
    """World size 3, two interleaved rounds, a two-point sweep and a two-point sweep of the
    data-parallel mode, telemetry kept, a profiled window per mode with Python stacks
    (BENCH_PROFILE, BENCH_PROFILE_STACKS), CPU per thread (BENCH_THREADS)."""
    tmp = tmp_path_factory.mktemp("bench_options")
    out, root, traces = tmp / "harness.json", tmp / "telemetry", tmp / "traces"
    proc = run_script("harness.py", ["--model", "gpt", "--quick", "--cpu", "--warmup", "1",
                                     "--iters", str(ITERS), "--world-size", "3",
                                     "--rounds", "2", "--modes",
                                     "compute_only,comm_only,comm_only_bf16,"
                                     "commsched_dp@groups_in_flight=2@first_group_bytes=4KiB",
                                     "--sweep", "64K/256K,0/0",
                                     "--dp-sweep", "64K/256K,0/0,0/0/0",
                                     "--set", "timeout_s=600",
                                     "--telemetry-root", str(root),
                                     "--timeout", "200", "--out", str(out)], timeout=240,
                      env={"BENCH_PROFILE": str(traces), "BENCH_PROFILE_STACKS": "1",
                           "BENCH_THREADS": "1"})
    document = json.loads(out.read_text()) if out.exists() else None
    return proc, document, root, traces


def test_a_mode_variant_runs_with_its_settings_and_bf16_gets_its_own_floor(
        harness_options_run):
    proc, document, _, _ = harness_options_run
    assert proc.returncode == 0, explain(proc)
    modes = document["launches"][0]["runs"][0]["modes"]
    variant = modes["commsched_dp@groups_in_flight=2@first_group_bytes=4KiB"]
    assert variant["status"] == "ok", variant["reason"]
    config = variant["commsched_config"]
    assert (config["groups_in_flight"], config["first_group_bytes"]) == (2, 4096)
    assert variant["credit_window_bytes"] > 0
    bf16, floor = modes["comm_only_bf16"], modes["floor_bf16"]
    assert bf16["total_bytes"] * 2 == modes["comm_only"]["total_bytes"]
    assert floor["median_ms"] == max(modes["compute_only"]["median_ms"], bf16["median_ms"])
    assert variant["efficiency_bf16"] == pytest.approx(floor["median_ms"] / variant["median_ms"])


def test_harness_options_world_size_rounds_and_sweep(harness_options_run):
    proc, document, root, _ = harness_options_run
    assert proc.returncode == 0, explain(proc)
    assert document["settings"]["world_size"] == 3 and document["settings"]["rounds"] == 2
    [run] = document["launches"][0]["runs"]
    assert run["items_per_step"] == 3 * 2 * 64          # 3 ranks x micro-batch 2 x seq 64
    modes = run["modes"]
    for name in ("compute_only", "sweep_p64K_c256K", "sweep_p0_c0"):
        assert modes[name]["status"] == "ok", modes[name]["reason"]
        assert len(modes[name]["iter_ms"]) == 2 * ITERS, name
        assert len(modes[name]["round_medians_ms"]) == 2, name
        assert len(modes[name]["process_cpu_ms_rounds"]) == 2, name
        # nothing a round started (scheduler, telemetry threads) outlives it
        first, second = modes[name]["live_threads_after"]
        assert first == second, (name, modes[name]["live_threads_after"])
    config = modes["sweep_p64K_c256K"]["commsched_config"]
    assert (config["partition_bytes"], config["credit_bytes"]) == (64 << 10, 256 << 10)
    # --set reaches every commsched mode
    assert {modes[name]["commsched_config"]["timeout_s"] for name in modes
            if "commsched_config" in modes[name]} == {600}
    assert modes["ddp_commsched"]["status"] == "n/a"
    # The second round runs the modes in reverse order.
    rounds = proc.stdout.split("round 2 of 2")
    timed = [[line.split()[3].rstrip(":") for line in part.splitlines()
              if line.startswith("[bench] nvlink gpt ") and "ms/iter" in line
              and not line.startswith("[bench] nvlink gpt floor:")]    # (derived, at the end)
             for part in rounds]
    # compute_only, comm_only, comm_only_bf16, a variant, 2 sweep, 3 dp-sweep
    assert len(timed[0]) == 9, proc.stdout
    assert timed[1] == timed[0][::-1]
    table = proc.stdout[proc.stdout.index("| regime |"):]
    assert "partition 64K, credit 256K" in table and "not selected" not in table
    # One telemetry run directory per sweep point and round, each readable by the report.
    dirs = sorted(p.name for p in root.iterdir())
    assert dirs == ["nvlink_w3_sweep_p0_c0", "nvlink_w3_sweep_p0_c0_r2",
                    "nvlink_w3_sweep_p64K_c256K", "nvlink_w3_sweep_p64K_c256K_r2"]
    report = subprocess.run([sys.executable, "-m", "commsched", "report", "--json",
                             str(root / dirs[2])], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = json.loads(report.stdout)["rows"]
    assert {row["rank"] for row in rows} == {0, 1, 2}
    assert all(row["bytes"] > 0 for row in rows)
    # Each keeps the run's compute only and comm only: the report's efficiency column.
    floor = modes["floor"]
    kept = json.loads((root / dirs[2] / "floor.json").read_text())
    assert kept["source"] == "harness" and kept["floor_ms"] == floor["median_ms"]
    assert all(row["efficiency"] == pytest.approx(floor["median_ms"] / row["iteration_ms"])
               for row in rows if row["iteration_ms"])


def test_harness_dp_sweep_runs_the_data_parallel_mode_at_each_setting(harness_options_run):
    proc, document, _, _ = harness_options_run
    assert proc.returncode == 0, explain(proc)
    assert document["settings"]["dp_sweep"] == [[64 << 10, 256 << 10], [0, 0], [0, 0, 0]]
    modes = document["launches"][0]["runs"][0]["modes"]
    from commsched.config import Config
    default = Config().group_bytes
    for name, setting, whole in (("dpsweep_p64K_c256K", (64 << 10, 256 << 10, default), False),
                                 ("dpsweep_p0_c0", (0, 0, default), True),
                                 ("dpsweep_p0_c0_g0", (0, 0, 0), True)):
        result = modes[name]
        assert result["status"] == "ok", result["reason"]
        assert len(result["round_medians_ms"]) == 2, name
        config = result["commsched_config"]
        assert (config["partition_bytes"], config["credit_bytes"],
                config["group_bytes"]) == setting, name
        # cut under the window set in bytes, whole layer groups under the window of groups
        assert result["whole_groups"] is whole, name
    # The quick GPT fits in one default-size group; one group per module is many more.
    assert modes["dpsweep_p0_c0"]["layer_groups"] == 1
    assert modes["dpsweep_p0_c0_g0"]["layer_groups"] > 10
    table = proc.stdout[proc.stdout.index("| regime |"):]
    assert "6s data-parallel mode, partition 64K, credit 256K" in table
    assert "6s data-parallel mode, partition off, credit unbounded" in table
    assert "6s data-parallel mode, partition off, credit unbounded, groups per module" in table


def test_harness_keeps_each_round_s_cpu_per_thread(harness_options_run):
    proc, document, _, _ = harness_options_run
    assert proc.returncode == 0, explain(proc)
    mode = document["launches"][0]["runs"][0]["modes"]["compute_only"]
    assert len(mode["threads"]) == 2                       # one per round
    for threads in mode["threads"]:
        assert threads["main"]["cpu_ms"] > 0, threads      # the training loop's thread
    assert "[bench] rank 0 compute_only threads per step" in proc.stdout


def test_harness_profile_writes_a_trace_per_mode_rank_and_round(harness_options_run):
    proc, _, _, traces = harness_options_run
    assert proc.returncode == 0, explain(proc)
    expected = {f"nvlink_{mode}_rank{rank}{suffix}.json.gz"
                for mode in ("compute_only", "comm_only", "comm_only_bf16",
                             "commsched_dp.groups_in_flight-2.first_group_bytes-4KiB",
                             "sweep_p64K_c256K", "sweep_p0_c0",
                             "dpsweep_p64K_c256K", "dpsweep_p0_c0", "dpsweep_p0_c0_g0")
                for rank in range(3) for suffix in ("", "_r2")}
    assert {p.name for p in traces.iterdir()} == expected
    with gzip.open(traces / "nvlink_sweep_p64K_c256K_rank1.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    # A CPU trace of a window of training steps: the model's operators are in it.
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert {"aten::linear", "aten::embedding"} <= names, sorted(names)[:40]
    # With Python stacks: the training step's own frames, which trace_overlap.py --python
    # ranks by self time on the training thread.
    python = [e["name"] for e in events if e.get("cat") == "python_function"]
    assert any(name.endswith(": step") and "harness.py" in name for name in python), python[:20]
    sys.path.insert(0, str(BENCH))
    import trace_overlap
    [thread] = [t for t in trace_overlap.python_self_time(
        [e for e in events if e.get("ph") == "X"], iters=1, top=100000)
        if any("harness.py" in name for name, _, _ in t["top"])]
    assert thread["ms"] > 0 and all(ms >= 0 for _, ms, _ in thread["top"]), thread


def test_dp_nccl_options_adds_its_modes_to_the_harness_and_says_na_without_nccl(tmp_path):
    """examples/bench/dp_nccl_options.py: the harness with data-parallel modes whose own
    process groups take NCCL options; in the spawned workers too (the modes ran there),
    reported n/a with the reason on gloo, the harness's own mode measured beside them."""
    out = tmp_path / "options.json"
    proc = run_script("dp_nccl_options.py",
                      ["--quick", "--cpu", "--model", "gpt", "--regime", "host", "--iters",
                       str(ITERS), "--modes", "compute_only,commsched_dp_cta2,commsched_dp_hp",
                       "--out", str(out), "--timeout", "150"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    modes = json.loads(out.read_text())["launches"][0]["runs"][0]["modes"]
    assert modes["compute_only"]["status"] == "ok"
    for name in ("commsched_dp_cta2", "commsched_dp_hp"):
        assert modes[name]["status"] == "n/a", modes[name]
        assert modes[name]["reason"] == "NCCL process-group options (needs GPUs)"
    assert modes["commsched_dp_cta1"]["reason"] == harness.NOT_SELECTED
    table = proc.stdout[proc.stdout.index("| regime |"):]
    assert "| 6 as 6, NCCL max_ctas 2 on its own groups |" in table


def test_harness_rejects_bad_options_naming_the_flag():
    for args, flag in ((["--world-size", "0"], "--world-size"), (["--rounds", "0"], "--rounds"),
                       (["--sweep", "4M"], "--sweep"), (["--sweep", "4X/1M"], "--sweep"),
                       (["--dp-sweep", "4M/1M,4M/1M"], "--dp-sweep"),
                       (["--dp-sweep", "1M"], "--dp-sweep"),
                       (["--dp-sweep", "1M/2M/3M/4M/5M"], "--dp-sweep"),
                       (["--set", "no_such_field=1"], "--set"),
                       (["--set", "partition_bytes=4X"], "--set"),
                       (["--modes", "commsched_dp@plan_forward=2"], "--modes")):
        proc = run_script("harness.py", ["--cpu", *args], timeout=60)
        assert proc.returncode == 2 and flag in proc.stderr, (args, proc.stderr[-500:])


def test_world_size_1_trains_every_mode_as_the_plain_loop_does(tmp_path):
    """One rank: the same code paths as at two (every collective still issued), so DDP's
    and the data-parallel modes' losses equal the plain loop's step by step (gloo divides
    by one and sums alone); beyond_plain.py tables them against plain, its table last."""
    out = tmp_path / "one.json"
    proc = run_script("harness.py", ["--model", "gpt", "--quick", "--cpu", "--world-size", "1",
                                     "--warmup", "1", "--iters", "2", "--timeout", "200",
                                     "--modes", "plain,ddp_default,commsched_dp,commsched_dp_zero",
                                     "--out", str(out)],
                      timeout=240, env={"BENCH_LOSSES": "1"})
    assert proc.returncode == 0, explain(proc)
    modes = json.loads(out.read_text())["launches"][0]["runs"][0]["modes"]
    plain = modes["plain"]["losses"]
    assert len(plain) == 1 and len(plain[0]) == 3           # one round, 1 + 2 steps
    for name in ("ddp_default", "commsched_dp", "commsched_dp_zero"):
        assert modes[name]["losses"] == plain, name
    table = run_script("beyond_plain.py", [str(out)], timeout=60)
    assert table.returncode == 0, explain(table)
    rows = [line for line in table.stdout.splitlines() if line.startswith("| gpt |")]
    assert [row.split(" | ")[1] for row in rows] == [
        "plain", "ddp_default", "commsched_dp", "commsched_dp_zero"]
    assert all(row.rstrip(" |").endswith(" 0") for row in rows[1:]), rows   # loss - DDP's
    assert last_line(table.stdout) == rows[-1]


def test_merge_round_pools_samples_and_keeps_the_largest_peak():
    a = {"status": "ok", "iter_ms": [1.0, 3.0], "median_ms": 2.0, "peak_mem_bytes": 5,
         "peak_mem_bytes_max_rank": 6, "throughput": 10.0}
    a.update(harness.summarize_ms(a["iter_ms"]))
    b = {"status": "ok", "iter_ms": [5.0, 7.0], "peak_mem_bytes": 9,
         "peak_mem_bytes_max_rank": 4, "throughput": 4.0}
    b.update(harness.summarize_ms(b["iter_ms"]))
    a["steady_ms"], b["steady_ms"] = [1.5, 2.5], [6.0]
    merged = harness.merge_round(harness.merge_round(None, a), b)
    assert merged["iter_ms"] == [1.0, 3.0, 5.0, 7.0]
    assert merged["steady_ms"] == [1.5, 2.5, 6.0] and merged["steady_median_ms"] == 2.5
    assert merged["median_ms"] == 4.0 and merged["round_medians_ms"] == [2.0, 6.0]
    assert (merged["peak_mem_bytes"], merged["peak_mem_bytes_max_rank"]) == (9, 6)
    failed = {"status": "error", "reason": "x"}
    assert harness.merge_round(merged, failed) is failed


def test_step_marks_keep_the_intervals_between_interior_step_starts(monkeypatch):
    # Steps 0..4 start at these host times (s): the intervals kept are those of steps 1-3.
    starts = iter([0.0, 0.010, 0.030, 0.060, 0.100])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(starts))
    marks = harness.StepMarks(5, cuda=False)
    for k in range(5):
        marks.mark(k)
    marks.end_window()
    assert marks.intervals_ms == pytest.approx([20.0, 30.0, 40.0])
    # A window of two steps has no interior step.
    starts = iter([0.0, 0.010])
    marks = harness.StepMarks(2, cuda=False)
    for k in range(2):
        marks.mark(k)
    marks.end_window()
    assert marks.intervals_ms == []


def test_the_scripts_read_byte_counts_as_the_settings_do():
    from commsched.config import parse_bytes
    assert harness.parse_bytes is parse_bytes
    assert harness._parse_pair("4M/512KiB") == (4 << 20, 512 << 10)
    assert [harness.parse_bytes(t, "x") for t in ("0", "65536", "512K", "4M", "1G", "4MB")] \
        == [0, 65536, 512 << 10, 4 << 20, 1 << 30, 4 << 20]
    with pytest.raises(ValueError):
        harness._parse_pair("4X/1M")


# --- micro-benchmark ----------------------------------------------------------------------

def test_microbench_exits_cleanly_and_prints_the_table_last(microbench_run):
    proc, document = microbench_run
    assert proc.returncode == 0, explain(proc)
    assert document is not None and document["status"] == "ok", explain(proc)
    assert last_line(proc.stdout).startswith("| "), explain(proc)


def test_microbench_json_has_every_variant_with_a_number_or_a_reason(microbench_run):
    _, document = microbench_run
    assert document["schema"] == "commsched.bench.microbench/1"
    submit = document["submit_overhead"]
    assert submit["chunk_bytes"] == 1024 and submit["target_added_us"] == 20.0
    assert {(r["variant"], r["group"]) for r in submit["rows"]} == {
        (v, g) for v in ("direct", "commsched_off", "commsched_default",
                         "commsched_partitioned")
        for g in ("own", "pair")}
    for row in submit["rows"]:
        assert row["status"] in ("ok", "n/a"), f"{row['name']}: {row['reason']}"
        if row["status"] == "ok":
            assert is_number(row["wall_us_per_chunk"]) and is_number(row["cpu_us_per_chunk"])
            assert is_number(row["added_wall_us_per_chunk"])
        else:
            assert row["reason"].strip()
    rows = document["ddp_mlp"]["rows"]
    assert [r["name"] for r in rows] == ["ddp", "ddp_commsched_off", "ddp_commsched_default"]
    assert rows[0]["status"] == "ok" and rows[0]["ratio_to_ddp"] == 1.0
    for row in rows:
        assert row["status"] in ("ok", "n/a"), f"{row['name']}: {row['reason']}"
        if row["status"] == "ok":
            assert is_number(row["median_ms"]) and len(row["iter_ms"]) == 2
        else:
            assert row["reason"].strip()
    hook = document["hook_overhead"]
    assert [r["name"] for r in hook["rows"]] == ["allreduce_hook", "commsched_hook", "builtin"]
    assert all(r["status"] == "ok" and is_number(r["us_per_step"]) for r in hook["rows"])
    steps = {r["name"]: r["us_per_step"] for r in hook["rows"]}
    # each added cost is the step-time difference spread over the buckets
    assert hook["buckets"] >= 1
    assert hook["added_us_per_bucket"] == pytest.approx(
        (steps["commsched_hook"] - steps["allreduce_hook"]) / hook["buckets"])
    assert hook["added_over_builtin_us_per_bucket"] == pytest.approx(
        (steps["commsched_hook"] - steps["builtin"]) / hook["buckets"])


# --- pieces the numbers depend on ---------------------------------------------------------

def test_full_size_models_have_the_published_parameter_counts():
    with torch.device("meta"):
        gpt = models.count_parameters(models.GPT(models.GPTConfig()))
        vgg = models.count_parameters(models.vgg16())
        resnet = models.count_parameters(models.resnet50())
    assert gpt == 405_762_048      # 24x1024 decoder, vocab 50257, untied head (~405M)
    assert vgg == 138_357_544      # VGG-16, 1000 classes
    assert resnet == 25_557_032    # ResNet-50, 1000 classes


def test_bucket_estimate_closes_a_bucket_once_it_reaches_its_cap():
    mib = 1 << 20
    sizes = [3 * mib, 10 * mib, 10 * mib, 10 * mib, 2 * mib]
    assert harness.assign_buckets(sizes, mib, 25 * mib) == [3 * mib, 30 * mib, 2 * mib]
    assert harness.assign_buckets([], mib, 25 * mib) == []


@pytest.mark.parametrize("regime, expected", [
    ("nvlink", {"NCCL_P2P_DISABLE": None, "NCCL_SHM_DISABLE": None}),
    ("host", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": None}),
    ("sockets", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
])
def test_regime_environment_overrides_the_shell_and_keeps_nvls_off(monkeypatch, regime,
                                                                    expected):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    harness.apply_regime_env(regime)
    for name, value in {**expected, "NCCL_NVLS_ENABLE": "0"}.items():
        assert os.environ.get(name) == value, name


def _wait_forever(rank):
    time.sleep(600)


def test_a_hung_launch_prints_each_workers_stacks_before_it_is_terminated(capfd):
    """A group still running at its timeout is terminated; each worker first dumps where
    its threads were (faulthandler on benchlib.DUMP_SIGNAL), as a hung collective needs."""
    import benchlib

    if benchlib.DUMP_SIGNAL is None:
        pytest.skip("no SIGUSR1 on this platform")
    outcome = benchlib.launch(_wait_forever, (), nprocs=2, timeout_s=5)
    assert not outcome.ok and outcome.error.startswith("timed out after 5 s"), outcome
    err = capfd.readouterr().err
    assert err.count("in _wait_forever") == 2, err
    # one rank's header, then its stack, then the next rank's: not interleaved
    first, second = err.index("rank 0 (pid"), err.index("rank 1 (pid")
    assert first < err.index("in _wait_forever") < second < err.rindex("in _wait_forever"), err


def test_the_table_gives_each_training_mode_its_ratio_to_ddp_and_the_process_cpu():
    """x DDP: the ratio of medians to DDP default in the same run, for training modes only
    (not compute only, comm only or the floor); CPU ms/iter: rank 0's process CPU."""
    by_name = {mode.name: mode for mode in harness.MODES}
    modes = {}
    for name, median, cpu in (("compute_only", 80.0, 50.0), ("comm_only", 10.0, 3.0),
                              ("ddp_default", 100.0, 70.0), ("ddp_commsched", 97.0, 72.5)):
        result = harness.empty_result(by_name[name], "ok", None)
        result.update(median_ms=median, p10_ms=median - 1, p90_ms=median + 1,
                      cpu_ms_per_iter={"process": cpu, "training_thread": cpu / 2})
        if name == "comm_only":
            result.update(total_bytes=1 << 20, buckets=1, bucket_source="DDP")
        # (a launch cut by its --timeout in the second round: DDP got one round)
        result["round_medians_ms"] = [median] * (1 if name == "ddp_default" else 2)
        modes[name] = result
    run = harness.finish_run({"regime": "host", "model": "gpt", "modes": modes,
                              "items_per_step": 1024, "unit": "tokens"},
                             [by_name[n] for n in (*modes, "floor")])
    table = harness.results_table({"settings": {"rounds": 2}, "launches": [{"runs": [run]}]})
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    rows = {cells[2]: cells for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:])}
    x_ddp, cpu = header.index("x DDP"), header.index("CPU ms/iter")
    assert rows[by_name["ddp_commsched"].label][x_ddp] == "0.970"
    assert rows[by_name["ddp_default"].label][x_ddp] == "1.000"
    assert rows[by_name["compute_only"].label][x_ddp] == ""
    assert rows[by_name["floor"].label][x_ddp] == ""
    efficiency = header.index("efficiency")
    assert rows[by_name["ddp_default"].label][efficiency] == "0.800"     # 80 / 100
    assert rows[by_name["ddp_commsched"].label][cpu] == "72.5"
    note = header.index("note")
    assert rows[by_name["ddp_default"].label][note] == "1 of 2 rounds"
    assert rows[by_name["ddp_commsched"].label][note] == ""
    assert rows[by_name["comm_only"].label][note] == "1 buckets, 1.00 MiB (DDP)"
