"""The launcher on unmodified scripts: off means off, on registers the hook; settings that
would have no effect, launcher-injected arguments and comm hooks of the script's own.

Two launches of a script with four models (no hook, PyTorch's allreduce_hook,
fp16_compress_hook, commsched.hooks.register) serve most tests: COMMSCHED unset under
torchrun with COMMSCHED_TELEMETRY_DIR set, and COMMSCHED=1 under the legacy launcher
(python -m torch.distributed.launch, which puts --local-rank=N before the script)."""

import os
import re
import subprocess
import sys

import pytest

import commsched
from distributed import free_port, run_group

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "scripts", "train_ddp_hooks.py")
MODEL = "DistributedDataParallel(Sequential, 2,177 parameters)"


def _env(overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update(overrides)
    return env


def _launch(cwd, env_overrides, launcher, *extra):
    """Two ranks of the script under ``launcher -m commsched.run``; the finished process."""
    if launcher == "torchrun":
        # --log-dir: torchrun's per-launch directory goes there, not to a fresh one in /tmp.
        args = ["torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                "--log-dir", str(cwd / "logs")]
    else:
        args = ["torch.distributed.launch", "--nproc_per_node=2",
                f"--master_port={free_port()}"]
    proc = run_group([sys.executable, "-m", *args, "-m", "commsched.run", SCRIPT, *extra],
                     env=_env(env_overrides), cwd=str(cwd), timeout=240)
    # The head has what the ranks printed; the tail, the launcher's summary of who failed.
    assert proc.returncode == 0, proc.stderr[:2000] + "\n[...]\n" + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """(off, on): COMMSCHED_TELEMETRY_DIR=runs/b torchrun ... -m commsched.run SCRIPT --lr
    0.1, and COMMSCHED=1 python -m torch.distributed.launch ... -m commsched.run SCRIPT."""
    off = _launch(tmp_path_factory.mktemp("off"), {"COMMSCHED_TELEMETRY_DIR": "runs/b"},
                  "torchrun", "--lr", "0.1")
    on = _launch(tmp_path_factory.mktemp("on"), {
        "COMMSCHED": "1", "COMMSCHED_PARTITION_BYTES": "64KiB",
        "COMMSCHED_CREDIT_BYTES": "256KiB"}, "legacy")
    return off, on


@pytest.fixture(scope="module")
def parsed(launches):
    """(models, ranks) of each launch, as ``_models`` gives them: off, on."""
    return tuple(_models(proc) for proc in launches)


def _field(line, name):
    return re.search(rf"{name}=(\[.*?\]|\S+)", line).group(1)


def _models(proc):
    """{(rank, model): (hooks, same, checksum)}, and {rank: (patched, argv)}."""
    models, ranks = {}, {}
    for line in proc.stdout.splitlines():
        rank = int(_field(line, "rank"))
        if "model=" in line:
            models[rank, _field(line, "model")] = (
                _field(line, "hooks"), _field(line, "same"), _field(line, "checksum"))
        else:
            ranks[rank] = (_field(line, "patched"), line.split("argv=", 1)[1])
    assert len(models) == 8 and len(ranks) == 2, proc.stdout
    return models, ranks


def test_off_leaves_ddp_untouched_and_on_registers_the_hook(parsed):
    (models_off, ranks_off), (models_on, ranks_on) = parsed
    for rank in (0, 1):
        assert ranks_off[rank] == ("False", "['--lr', '0.1']")     # arguments reach the script
        assert ranks_on[rank][0] == "True"
        assert models_off[rank, "plain"][0] == "[]"
        assert models_on[rank, "plain"][0] == "['commsched_hook']"
        # Same training result with and without the scheduler (2 ranks: bitwise).
        assert models_on[rank, "plain"][2] == models_off[rank, "plain"][2]


def test_a_telemetry_dir_without_commsched_says_once_that_it_has_no_effect(launches):
    """COMMSCHED_TELEMETRY_DIR=runs/b torchrun --nproc-per-node 2 -m commsched.run train.py"""
    off, _ = launches
    warned = [l for l in off.stderr.splitlines() if "COMMSCHED_TELEMETRY_DIR" in l]
    assert len(warned) == 1, off.stderr
    assert ("CommschedWarning: commsched: COMMSCHED_TELEMETRY_DIR is set but COMMSCHED=1 is "
            "not: the launcher patches and registers nothing, so it has no effect unless the "
            "script calls commsched itself; set COMMSCHED=1 to turn commsched on") in warned[0]


def test_the_legacy_launcher_passes_local_rank_through_to_the_script(parsed):
    """python -m torch.distributed.launch --nproc_per_node=2 -m commsched.run train.py"""
    _, (_, ranks) = parsed
    assert ranks == {0: ("True", "['--local-rank=0']"), 1: ("True", "['--local-rank=1']")}


@pytest.mark.parametrize("switch", [{}, {"COMMSCHED": "0"}])
def test_local_rank_before_the_script_reaches_it_with_commsched_off(tmp_path, switch):
    script = tmp_path / "argv.py"
    script.write_text("import sys; print(sys.argv)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.run", "--local_rank=3", str(script), "--lr", "1"],
        env=_env(switch), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr([str(script), "--local_rank=3", "--lr", "1"])


def test_an_allreduce_hook_of_the_script_gives_way_to_commsched(launches, parsed):
    (models_off, _), (models_on, _) = parsed
    on = launches[1]
    for rank in (0, 1):
        assert models_off[rank, "allreduce"][0] == "['allreduce_hook']"
        assert models_on[rank, "allreduce"][0] == "['commsched_hook']"
        # The same job: parameters bitwise equal to PyTorch's hook's (2 ranks).
        assert models_on[rank, "allreduce"][2] == models_off[rank, "allreduce"][2]
    assert on.stderr.count("the script's allreduce_hook averages over the model's process "
                           "group, as commsched's hook does, which takes its place") == 1


def test_another_hook_of_the_script_is_kept_and_its_model_left_alone(launches, parsed):
    (models_off, _), (models_on, _) = parsed
    on = launches[1]
    for rank in (0, 1):
        assert models_on[rank, "fp16"][0] == "['fp16_compress_hook']"
        assert models_on[rank, "fp16"][2] == models_off[rank, "fp16"][2]
    warned = [l for l in on.stderr.splitlines() if "CommschedWarning" in l]
    assert len(warned) == 1, on.stderr
    assert warned[0].endswith(
        f"CommschedWarning: commsched: {MODEL} has its own comm hook fp16_compress_hook; "
        f"commsched leaves this model alone (its gradients are not scheduled)")


def test_commsched_registered_by_the_script_itself_stands(parsed):
    (models_off, _), (models_on, _) = parsed
    for rank in (0, 1):
        for models in (models_off, models_on):
            assert models[rank, "commsched"][:2] == ("['commsched_hook']", "True")
        assert models_on[rank, "commsched"][2] == models_off[rank, "plain"][2]


def test_rank_0_says_once_that_commsched_is_on_on_how_many_ranks_and_with_what(launches):
    off, on = launches
    assert [l for l in on.stderr.splitlines() if l.startswith("commsched: ")] == [
        f"commsched: on (version {commsched.__version__}): the DDP hook on {MODEL} on all 2 "
        f"ranks; settings: COMMSCHED_PARTITION_BYTES=64KiB, COMMSCHED_CREDIT_BYTES=256KiB",
        f"commsched: {MODEL}: the script's allreduce_hook averages over the model's process "
        f"group, as commsched's hook does, which takes its place",
        f"commsched: the DDP hook also on {MODEL}",
        f"commsched: the DDP hook also on {MODEL}"]
    # Off, the one notice is the telemetry of the script's own commsched.hooks.register.
    [notice] = [l for l in off.stderr.splitlines() if l.startswith("commsched: ")]
    assert notice.startswith("commsched: telemetry written to runs/b/")


def test_unset_is_off(tmp_path):
    noop = tmp_path / "noop.py"
    noop.write_text("pass\n")
    code = ("import commsched.run as r; "
            "from torch.nn.parallel import DistributedDataParallel as D; "
            f"before = D.__init__; r.main([{str(noop)!r}]); print(D.__init__ is before)")
    proc = subprocess.run([sys.executable, "-c", code], env=_env({}), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("True")


def test_missing_script_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "commsched.run", "/nonexistent/train.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "SCRIPT '/nonexistent/train.py' is not a file" in proc.stderr
