"""The bus-bandwidth benchmark (examples/bench/busbw.py) on CPU with gloo.

The script runs end to end as a subprocess at world size 2 (each rank its own node) and 4
(two nodes of two), every variant, tiny sizes, with telemetry on: it must exit 0, report no
wrong element, write a JSON row for every (variant, size), and leave telemetry directories
that ``commsched report`` reads with one lane iteration per operation. Timings are not
checked (CPU timings are noise).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "examples" / "bench"
sys.path.insert(0, str(BENCH))

import busbw  # noqa: E402

SIZES = [128, 512, 2048, 8192]           # --min-bytes 128 --max-bytes 8K --factor 4
PLAIN = ["nccl", "nccl_async", "pg", "pg_sync", "pg_sync_deep"]
SCHEDULED = ["none", "none_sync", "rs_ag", "hier", "leader", "auto"]   # commsched's
VARIANTS = PLAIN + SCHEDULED
WARMUP, ITERS = 1, 2
ROW_KEYS = ("variant", "size", "count", "type", "redop", "time_us", "algbw_gbps",
            "busbw_gbps", "wrong", "lane_iterations")


def explain(proc: subprocess.CompletedProcess) -> str:
    return (f"exit status {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr (tail) ---\n{proc.stderr[-5000:]}")


def is_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["w2_local1", "w4_local2"])
def run(request, tmp_path_factory):
    world, local = request.param
    tmp = tmp_path_factory.mktemp(f"busbw_w{world}")
    out, telemetry = tmp / "busbw.json", tmp / "telemetry"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "busbw.py"), "--world-size", str(world),
         "--local-size", str(local), "--min-bytes", "128", "--max-bytes", "8K",
         "--warmup", str(WARMUP), "--iters", str(ITERS), "--variants", ",".join(VARIANTS),
         "--cpu", "--telemetry-root", str(telemetry), "--timeout", "100", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    document = json.loads(out.read_text()) if out.exists() else None
    return world, local, proc, document, telemetry


def test_exits_cleanly_and_prints_the_summary_table_last(run):
    _, _, proc, document, _ = run
    assert proc.returncode == 0, explain(proc)
    assert document is not None and document["status"] == "ok", explain(proc)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("| avg |"), explain(proc)
    for name in VARIANTS:
        assert f"### {name}: " in proc.stdout
        assert f"[busbw] nvlink w{document['settings']['world_size']} {name}: " in proc.stdout


def test_json_describes_the_run(run):
    world, local, _, document, _ = run
    assert document["schema"] == "commsched.bench.busbw/1"
    settings = document["settings"]
    assert (settings["world_size"], settings["local_size"]) == (world, local)
    assert settings["nodes"] == world // local
    assert settings["regime"] == "nvlink" and settings["backend"] == "gloo"
    assert settings["sizes"] == SIZES and settings["variants"] == VARIANTS
    assert document["env"]["NCCL_NVLS_ENABLE"] == "0"
    for key in ("torch", "cpu_count", "gpu_name"):
        assert key in document["system"]
    for name in PLAIN:
        assert document["variants"][name]["config"] is None
    for name in SCHEDULED:
        config = document["variants"][name]["config"]
        assert config["decompose"] == busbw.SYNC_OF.get(name, name)
        assert config["partition_bytes"] == 0
        assert config["credit_bytes"] == 0 and config["local_size"] == local


def test_every_variant_and_size_has_a_right_result(run):
    world, local, _, document, _ = run
    rows = {(r["variant"], r["size"]): r for r in document["rows"]}
    assert set(rows) == {(v, s) for v in VARIANTS for s in SIZES}
    assert len(document["rows"]) == len(rows)
    for (variant, size), row in rows.items():
        assert set(ROW_KEYS) <= set(row), (variant, size)
        assert row["wrong"] == 0, (variant, size)
        assert row["count"] == size // 4 and row["type"] == "float" and row["redop"] == "sum"
        assert is_positive(row["time_us"]) and is_positive(row["algbw_gbps"])
        assert row["algbw_gbps"] == pytest.approx(size / (row["time_us"] * 1e3))
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (world - 1) / world)
        assert row["nvlink_tx_bytes_per_op"] is None        # CPU: no NVML counters
        if variant in PLAIN:
            assert row["ran"] is None and row["lane_iterations"] is None
        elif variant == "auto":
            # One node: nothing to choose; several: one of the measured candidates.
            assert row["ran"] in (("none",) if world == local else ("none", "hier", "leader"))
        else:
            assert row["ran"] == busbw.SYNC_OF.get(variant, variant)


def test_telemetry_has_one_lane_iteration_per_call(run):
    world, _, _, document, telemetry = run
    from commsched.telemetry.report import build_report

    assert WARMUP > 0
    per_size = 3                                      # warm-up, timed, correctness check
    for name in PLAIN:
        assert not (telemetry / f"nvlink_{name}_w{world}").exists()
    for name in SCHEDULED:
        run_dir = telemetry / f"nvlink_{name}_w{world}"
        assert document["variants"][name]["telemetry_dir"] == str(run_dir)
        report = build_report(str(run_dir))
        assert sorted(r["rank"] for r in report["runs"]) == list(range(world))
        rows = [r for r in report["rows"] if r["rank"] == 0]
        assert [r["iteration"] for r in rows] == list(range(per_size * len(SIZES))), name
        assert all(r["complete"] for r in rows), name
        timed = [r["lane_iterations"] for r in document["rows"] if r["variant"] == name]
        assert timed == [[per_size * i + 1, per_size * i + 2] for i in range(len(SIZES))]
        for (first, _), size in zip(timed, SIZES):
            # The timed iteration holds --iters operations of the size; the others one
            # (check) or --warmup.
            assert rows[first]["bytes"] == size * ITERS, (name, size)
            assert rows[first + 1]["bytes"] == size, (name, size)
            assert rows[first - 1]["bytes"] == size * WARMUP, (name, size)


# --- arguments ----------------------------------------------------------------------------

def test_sizes_read_like_nccl_tests_and_grow_by_the_factor():
    assert [busbw.parse_size(t) for t in ("128", "64K", "32M", "1G", "4MiB")] == [
        128, 64 << 10, 32 << 20, 1 << 30, 4 << 20]
    assert busbw.message_sizes(128, 64 << 10, 4) == [128, 512, 2048, 8192, 32768]
    assert busbw.message_sizes(8, 8, 2) == [8]


@pytest.mark.parametrize("argv, flag", [
    (["--world-size", "4", "--local-size", "3"], "--local-size"),
    (["--world-size", "2", "--min-bytes", "6"], "--min-bytes"),
    (["--world-size", "2", "--min-bytes", "1K", "--max-bytes", "512"], "--max-bytes"),
    (["--world-size", "2", "--factor", "1"], "--factor"),
    (["--world-size", "2", "--variants", "nccl,ring"], "--variants"),
    (["--world-size", "2", "--max-bytes", "32XB"], "--max-bytes"),
    (["--world-size", "2", "--rounds", "0"], "--rounds"),
    (["--world-size", "2", "--rounds", "2", "--telemetry-root", "t"], "--rounds"),
])
def test_bad_arguments_are_reported_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        busbw.parse_args(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def small_run(tmp_path, *flags):
    """busbw.py on CPU, 2 ranks, nccl and none at 128 and 512 B, with ``flags``."""
    out = tmp_path / "busbw.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "busbw.py"), "--world-size", "2", "--min-bytes", "128",
         "--max-bytes", "512", "--warmup", "1", "--iters", "2", *flags,
         "--variants", "nccl,none", "--cpu", "--timeout", "100", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, explain(proc)
    return proc, json.loads(out.read_text())


def test_repeats_time_several_windows_and_keep_the_median(tmp_path):
    _, document = small_run(tmp_path, "--repeats", "3")
    assert document["settings"]["repeats"] == 3
    for row in document["rows"]:
        windows = row["time_us_windows_rank0"]
        assert len(windows) == 3 and all(is_positive(w) for w in windows), row
        assert row["wrong"] == 0


def test_rounds_alternate_the_variant_order_and_keep_the_median(tmp_path):
    proc, document = small_run(tmp_path, "--rounds", "3")
    progress = [line.split(":")[0].split()[-3:] for line in proc.stdout.splitlines()
                if line.startswith("[busbw] nvlink w2 ")]
    assert progress == [["nccl", "(round", "1/3)"], ["none", "(round", "1/3)"],
                        ["none", "(round", "2/3)"], ["nccl", "(round", "2/3)"],
                        ["nccl", "(round", "3/3)"], ["none", "(round", "3/3)"]]
    assert document["settings"]["rounds"] == 3
    assert len(document["rows"]) == 2 * 2                  # 2 variants x sizes 128, 512
    for row in document["rows"]:
        rounds = row["time_us_rounds"]
        assert len(rounds) == 3 and all(is_positive(t) for t in rounds), row
        assert row["time_us"] == sorted(rounds)[1]
        assert row["algbw_gbps"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])     # 2(n-1)/n = 1
        assert row["wrong"] == 0


def test_merge_round_takes_the_median_and_adds_up_wrong_elements():
    def sweep(time_us, wrong):
        return {"wall_s": 1.0, "rows": [{
            "size": 1000, "time_us": time_us, "time_us_max_rank": time_us + 1,
            "algbw_gbps": 1000 / time_us / 1e3, "busbw_gbps": 1.5 * 1000 / time_us / 1e3,
            "wrong": wrong}]}
    merged = None
    for time_us, wrong in ((10.0, 0), (30.0, 2), (20.0, 1)):
        merged = busbw.merge_round(merged, sweep(time_us, wrong))
    row = merged["rows"][0]
    assert merged["rounds"] == 3 and merged["wall_s"] == 3.0
    assert row["time_us_rounds"] == [10.0, 30.0, 20.0] and row["time_us"] == 20.0
    assert row["time_us_max_rank"] == 21.0 and row["wrong"] == 3
    assert row["algbw_gbps"] == pytest.approx(0.05)
    assert row["busbw_gbps"] == pytest.approx(0.075)


def test_pg_sync_deep_calls_the_process_group_from_deeper_in_the_stack(monkeypatch):
    import inspect
    import types

    depths = []

    class Group:
        def allreduce(self, tensors, options):
            depths.append((len(inspect.stack(0)), options.asyncOp))

    fake = types.SimpleNamespace(AllreduceOptions=busbw.dist.AllreduceOptions,
                                 group=types.SimpleNamespace(WORLD=Group()))
    monkeypatch.setattr(busbw, "dist", fake)
    tensor = busbw.torch.zeros(4)
    busbw.PLAIN_OPS["pg_sync"]()(tensor)
    busbw.PLAIN_OPS["pg_sync_deep"]()(tensor)
    (shallow, shallow_async), (deep, deep_async) = depths
    assert deep - shallow == busbw.DEEP_FRAMES == 4
    assert shallow_async is False and deep_async is False
