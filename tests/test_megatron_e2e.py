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


FAKE_CHECKOUT = os.path.join(os.path.dirname(__file__), "fixtures", "megatron",
                             "fake_checkout")


def _run_fake_checkout(tmp_path, *flags, rounds=1):
    """megatron_e2e.main on the stand-in checkout (no overlap, 30 iterations, skip 10);
    the JSON document it wrote. It must exit 0."""
    import json

    out = tmp_path / "megatron.json"
    code = megatron_e2e.main(["--megatron", FAKE_CHECKOUT, "--regimes", "nvlink",
                              "--settings", "no_overlap", "--rounds", str(rounds),
                              "--train-iters", "30", "--skip", "10", "--run-timeout", "240",
                              *flags, "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


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
    args = megatron_e2e.parse_args(base + ["--megatron-args",
                                           "--recompute-granularity full --seq-length 2048"])
    assert megatron_e2e.extra_args(args, "run").split() == [
        "--log-interval", "10", "--recompute-granularity", "full", "--seq-length", "2048"]


@pytest.mark.parametrize("flags, message", [
    (["--log-interval", "0"], "--log-interval"),
    (["--set", "POLICY=fifo"], "'POLICY=fifo': expected VAR=VALUE"),
    (["--set", "COMMSCHED_POLICY"], "'COMMSCHED_POLICY': expected VAR=VALUE"),
    (["--set", "COMMSCHED=0"], "--set COMMSCHED=..."),
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
    doc = _run_fake_checkout(tmp_path)
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["losses_equal"] and row["errors"] == []
    assert row["stock_median_ms"] == pytest.approx((220.0 + 230.0) / 2)
    assert row["ratio"] == pytest.approx(1.0)
    run = doc["runs"][0]
    assert "under_commsched=False" in open(run["stock"]["log"]).read()
    assert "under_commsched=True" in open(run["patched"]["log"]).read()


def test_set_exports_a_commsched_setting_in_the_patched_run_only(tmp_path):
    doc = _run_fake_checkout(tmp_path, "--set", "COMMSCHED_POLICY=fifo")
    run = doc["runs"][0]
    assert "policy=fifo" in open(run["patched"]["log"]).read().splitlines()
    assert "policy=" in open(run["stock"]["log"]).read().splitlines()
    assert doc["settings"]["settings_env"] == {"COMMSCHED_POLICY": "fifo"}


def test_the_launcher_only_variant_runs_under_the_launcher_with_nothing_patched(tmp_path):
    """--launcher-only: a third launch, the patched script with COMMSCHED=0; rounds
    alternate which variant goes first."""
    doc = _run_fake_checkout(tmp_path, "--launcher-only", rounds=2)
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["losses_equal"] and row["errors"] == []
    assert row["launcher_ratio"] == pytest.approx(1.0) and len(row["launcher_ms"]) == 2
    assert row["ratio_rounds"] == [pytest.approx(1.0)] * 2
    assert row["launcher_ratio_rounds"] == [pytest.approx(1.0)] * 2
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
    assert summary["ratio_rounds"] == [pytest.approx(210.0 / 650.0)]
    assert summary["ratio_interval_median"] == pytest.approx(1.05)
    assert "patched/stock (median interval)" in megatron_e2e.table({"k": summary})


def test_the_log_lines_carry_their_timestamps():
    import datetime

    log = megatron_e2e.parse_megatron_log(open(LOG).read())
    stamps = ["2026-11-27 13:21:31.147348", "2026-11-27 13:21:32.822165",
              "2026-11-27 13:21:34.688506", "2026-11-27 13:21:36.701388"]
    assert log.times == [datetime.datetime.fromisoformat(s).timestamp() for s in stamps]


def _samples(path, rows):
    import json

    with open(path, "w") as f:
        for t, threads in rows:
            f.write(json.dumps({"t": t, "threads": threads}) + "\n")
        f.write('{"t": 9')                # a line cut short as the process ended


def test_thread_cpu_per_iteration_interpolates_each_thread_between_the_logged_marks(tmp_path):
    log = megatron_e2e.MegatronLog([10, 20, 30], [1.0] * 3, [1.0] * 3, [100.0, 101.0, 102.0])
    ms = 1_000_000
    _samples(tmp_path / "rank0-pid1.jsonl", [
        (99.5, {"1": ["main", 0], "2": ["pt_autograd_0", 0]}),
        (100.5, {"1": ["main", 100 * ms], "2": ["pt_autograd_0", 40 * ms]}),
        # a thread started at 101.2 s, one that ended after 101.5 s
        (101.5, {"1": ["main", 200 * ms], "3": ["cs-g0-complete", 6 * ms]}),
        (102.5, {"1": ["main", 300 * ms], "3": ["cs-g0-complete", 16 * ms]}),
    ])
    got = megatron_e2e.thread_cpu_per_iteration(tmp_path / "rank0-pid1.jsonl", log, skip=10)
    # From 100.0 s (iteration 10) to 102.0 s (30), 20 iterations: main 50 -> 250 ms,
    # pt_autograd_0 20 -> 40 (its last), cs-g0-complete 0 -> 11.
    assert got["iterations"] == [10, 30] and got["samples"] == 4
    assert got["threads_ms"] == {"main": 10.0, "pt_autograd_0": 1.0, "cs-g0-complete": 0.55}
    assert got["process_ms"] == pytest.approx(11.55)
    # The mark at or before --skip; not covered, or no timestamps: None.
    assert megatron_e2e.thread_cpu_per_iteration(
        tmp_path / "rank0-pid1.jsonl", log, skip=15)["iterations"] == [10, 30]
    assert megatron_e2e.thread_cpu_per_iteration(
        tmp_path / "rank0-pid1.jsonl", log._replace(times=[98.0, 101.0, 102.0]), 10) is None
    assert megatron_e2e.thread_cpu_per_iteration(
        tmp_path / "rank0-pid1.jsonl", log._replace(times=None), 10) is None
    # A process the worker spawned samples itself into a file of its own: the rank's
    # figure is the process that used the most CPU.
    _samples(tmp_path / "rank0-pid2.jsonl", [(99.0, {"7": ["main", 0]}),
                                              (103.0, {"7": ["main", 40 * ms]})])
    assert megatron_e2e.rank_cpu_per_iteration(tmp_path, 0, log, 10)["process_ms"] == \
        pytest.approx(11.55)
    assert megatron_e2e.rank_cpu_per_iteration(tmp_path, 1, log, 10) is None


def test_thread_cpu_measures_each_run_s_rank_0(tmp_path, monkeypatch):
    """--thread-cpu on CPU: the stand-in spends 5 ms of its main thread's CPU an
    iteration; each run reports it, and the table the process's CPU per variant."""
    monkeypatch.setenv("BENCH_THREAD_CPU_PERIOD_S", "0.01")
    doc = _run_fake_checkout(tmp_path, "--thread-cpu")
    run = doc["runs"][0]
    for variant in ("stock", "patched"):
        cpu = run[variant]["cpu"]
        assert cpu["iterations"] == [10, 30] and cpu["samples"] > 10
        assert 3.5 <= cpu["threads_ms"]["main"] <= 6.5, cpu     # (5: samples under load)
        assert cpu["process_ms"] >= cpu["threads_ms"]["main"]
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["stock_cpu_median_ms"] == run["stock"]["cpu"]["process_ms"]
    assert "patched CPU ms/iter (rank 0)" in megatron_e2e.table(doc["summary"])


def test_the_sampler_runs_in_ranks_only_and_the_shadowed_sitecustomize_still_runs(tmp_path):
    import subprocess

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import os\nopen(os.environ['MARKER'], 'a').write('ran\\n')\n")
    samples = tmp_path / "cpu"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(megatron_e2e.WORKER_SITE), str(other)]), MARKER=str(tmp_path / "marker"),
        BENCH_THREAD_CPU_DIR=str(samples), BENCH_THREAD_CPU_PERIOD_S="0.01")
    env.pop("RANK", None)
    code = "import time; time.sleep(0.2)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert not samples.exists()                         # no RANK: not a worker
    subprocess.run([sys.executable, "-c", code], env=dict(env, RANK="3"), check=True,
                   timeout=60)
    files = list(samples.glob("rank3-pid*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) >= 5
    assert (tmp_path / "marker").read_text() == "ran\nran\n"


@pytest.mark.parametrize("period", ["0", "fast", "-1"])
def test_a_bad_sampling_period_is_an_error_naming_the_variable(tmp_path, monkeypatch, capsys,
                                                               period):
    monkeypatch.setenv("BENCH_THREAD_CPU_PERIOD_S", period)
    with pytest.raises(SystemExit):
        megatron_e2e.main(["--megatron", FAKE_CHECKOUT, "--thread-cpu",
                           "--out", str(tmp_path / "m.json")])
    assert "BENCH_THREAD_CPU_PERIOD_S" in capsys.readouterr().err


def test_each_round_has_its_own_ratio():
    def run(ms):
        iterations = list(range(1, len(ms) + 1))
        return {"error": None, "iterations": iterations, "ms": ms, "loss": [1.0] * len(ms)}
    runs = [{"regime": "nvlink", "setting": "overlap_grad", "round": 1,
             "stock": run([900.0, 200.0, 200.0]), "patched": run([900.0, 210.0, 210.0])},
            {"regime": "nvlink", "setting": "overlap_grad", "round": 2,
             "stock": run([900.0, 250.0, 250.0]), "patched": run([900.0, 225.0, 225.0])}]
    row = megatron_e2e.summarize(runs, skip=1)["nvlink/overlap_grad"]
    assert row["ratio_rounds"] == [pytest.approx(1.05), pytest.approx(0.9)]
    # (medians over rounds: stock 225, patched 217.5)
    assert row["ratio"] == pytest.approx(217.5 / 225.0)
    assert "| 1.050, 0.900 |" in megatron_e2e.table({"k": row})


def test_the_interleaved_variant_compares_blocks_of_one_process(tmp_path, monkeypatch):
    """--variants stock,interleaved on the stand-in (megatron-core imported, patched by the
    launcher): the training step is switched in blocks of 5 iterations, patched first in
    round 1 and stock first in round 2; the stand-in's step takes 210 ms patched and 200
    stock, and each block's first iteration is left out."""
    pytest.importorskip("megatron.core.distributed.param_and_grad_buffer",
                        reason="megatron-core is not installed (make test installs it)")
    monkeypatch.setenv("BENCH_INTERLEAVE_TARGET", "fake_training:train_step")
    doc = _run_fake_checkout(tmp_path, "--variants", "stock,interleaved", "--log-interval",
                             "1", rounds=2)
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["errors"] == [] and row["losses_equal"]
    assert row["interleaved_ratio_rounds"] == [pytest.approx(1.05)] * 2
    assert row["interleaved_ratio"] == pytest.approx(1.05)
    # iterations 11-30 of each round, less 11, 16, 21, 26: 8 of each variant per round
    assert row["interleaved_iterations"] == {"patched": 16, "stock": 16}
    # two pairs of adjacent blocks per round (11-15 with 16-20, 21-25 with 26-30)
    assert row["interleaved_block_diff_ms"] == [pytest.approx(10.0)] * 4
    assert row["interleaved_block_diff_se_ms"] == pytest.approx(0.0)
    assert "patched_ms" not in row or row["patched_ms"] == []
    first = [run["interleaved"]["interleave"]["first"] for run in doc["runs"]]
    assert first == ["patched", "stock"]
    log = open(doc["runs"][1]["interleaved"]["log"]).read()
    assert "[interleave] iteration 1: stock" in log and "[interleave] iteration 6: patched" in log
    assert "interleaved: patched/stock" in megatron_e2e.table(doc["summary"])


def test_interleaving_lines_are_checked_against_the_schedule():
    lines = "\n".join(f"[interleave] iteration {it}: {variant}" for it, variant in
                      ((1, "patched"), (6, "stock")))
    # another rank's output may continue the line
    lines += "\n[interleave] iteration 11: patched [2026-11-28 00:04:27] iteration 10/ 90 |"
    megatron_e2e.check_interleaving(lines, 5, "patched", list(range(1, 14)))
    with pytest.raises(ValueError, match="did not run"):
        megatron_e2e.check_interleaving("iteration 1 ...", 5, "patched", [1, 2])
    with pytest.raises(ValueError, match="differ from blocks of 5 starting stock"):
        megatron_e2e.check_interleaving(lines, 5, "stock", list(range(1, 14)))
    with pytest.raises(ValueError, match="differ"):    # a block that ran is missing
        megatron_e2e.check_interleaving(lines, 5, "patched", list(range(1, 17)))


@pytest.mark.parametrize("flags, message", [
    (["--variants", "stock,fast"], "--variants: 'fast' is not one of"),
    (["--variants", "interleaved"], "needs --log-interval 1"),
    (["--variants", "interleaved", "--log-interval", "1", "--interleave", "1"],
     "--interleave must be >= 2"),
])
def test_bad_variants_are_reported(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        megatron_e2e.main(["--megatron", FAKE_CHECKOUT, *flags,
                           "--out", str(tmp_path / "m.json")])
    assert message in capsys.readouterr().err


def test_block_pairs_compare_adjacent_whole_blocks_after_skip():
    """Blocks of 4, stock first: a slow drift (0.1 ms per iteration) shifts each pair by
    the distance between its blocks (4 iterations), not by the run's whole span; a whole
    block left over, and one cut short by the end of the run, pair with nothing."""
    iterations = list(range(1, 31))
    ms = [(210.0 if ((it - 1) // 4) % 2 else 200.0) + 0.1 * it for it in iterations]
    result = {"iterations": iterations, "ms": ms, "interleave": {"every": 4, "first": "stock"}}
    diffs = megatron_e2e.interleaved_block_pairs(result, skip=8)
    # whole blocks after 8: 9-12 (stock) with 13-16, 17-20 with 21-24; 25-28 left over,
    # 29-30 cut short
    assert diffs == [pytest.approx(10.0 + 0.4)] * 2


def test_the_wrapped_step_switches_at_block_starts_and_announces_where_it_starts(monkeypatch):
    bench_interleave = megatron_e2e._interleave_module()
    used = []

    class FakeSwitch:
        current = "patched"

        def use(self, variant):
            used.append(variant)
            changed, self.current = variant != self.current, variant
            return changed
    monkeypatch.setattr(bench_interleave, "_switch", FakeSwitch)
    lines = []
    step = bench_interleave.wrap_step(lambda *, iteration: iteration, 4, "stock", True,
                                      out=lambda text, flush: lines.append(text))
    assert [step(iteration=i) for i in range(10)] == list(range(10))
    assert used == ["stock"] * 4 + ["patched"] * 4 + ["stock"] * 2
    assert lines == ["[interleave] iteration 1: stock", "[interleave] iteration 5: patched",
                     "[interleave] iteration 9: stock"]
    # resumed at iteration 3, in a patched block, the methods already patched: the first
    # step says where it starts though nothing switched
    lines.clear()
    step = bench_interleave.wrap_step(lambda *, iteration: None, 4, "patched", True,
                                      out=lambda text, flush: lines.append(text))
    step(iteration=2)
    step(iteration=3)
    assert lines == ["[interleave] iteration 3: patched"]
    with pytest.raises(RuntimeError, match="without iteration="):
        step()


def test_the_interleaved_variant_alone_runs_no_stock_launch(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core.distributed.param_and_grad_buffer",
                        reason="megatron-core is not installed (make test installs it)")
    monkeypatch.setenv("BENCH_INTERLEAVE_TARGET", "fake_training:train_step")
    doc = _run_fake_checkout(tmp_path, "--variants", "interleaved", "--log-interval", "1")
    assert doc["settings"]["variants"] == "interleaved"
    [run] = doc["runs"]
    assert run["order"] == ["interleaved"] and "stock" not in run
    row = doc["summary"]["nvlink/no_overlap"]
    assert row["errors"] == [] and row["losses_equal"] is None
    assert row["interleaved_ratio"] == pytest.approx(1.05)
    assert "| not compared |" in megatron_e2e.table(doc["summary"])


def test_patched_and_launcher_variants_bring_the_stock_launch():
    for variants, expected in (("patched", "stock,patched"),
                               ("launcher,interleaved", "stock,launcher,interleaved")):
        args = megatron_e2e.parse_args(["--megatron", FAKE_CHECKOUT, "--variants", variants,
                                        "--log-interval", "1"])
        assert args.variants == expected


def _interleaved_round(round_, first, loss):
    iterations = list(range(1, 13))
    return {"regime": "host", "setting": "distopt_overlap", "round": round_,
            "interleaved": {"error": None, "iterations": iterations, "ms": [200.0] * 12,
                            "loss": loss, "interleave": {"every": 3, "first": first}}}


def test_without_a_stock_launch_rounds_starting_with_opposite_variants_compare_losses():
    """Round 1 ran patched where round 2 ran stock and back: equal losses at every
    iteration mean equal training steps, unequal ones are a failure; one round, or rounds
    that all start alike, compare nothing."""
    losses = [10.0 - 0.1 * i for i in range(12)]
    summary = megatron_e2e.summarize([_interleaved_round(1, "patched", losses),
                                      _interleaved_round(2, "stock", list(losses))], skip=3)
    row = summary["host/distopt_overlap"]
    assert row["losses_equal"] is True
    assert row["losses_compared"] == "interleaved rounds starting patched and stock"
    assert "| yes (opposite rounds) |" in megatron_e2e.table(summary)
    other = losses[:5] + [losses[5] + 1e-6] + losses[6:]
    row = megatron_e2e.summarize([_interleaved_round(1, "patched", losses),
                                  _interleaved_round(2, "stock", other)],
                                 skip=3)["host/distopt_overlap"]
    assert row["losses_equal"] is False
    for runs in ([_interleaved_round(1, "patched", losses)],
                 [_interleaved_round(1, "patched", losses),
                  _interleaved_round(3, "patched", list(losses))]):
        row = megatron_e2e.summarize(runs, skip=3)["host/distopt_overlap"]
        assert row["losses_equal"] is None and "losses_compared" not in row
    # a round whose log gave no losses proves nothing
    row = megatron_e2e.summarize([_interleaved_round(1, "patched", []),
                                  _interleaved_round(2, "stock", [])],
                                 skip=3)["host/distopt_overlap"]
    assert row["losses_equal"] is False


def test_peak_memory_is_the_largest_max_allocated_of_the_memory_reports():
    """Megatron reports memory after its first logged iterations: the real excerpt's
    largest 'max allocated' (MiB); a log without a report gives None, and the table a
    blank."""
    assert megatron_e2e.peak_memory_mib(open(LOG).read()) == pytest.approx(28679.05)
    assert megatron_e2e.peak_memory_mib("iteration 1/ 2 | lm loss: 1.0 |") is None
    iterations = list(range(1, 5))

    def run(ms, peak):
        return {"error": None, "iterations": iterations, "ms": ms, "loss": [1.0] * 4,
                "peak_mib": peak}
    summary = megatron_e2e.summarize([{"regime": "nvlink", "setting": "no_overlap",
                                       "round": 1, "stock": run([900.0, 200, 200, 200], 27000.0),
                                       "patched": run([900.0, 201, 201, 201], 27136.0)}],
                                     skip=1)
    assert "| stock 26.4, patched 26.5 |" in megatron_e2e.table(summary)
    summary["nvlink/no_overlap"].pop("stock_peak_mib")
    summary["nvlink/no_overlap"].pop("patched_peak_mib")
    assert "| patched 26.5 |" not in megatron_e2e.table(summary)


def test_iteration_stats_give_median_p90_max_and_the_iterations_above_1_2x_the_median():
    ms = [100.0] * 8 + [130.0, 300.0]
    assert megatron_e2e.iteration_stats(ms) == {"median": 100.0, "p90": 130.0, "max": 300.0,
                                                "stalls": 2}
    assert megatron_e2e.iteration_stats([50.0]) == {"median": 50.0, "p90": 50.0, "max": 50.0,
                                                    "stalls": 0}
    # exactly 1.2x the median is not a stall
    assert megatron_e2e.iteration_stats([100.0, 100.0, 120.0])["stalls"] == 0
    with pytest.raises(ValueError):
        megatron_e2e.iteration_stats([])


def test_every_variant_reports_its_iteration_stats_separate_and_interleaved():
    """Separate launches: all rounds' intervals after skip pooled, and each run's count
    above 1.2x its own median; interleaved: each variant's iterations of the process."""
    def run(ms):
        iterations = list(range(1, len(ms) + 1))
        return {"error": None, "iterations": iterations, "ms": ms, "loss": [1.0] * len(ms)}
    rounds = [{"regime": "host", "setting": "no_overlap", "round": 1,
               "stock": run([900.0, 100.0, 100.0, 100.0, 100.0]),
               "patched": run([900.0, 100.0, 100.0, 100.0, 700.0])},
              {"regime": "host", "setting": "no_overlap", "round": 2,
               "stock": run([900.0, 110.0, 110.0, 110.0, 110.0]),
               "patched": run([900.0, 110.0, 110.0, 110.0, 110.0])}]
    row = megatron_e2e.summarize(rounds, skip=1)["host/no_overlap"]
    assert row["stock_stats"] == {"median": 105.0, "p90": 110.0, "max": 110.0, "stalls": 0}
    assert row["patched_stats"] == {"median": 110.0, "p90": 700.0, "max": 700.0, "stalls": 1}
    assert row["patched_stalls_rounds"] == [1, 0] and row["stock_stalls_rounds"] == [0, 0]
    assert "patched 110.0 / 700.0 / 700.0, 1 (1, 0)" in megatron_e2e.table({"k": row})

    interleaved = _interleaved_round(1, "patched", [1.0] * 12)
    interleaved["interleaved"]["ms"][10] = 500.0          # iteration 11, a stock block's
    row = megatron_e2e.summarize([interleaved], skip=3)["host/distopt_overlap"]
    assert row["interleaved_stock_stats"]["stalls"] == 1
    assert row["interleaved_stock_stats"]["max"] == 500.0
    assert row["interleaved_patched_stats"] == {"median": 200.0, "p90": 200.0, "max": 200.0,
                                                "stalls": 0}
    assert row["interleaved_stock_stalls_rounds"] == [1]
    assert "interleaved stock 200.0 / " in megatron_e2e.table({"k": row})
