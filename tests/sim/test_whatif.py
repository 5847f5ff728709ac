"""``commsched simulate`` and the validation tool on a synthetic run directory."""

import json

import pytest

from commsched.sim.validate import main as validate_main, validate_runs
from commsched.sim.whatif import simulate_main

from . import synthetic


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return synthetic.write_run(str(tmp_path_factory.mktemp("run") / "run"))


def test_simulate_prints_assumptions_and_a_table(run_dir, capsys):
    assert simulate_main([run_dir, "--world-size", "8,16", "--bandwidth", "10"]) == 0
    out = capsys.readouterr().out
    assert "assumptions:" in out
    assert "weak scaling" in out
    assert "ring: all_reduce = 2(n-1)*5us" in out
    assert "iter ms" in out and "recorded (measured)" in out and "projected" in out


def test_simulate_projection_matches_hand_arithmetic(run_dir, capsys):
    # 8 ranks, ring, 10 GB/s, 5 us per step:
    #   4 MiB chunk: 2*7*5 us + 2*7/8 * 4194304 / 1e10 s = 70 + 734.0032 = 804.0032 us
    #   2 MiB chunk: 70 + 367.0016 = 437.0016 us
    # fifo, credit 4 MiB: 0:0 [0, 0.8040032] ms, 0:1 [0.8040032, 1.6080064], 1:0 ready at
    # 2.5 -> [2.5, 2.9370016]. Backward ends 2.7, other compute 6.9 (from the run):
    # iteration = 2.9370016 + 6.9 = 9.8370016 ms; exposed 0.2370016; compute only 9.6.
    assert simulate_main([run_dir, "--world-size", "8", "--bandwidth", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    measured, replayed, projected = doc["rows"]
    assert measured["iteration_ms"] == pytest.approx(10.0)
    assert measured["exposed_ms"] == pytest.approx(0.4)
    # Replayed with costs fitted on the run's own chunks: the run itself.
    assert replayed["iteration_ms"] == pytest.approx(10.0, abs=1e-6)
    assert projected["world_size"] == 8
    assert projected["iteration_ms"] == pytest.approx(9.8370016, abs=1e-6)
    assert projected["exposed_ms"] == pytest.approx(0.2370016, abs=1e-6)
    assert projected["compute_only_ms"] == pytest.approx(9.6, abs=1e-6)
    assert projected["comm_alone_ms"] == pytest.approx(2 * 0.8040032 + 0.4370016, abs=1e-6)


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "8"], "--bandwidth"),
    (["--world-size", "0", "--bandwidth", "10"], "world sizes >= 1"),
    (["--world-size", "8", "--bandwidth", "-1"], "positive number"),
    (["--world-size", "8", "--bandwidth", "10", "--topology", "mesh"], "hier:NODES"),
    (["--world-size", "8", "--bandwidth", "10", "--topology", "hier:3"], "does not split"),
    (["--world-size", "8", "--bandwidth", "10", "--credit-bytes", "lots"], "byte count"),
])
def test_bad_arguments_exit_2_with_a_message(run_dir, capsys, argv, message):
    assert simulate_main([run_dir, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_missing_and_corrupt_run_dirs_exit_2(tmp_path, capsys):
    assert simulate_main([str(tmp_path / "nope"), "--world-size", "8", "--bandwidth", "10"]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "rank0.sqlite").write_bytes(b"this is not a database" * 100)
    assert simulate_main([str(tmp_path), "--world-size", "8", "--bandwidth", "10"]) == 2
    err = capsys.readouterr().err
    assert "rank0.sqlite" in err and "Traceback" not in err


def test_validation_of_a_consistent_run_has_no_error(run_dir):
    doc = validate_runs([run_dir])
    (row,) = doc["rows"]
    assert row["setting"] == "partition 4MiB, credit 4MiB, fifo, none"
    assert row["iterations"] == 5            # 6 recorded, the last has no successor
    assert row["measured_ms"] == pytest.approx(10.0)
    assert row["predicted_ms"] == pytest.approx(10.0, abs=1e-6)
    assert row["exposed_measured_ms"] == pytest.approx(0.4)
    assert row["exposed_predicted_ms"] == pytest.approx(0.4, abs=1e-6)
    assert row["same_order"] == 5            # replayed dispatch order = recorded one


def test_recorded_profile_of_the_synthetic_run(run_dir):
    from commsched.sim import load_recorded_run
    run = load_recorded_run(run_dir)
    assert (run.lane, run.world_size, len(run.steady)) == ("g0", 2, 5)
    p = run.representative()
    # Bucket "0" ready at 0, bucket "1" at 2.5 ms (CPU: readiness = submission).
    assert [(r.key, r.nbytes, r.priority) for r in p.requests] == [
        ("0", 8 << 20, 1), ("1", 2 << 20, 0)]
    assert [r.ready_s for r in p.requests] == pytest.approx([0.0, 2.5e-3])
    assert p.compute_end_s == pytest.approx(2.7e-3)
    assert p.tail_s == pytest.approx(6.9e-3)
    assert run.measured_s == pytest.approx(10e-3)
    assert run.steady[0].order == (("0", 0), ("0", 1), ("1", 0))


def test_validation_cli_prints_a_table(run_dir, tmp_path, capsys):
    other = synthetic.write_run(str(tmp_path / "other"))
    assert validate_main([run_dir, other, "--fit", "others"]) == 0
    out = capsys.readouterr().out
    assert "measured ms" in out and "predicted ms" in out and "error %" in out
    assert validate_main([run_dir, str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
