"""``commsched floor``: its arithmetic on recorded timings, and the command on an unmodified
DDP script (2 gloo ranks under torchrun)."""

import json
import os
import subprocess
import sys

import pytest

from commsched import floor
from commsched.floor import floor_efficiency, load_floor, save_floor, summarize

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "scripts", "train_ddp_floor.py")
ITERS, WARMUP = 4, 2


def test_floor_is_the_larger_of_compute_and_comm_and_efficiency_is_floor_over_the_step():
    f = floor_efficiency(133.1, 126.3, 162.7)
    assert f["floor_ms"] == 133.1 and f["limited_by"] == "compute_only"
    assert f["efficiency"] == pytest.approx(133.1 / 162.7)
    f = floor_efficiency(60.0, 126.3, 190.1)
    assert f["floor_ms"] == 126.3 and f["limited_by"] == "comm_only"
    assert f["efficiency"] == pytest.approx(126.3 / 190.1)
    assert floor_efficiency(10.0, 5.0)["efficiency"] is None


def rank_result(ms, collectives, backwards, **extra):
    return {"ms_per_iteration": ms, "collectives": collectives, "backwards": backwards,
            **extra}


def test_the_result_takes_each_launch_at_its_slowest_rank():
    layout = [{"bytes": 1 << 20, "dtype": "float32"}]
    per_mode = {
        "compute": [rank_result(80.0, 0, ITERS, layout=layout, backend="nccl"),
                    rank_result(84.0, 0, ITERS, layout=layout, backend="nccl")],
        "comm": [rank_result(30.0, 2 * ITERS, 0), rank_result(31.0, 2 * ITERS, 0)],
        "hook": [rank_result(100.0, 2 * ITERS, ITERS), rank_result(105.0, 2 * ITERS, ITERS)],
    }
    r = summarize(per_mode, {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert (r["compute_only_ms"], r["comm_only_ms"], r["hook_ms"]) == (84.0, 31.0, 105.0)
    assert r["floor_ms"] == 84.0 and r["limited_by"] == "compute_only"
    assert r["efficiency"] == pytest.approx(0.8)
    assert r["collectives"] == {"compute": 0, "comm": 8, "hook": 8}
    assert r["backwards"] == {"compute": ITERS, "comm": 0, "hook": ITERS}
    assert "80% efficient" in r["verdict"] and "21.00 ms per iteration" in r["verdict"]
    text = floor.format_result(r)
    assert "floor              84.00" in text and "efficiency         80.0%" in text


def window(span, kernels, exposed=0.0, tail=0.0, host=0.0, collectives=None):
    """A profiled window's figures (step_split.window_figures), ms per iteration."""
    return {"span_ms": span, "exposed_ms": exposed, "tail_ms": tail, "tail_note": None,
            "host_late_ms": host, "kernels": kernels, "collectives": collectives or {}}


def test_the_split_is_the_slowest_hook_ranks_windows_against_compute_only():
    from commsched.telemetry.step_split import both_at_once, split

    layout = [{"bytes": 1 << 20, "dtype": "float32"}]
    compute = [window(80.0, {"gemm": [10, 70.0]}), window(82.0, {"gemm": [10, 71.0]})]
    hook = [window(100.0, {"gemm": [10, 74.0], "copy": [2, 3.0]}, exposed=12.0, tail=5.0),
            window(105.0, {"gemm": [10, 75.0], "copy": [2, 3.0]}, exposed=15.0, tail=6.0,
                   host=1.0)]
    comm = [window(30.0, {}, collectives={"nccl": [2, 28.0]})] * 2
    both = [window(90.0, {"gemm": [10, 77.0]}, collectives={"nccl": [2, 30.0]})] * 2
    per_mode = {
        "compute": [rank_result(80.0, 0, ITERS, rank=r, window=compute[r], layout=layout,
                                backend="nccl") for r in (0, 1)],
        "comm": [rank_result(30.0, 8, 0, rank=r, window=comm[r]) for r in (0, 1)],
        "both": [rank_result(90.0, 8, ITERS, rank=r, window=both[r]) for r in (0, 1)],
        "hook": [rank_result(100.0, 8, ITERS, rank=0, window=hook[0]),
                 rank_result(105.0, 8, ITERS, rank=1, window=hook[1])],
    }
    r = summarize(per_mode, {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert r["split_rank"] == 1 and r["both_ms"] == 90.0
    # the split is of the timed step: 105 - 80 = 25 above compute only (the windows say
    # 105 - 82 = 23): 15 exposed (6 the tail), 4 slowed, 3 own work, 1 host from the
    # windows, 2 rest, the remainder
    expected = split(hook[1], compute[1], timed_above_ms=25.0)
    assert {k: r["split"][k] for k in expected} == expected
    assert (r["split"]["above_ms"], r["split"]["window_above_ms"], r["split"]["exposed_ms"],
            r["split"]["tail_ms"], r["split"]["slowed_ms"], r["split"]["own_ms"],
            r["split"]["host_ms"], r["split"]["rest_ms"]) == pytest.approx(
        (25.0, 23.0, 15.0, 6.0, 4.0, 3.0, 1.0, 2.0))
    assert r["both_at_once"] == both_at_once(both[1], compute[1], comm[1])
    assert r["both_at_once"]["not_measured"] is None
    assert r["both_at_once"]["compute_slowed_ms"] == pytest.approx(6.0)
    assert r["both_at_once"]["comm_slowed"] == pytest.approx(2 / 28)
    text = floor.format_result(r)
    assert "both at once       90.00" in text
    assert "compute kernels +6.00 ms (+8.5%), collectives +2.00 ms (+7.1%)" in text
    assert "  exposed            15.00" in text and "    tail              6.00" in text
    assert "  own work, largest: +3.00 copy" in text
    assert ("the hook's step above compute only, by cause: 25.00 ms per iteration (timed); "
            "device parts from the profiled windows (rank 1: 105.00 - 82.00 = 23.00 there), "
            "host read under the profiler, rest the remainder") in text
    # the verdict, last, bounds what an order can win by the split of the timed step
    assert text.splitlines()[-1] == (
        "verdict: 76% efficient: any communication scheduler could win at most 25.00 ms per "
        "iteration (24% of the step); of 25.0 ms above compute: 15.0 exposed (6.0 of them "
        "the tail), 4.0 compute slowed beside communication, 3.0 own device work, 1.0 host "
        "under the profiler, 2.0 rest; a better order can win at most the 9.0 ms of "
        "exposed communication outside the tail")


def test_without_windows_every_part_is_not_measured_with_the_reason():
    reason = "not measured: no CUDA timing on this device"
    layout = [{"bytes": 1 << 20, "dtype": "float32"}]
    per_mode = {m: [rank_result(ms, 0, ITERS, window=None, window_not_measured=reason,
                                layout=layout, backend="gloo")]
                for m, ms in (("compute", 10.0), ("comm", 5.0), ("both", 14.0),
                              ("hook", 16.0))}
    r = summarize(per_mode, {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert all(r["split"][k] is None for k in ("exposed_ms", "tail_ms", "slowed_ms",
                                               "own_ms", "host_ms", "rest_ms"))
    assert set(r["split"]["not_measured"].values()) == {reason}
    assert r["split"]["above_ms"] == pytest.approx(6.0)
    assert r["split"]["window_above_ms"] is None
    assert r["both_at_once"]["compute_slowed_ms"] is None
    assert r["both_at_once"]["not_measured"] == reason
    text = floor.format_result(r)
    assert ("the hook's step above compute only, by cause: 6.00 ms per iteration (timed); "
            f"its parts {reason}") in text
    assert "compute kernels not measured, collectives not measured" in text


def one_rank_launches(**windows):
    """One rank's four launches (compute 80, comm 5, both 82, hook 85 ms), each with the
    window given (or none, with the reason given)."""
    layout = [{"bytes": 1 << 20, "dtype": "float32"}]
    out = {}
    for mode, ms in (("compute", 80.0), ("comm", 5.0), ("both", 82.0), ("hook", 85.0)):
        w, why = windows.get(mode, (None, f"not measured: {mode} had none"))
        out[mode] = [rank_result(ms, 0, ITERS, rank=0, window=w, window_not_measured=why,
                                 layout=layout, backend="nccl")]
    return out


def test_a_comm_only_window_that_ran_nothing_gives_that_reason_for_the_collectives():
    """At world size 1 an in-place sum runs no NCCL kernel: the comm only window was
    recorded and held no device activity, and the both-at-once line says so."""
    from commsched import floor_worker
    from commsched.telemetry.window import NO_DEVICE_ACTIVITY

    reason = floor_worker._comm_window_reason(NO_DEVICE_ACTIVITY, "nccl", 1)
    compute = window(80.0, {"gemm": [10, 70.0]})
    both = window(82.0, {"gemm": [10, 71.0]})
    per_mode = one_rank_launches(compute=(compute, None), both=(both, None),
                                 hook=(window(85.0, {"gemm": [10, 70.0]}), None),
                                 comm=(None, reason))
    r = summarize(per_mode, {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert r["both_at_once"]["compute_slowed_ms"] == pytest.approx(1.0)
    assert r["both_at_once"]["comm_slowed_ms"] is None
    assert r["both_at_once"]["not_measured"] == (
        "the comm only window: not measured: the window ran no device activity: at world "
        "size 1 NCCL's in-place sum launches no kernel")
    assert ("collectives not measured (the comm only window: not measured: the "
            "window ran no device activity") in floor.format_result(r)


def test_the_world_size_1_cause_is_added_only_where_it_holds():
    from commsched import floor_worker
    from commsched.telemetry.window import NO_DEVICE_ACTIVITY

    assert floor_worker._comm_window_reason(NO_DEVICE_ACTIVITY, "nccl", 2) == \
        NO_DEVICE_ACTIVITY
    assert floor_worker._comm_window_reason(NO_DEVICE_ACTIVITY, "gloo", 1) == \
        NO_DEVICE_ACTIVITY
    other = "not measured: the script runs its own profiler"
    assert floor_worker._comm_window_reason(other, "nccl", 1) == other
    assert floor_worker._comm_window_reason(None, "nccl", 1) is None


def test_a_reason_names_the_launch_whose_window_is_missing():
    hook = window(85.0, {"gemm": [10, 70.0]})
    comm = window(5.0, {}, collectives={"nccl": [1, 4.0]})
    r = summarize(one_rank_launches(hook=(hook, None), comm=(comm, None)),
                  {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert set(r["split"]["not_measured"].values()) == {
        "the compute only window: not measured: compute had none"}
    assert r["split"]["above_ms"] == pytest.approx(5.0)
    assert r["both_at_once"]["not_measured"] == (
        "the both at once window: not measured: both had none; the compute only window: "
        "not measured: compute had none")


def test_a_rank_without_a_result_in_a_launch_is_named():
    per_mode = one_rank_launches()
    per_mode["both"][0]["rank"] = 1
    r = summarize(per_mode, {"iters": ITERS, "warmup": WARMUP}, ["train.py"])
    assert r["both_at_once"]["not_measured"] == (
        "the both at once window: not measured: the both launch has no result of rank 0; "
        "the compute only window: not measured: compute had none")


def test_a_step_at_its_floor_gets_no_promise():
    assert floor.verdict(100.0, 40.0, 101.0).startswith("at the floor (99% efficient)")
    assert "only fewer bytes" in floor.verdict(40.0, 100.0, 150.0)


def test_a_saved_result_is_found_from_a_launch_subdirectory(tmp_path):
    save_floor(str(tmp_path), {"source": "test", "compute_only_ms": 8.0, "comm_only_ms": 9.0})
    launch = tmp_path / "20261128-120000"
    launch.mkdir()
    doc, note = load_floor(str(launch))
    assert doc["floor_ms"] == 9.0 and doc["limited_by"] == "comm_only"
    assert str(tmp_path / "floor.json") in note
    (tmp_path / "floor.json").write_text("{not json")
    doc, note = load_floor(str(launch))
    assert doc is None and "not used" in note


def test_options_come_first_and_torchrun_parses_the_rest():
    own, launch = floor._split(["--iters", "7", "--warmup=3", "--json", "--nproc-per-node",
                                "2", "train.py", "--iters", "99"])
    assert (own["iters"], own["warmup"], own["json"]) == (7, 3, True)
    assert launch == ["--nproc-per-node", "2", "train.py", "--iters", "99"]
    options, target = floor._torchrun_parts(["--nproc-per-node", "2", "-m", "pkg.train",
                                             "--lr", "3e-4"])
    assert options == ["--nproc-per-node", "2"]
    assert target == ["-m", "pkg.train", "--lr", "3e-4"]
    with pytest.raises(ValueError, match="at least 1"):
        floor._split(["--warmup", "0", "train.py"])
    own, _ = floor._split(["--profile-iters", "0", "--trace-dir", "t", "train.py"])
    assert (own["profile_iters"], own["trace_dir"]) == (0, "t")
    assert floor._split(["train.py"])[0]["profile_iters"] == floor.DEFAULT_PROFILE_ITERS
    with pytest.raises(ValueError, match="--profile-iters -1: must be 0"):
        floor._split(["--profile-iters", "-1", "train.py"])


def floor_command(args, cwd, env_extra=None, timeout=150):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "commsched", "floor", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_floor_on_a_ddp_script_prints_the_table_and_leaves_the_scripts_outputs(tmp_path):
    work, out, saved = tmp_path / "work", tmp_path / "out", tmp_path / "run"
    work.mkdir()
    out.mkdir()
    proc = floor_command(["--iters", str(ITERS), "--warmup", str(WARMUP), "--save",
                          str(saved), "--standalone", "--nproc-per-node", "2", SCRIPT,
                          "--steps", "100"], cwd=work,
                         env_extra={"OUT_DIR": str(out),
                                    "COMMSCHED_TELEMETRY_DIR": str(tmp_path / "tel")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for label in ("compute only", "comm only", "floor", "both at once", "commsched hook",
                  "efficiency"):
        assert any(line.strip().startswith(label) for line in lines), (label, proc.stdout)
    assert any(line.startswith("verdict: ") for line in lines), proc.stdout
    result = json.loads((saved / "floor.json").read_text())
    assert result["floor_ms"] == max(result["compute_only_ms"], result["comm_only_ms"])
    assert result["efficiency"] == pytest.approx(result["floor_ms"] / result["hook_ms"])
    # compute only ran no collective, comm only no backward, the hook both
    assert result["collectives"]["compute"] == 0
    assert result["backwards"] == {"compute": ITERS, "comm": 0, "both": ITERS, "hook": ITERS}
    assert result["collectives"]["comm"] == ITERS * len(result["buckets"])
    assert result["collectives"]["hook"] >= ITERS * len(result["buckets"])
    # both at once: compute only's backward with comm only's collectives beside it
    assert result["collectives"]["both"] == ITERS * len(result["buckets"])
    # on CPU no part of the split is measured, and the output says so
    assert result["both_ms"] > 0 and result["split"]["exposed_ms"] is None
    assert "its parts not measured: no CUDA timing on this device" in proc.stdout
    # the buckets DDP rebuilt in the order gradients became ready (0.1 MB cap, reached by
    # the last layer's 257 floats with the middle layer's 65792; then the first's 16640)
    assert result["buckets"] == [{"bytes": 4 * (257 + 65792), "dtype": "float32"},
                                 {"bytes": 4 * 16640, "dtype": "float32"}]
    # The script wrote its outputs as a run of it stopped in its optimizer step number
    # WARMUP + ITERS does (the last launch's, with the commsched hook; it writes after each
    # step); commsched saved nothing of its own.
    for rank in (0, 1):
        text = (out / f"rank{rank}.txt").read_text()
        assert text == f"steps={WARMUP + ITERS - 1} hooks=['CommschedState']\n"
    assert sorted(os.listdir(out)) == ["rank0.txt", "rank1.txt"]
    assert os.listdir(work) == [] and not (tmp_path / "tel").exists()


def test_a_script_that_ends_too_soon_is_a_clear_error(tmp_path):
    proc = floor_command(["--iters", "5", "--warmup", "5", "--standalone",
                          "--nproc-per-node", "1", SCRIPT, "--steps", "3"], cwd=tmp_path)
    assert proc.returncode == 1
    assert "ended after 3 optimizer steps; the measurement needs 10" in proc.stderr
    assert "Traceback" not in proc.stderr.split("--- its output")[0]
