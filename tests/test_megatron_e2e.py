"""The Megatron-LM end-to-end benchmark (examples/bench/megatron_e2e.py) reads times and
losses from Megatron-LM's own training log: an excerpt of a real run (core_r0.19.0's
pretrain_gpt.py on 2x H200, the training part of a log kept under benchmarks/data/, paths
shortened), and logs that lack them."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "bench"))
import megatron_e2e  # noqa: E402  (the path above)

LOG = os.path.join(os.path.dirname(__file__), "fixtures", "megatron",
                   "pretrain_gpt_core_r0.19.0_2xH200.log")


def test_the_log_excerpt_gives_every_logged_iteration_with_its_time_and_loss():
    log = megatron_e2e.parse_megatron_log(open(LOG).read())
    assert log.iterations == [1, 10, 20, 30]
    assert log.ms == [3299.7, 497.4, 186.6, 201.3]
    assert log.loss == [11.03326, 9.980937, 8.267979, 8.181424]


def test_the_steady_time_leaves_out_the_intervals_of_the_first_iterations():
    log = megatron_e2e.parse_megatron_log(open(LOG).read())
    assert megatron_e2e.steady_intervals(log, skip=10) == [186.6, 201.3]
    assert megatron_e2e.steady_intervals(log, skip=0) == log.ms
    with pytest.raises(ValueError, match="no logged interval after iteration 30"):
        megatron_e2e.steady_intervals(log, skip=30)


def test_extra_args_log_every_iteration_and_profile_three_after_skip(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("")
    base = ["--megatron", str(tmp_path), "--train-iters", "30", "--skip", "10"]
    args = megatron_e2e.parse_args(base + ["--log-interval", "1"])
    assert megatron_e2e.extra_args(args, "run") == "--log-interval 1"
    args = megatron_e2e.parse_args(base + ["--profile-dir", str(tmp_path / "prof")])
    extra = megatron_e2e.extra_args(args, "nvlink_no_overlap_r1_stock").split()
    assert extra[:2] == ["--log-interval", "10"] and "--use-pytorch-profiler" in extra
    value = {flag: extra[i + 1] for i, flag in enumerate(extra) if flag.startswith("--")
             and i + 1 < len(extra) and not extra[i + 1].startswith("--")}
    assert (value["--profile-step-start"], value["--profile-step-end"]) == ("11", "14")
    assert value["--profile-ranks"] == "0"
    assert value["--tensorboard-dir"] == str(tmp_path / "prof" / "nvlink_no_overlap_r1_stock"
                                             / "tb")


@pytest.mark.parametrize("flags, message", [
    (["--log-interval", "0"], "--log-interval"),
    (["--train-iters", "12", "--skip", "10", "--profile-dir", "p"], "--profile-dir"),
])
def test_bad_measurement_flags_are_reported(tmp_path, capsys, flags, message):
    (tmp_path / "pretrain_gpt.py").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        megatron_e2e.parse_args(["--megatron", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text", [
    "",
    # a run that died before training: no iteration line at all
    "> building NullTokenizer tokenizer ...\nTraceback (most recent call last):\n"
    "RuntimeError: CUDA error: out of memory\n",
    # an iteration line without the loss (e.g. a pipeline stage that does not log it)
    " [2026-11-27 10:41:09.702115] iteration       10/      40 | consumed samples:"
    "          160 | elapsed time per iteration (ms): 561.3 | global batch size:    16 |\n",
])
def test_a_log_without_times_and_losses_is_an_error(text):
    with pytest.raises(ValueError, match="elapsed time per iteration"):
        megatron_e2e.parse_megatron_log(text)


def test_losses_that_differ_are_reported(tmp_path):
    log = megatron_e2e.parse_megatron_log(open(LOG).read())
    good = {"error": None, "iterations": log.iterations, "ms": log.ms, "loss": log.loss}
    off = dict(good, loss=log.loss[:-1] + [log.loss[-1] + 1e-6])
    runs = [{"regime": "nvlink", "setting": "no_overlap", "round": 1, "stock": good,
             "patched": good},
            {"regime": "nvlink", "setting": "distopt_overlap", "round": 1, "stock": good,
             "patched": off}]
    summary = megatron_e2e.summarize(runs, skip=10)
    assert summary["nvlink/no_overlap"]["losses_equal"]
    assert summary["nvlink/no_overlap"]["ratio"] == pytest.approx(1.0)
    assert not summary["nvlink/distopt_overlap"]["losses_equal"]
    assert "losses equal" in megatron_e2e.table(summary)


def test_stock_and_patched_launches_run_and_are_tabled(tmp_path):
    """The whole loop on CPU, with a stand-in for pretrain_gpt.py under torchrun (2 ranks):
    the patched launch script starts it under commsched.run, the stock one does not."""
    fake = os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "fake_checkout")
    out = tmp_path / "megatron.json"
    code = megatron_e2e.main(["--megatron", fake, "--regimes", "nvlink", "--settings",
                              "no_overlap", "--rounds", "1", "--train-iters", "30",
                              "--skip", "10", "--run-timeout", "240", "--out", str(out)])
    assert code == 0
    import json
    doc = json.loads(out.read_text())
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["losses_equal"] and row["errors"] == []
    assert row["stock_median_ms"] == pytest.approx((220.0 + 230.0) / 2)
    assert row["ratio"] == pytest.approx(1.0)
    run = doc["runs"][0]
    assert "under_commsched=False" in open(run["stock"]["log"]).read()
    assert "under_commsched=True" in open(run["patched"]["log"]).read()


def test_the_launcher_only_variant_runs_under_the_launcher_with_nothing_patched(tmp_path):
    """--launcher-only: a third launch, the patched script with COMMSCHED=0; rounds
    alternate which variant goes first."""
    fake = os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "fake_checkout")
    out = tmp_path / "megatron.json"
    code = megatron_e2e.main(["--megatron", fake, "--regimes", "nvlink", "--settings",
                              "no_overlap", "--rounds", "2", "--train-iters", "30",
                              "--skip", "10", "--run-timeout", "240", "--launcher-only",
                              "--out", str(out)])
    assert code == 0
    import json
    doc = json.loads(out.read_text())
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["losses_equal"] and row["errors"] == []
    assert row["launcher_ratio"] == pytest.approx(1.0) and len(row["launcher_ms"]) == 2
    for run in doc["runs"]:
        log = open(run["launcher"]["log"]).read()
        assert "launcher=True" in log and "under_commsched=False" in log
        assert "launcher=False" in open(run["stock"]["log"]).read()
    assert "launcher/stock" in megatron_e2e.table(doc["summary"])
    assert doc["runs"][0]["order"] == ["stock", "patched", "launcher"]
    assert doc["runs"][1]["order"] == ["launcher", "patched", "stock"]


def test_the_median_interval_ratio_is_not_moved_by_one_slow_iteration():
    def run(ms):
        iterations = list(range(1, len(ms) + 1))
        return {"error": None, "iterations": iterations, "ms": ms, "loss": [1.0] * len(ms)}
    stock = run([900.0, 200.0, 200.0, 200.0, 2000.0])        # a stall in the last one
    patched = run([900.0, 210.0, 210.0, 210.0, 210.0])
    summary = megatron_e2e.summarize(
        [{"regime": "host", "setting": "no_overlap", "round": 1, "stock": stock,
          "patched": patched}], skip=1)["host/no_overlap"]
    assert summary["ratio"] == pytest.approx(210.0 / 650.0)   # means: the stall dominates
    assert summary["ratio_interval_median"] == pytest.approx(1.05)
    assert "patched/stock (median interval)" in megatron_e2e.table({"k": summary})
