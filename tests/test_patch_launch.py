"""Specification of `commsched patch-launch` (megatron_patches/launch_script.py).

Every check computes its reference independently of the patcher: line diffs via difflib,
syntax via `bash -n`, behaviour by running the scripts against fake launchers on PATH.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_PATH = ROOT / "megatron_patches" / "launch_script.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "launch"
INSERTED = "-m commsched.run "

# Load the file itself: it must work standalone, before or without the package install.
_spec = importlib.util.spec_from_file_location("_commsched_launch_script", MODULE_PATH)
launch_script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = launch_script
_spec.loader.exec_module(launch_script)
patch_script, LaunchPatchError = launch_script.patch_script, launch_script.LaunchPatchError

# fixture -> the logical command text expected after patching (one launch per fixture)
EXPECTED = {
    "torchrun_basic.sh": "torchrun $DISTRIBUTED_ARGS -m commsched.run pretrain_gpt.py $GPT_ARGS",
    "torchrun_multiline.sh": "    -m commsched.run ${MEGATRON_PATH}/pretrain_gpt.py \\\n",
    "dist_run_bert.sh":
        'torch.distributed.run $DISTRIBUTED_ARGS -m commsched.run "$MEGATRON/pretrain_bert.py"',
    "dist_launch_t5.sh": "       -m commsched.run ./pretrain_t5.py \\\n",
    "srun_python.sh":
        "python -u -X faulthandler -m commsched.run /opt/megatron-lm/pretrain_gpt.py --num",
    "run_cmd_eval.sh":
        'run_cmd="torchrun ${DISTRIBUTED_ARGS[@]} -m commsched.run pretrain_gpt.py ${options}"',
    "sh_c_cmd.sh": 'run_cmd="python3 -u -m commsched.run ${MEGATRON_CODE_DIR}/pretrain_gpt.py',
    "torchrun_module.sh": "--standalone -m commsched.run -m megatron.training.pretrain --num",
    "uv_module.sh": "\n  -m commsched.run -m mypkg.train --micro-batch-size 2",
    "crlf_mamba.sh": "\r\n  -m commsched.run pretrain_mamba.py \\\r\n",
    "mentions_untouched.sh": "exec torchrun --nproc_per_node 2 -m commsched.run train_llama.py",
    "torchrun_script_var.sh":
        'torchrun ${DISTRIBUTED_ARGS[@]} -m commsched.run "$PRETRAIN_SCRIPT_PATH" \\\n',
    "sbatch_heredoc_cmd.sh":
        "\\${PROFILE_CMD} python -m commsched.run ${MEGATRON_PATH}/pretrain_gpt.py",
}
SETTINGS = {"COMMSCHED": "1", "COMMSCHED_CREDIT_BYTES": "8MiB",
            "COMMSCHED_TELEMETRY_DIR": "run a&b"}

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")


def read(name: str) -> str:
    return (FIXTURES / name).read_bytes().decode()


def bash_syntax_ok(text: str, tmp_path: Path) -> bool:
    script = tmp_path / "syntax_check.sh"
    script.write_bytes(text.encode())
    return subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def split_export_block(text: str) -> tuple[str, list[str]]:
    """Remove the marked export block; return the rest and the block's inner lines."""
    lines = text.splitlines(keepends=True)
    begin = [i for i, line in enumerate(lines) if line.startswith("# commsched: begin")]
    end = [i for i, line in enumerate(lines) if line.startswith("# commsched: end")]
    if not begin:
        return text, []
    assert len(begin) == 1 and len(end) == 1 and begin[0] < end[0], "exactly one block"
    inner = [line.rstrip("\r\n") for line in lines[begin[0] + 1:end[0]]]
    return "".join(lines[:begin[0]] + lines[end[0] + 1:]), inner


def assert_only_insertions(before: str, after: str, launches: int, settings=None) -> None:
    """`after` is `before` with INSERTED put into `launches` lines (+ the export block)."""
    rest, exports = split_export_block(after)
    expected_exports = [f"export {k}={shlex.quote(v)}" for k, v in (settings or {}).items()]
    assert exports == expected_exports
    old, new = before.splitlines(keepends=True), rest.splitlines(keepends=True)
    changed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        assert op == "replace" and i2 - i1 == j2 - j1, (op, old[i1:i2], new[j1:j2])
        for o, n in zip(old[i1:i2], new[j1:j2]):
            assert any(n == o[:k] + INSERTED + o[k:] for k in range(len(o) + 1)), (o, n)
            changed += 1
    assert changed == launches


# --- the pure function, per fixture --------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_entry_point_runs_under_commsched(name):
    assert EXPECTED[name] in patch_script(read(name))


@needs_bash
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patched_fixture_passes_bash_n(name, tmp_path):
    assert bash_syntax_ok(read(name), tmp_path), "fixture itself must be valid"
    assert bash_syntax_ok(patch_script(read(name)), tmp_path)
    assert bash_syntax_ok(patch_script(read(name), SETTINGS), tmp_path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("settings", [None, SETTINGS], ids=["plain", "set"])
def test_patching_twice_equals_patching_once(name, settings):
    once = patch_script(read(name), settings)
    assert patch_script(once, settings) == once
    assert patch_script(once) == once  # no --set on the rerun keeps the block


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("settings", [None, SETTINGS], ids=["plain", "set"])
def test_diff_is_only_the_inserted_tokens(name, settings):
    assert_only_insertions(read(name), patch_script(read(name), settings), 1, settings)


def test_no_launch_line_raises_and_lists_shapes():
    with pytest.raises(LaunchPatchError, match="no recognisable launch line") as info:
        patch_script(read("no_launch.sh"))
    assert "torchrun [ARGS] SCRIPT.py" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_echo_comment_and_heredoc_mentions_stay_byte_identical():
    before = read("mentions_untouched.sh")
    after = patch_script(before)
    changed = [n for o, n in zip(before.splitlines(), after.splitlines()) if o != n]
    assert len(changed) == 1 and changed[0].lstrip().startswith("CUDA_DEVICE_MAX_CONNECTIONS=1")


# --- shapes in one line each -------------------------------------------------------------

@pytest.mark.parametrize("before, after", [
    ("python -m torch.distributed.launch --use_env tasks/main.py --task MNLI\n",
     "python -m torch.distributed.launch --use_env -m commsched.run tasks/main.py --task MNLI\n"),
    ("mpirun -np 8 python main.py\n", "mpirun -np 8 python -m commsched.run main.py\n"),
    ("python train.py --lr 1\n", "python -m commsched.run train.py --lr 1\n"),
    ("/usr/bin/python3.11 -B pretrain_gpt.py\n", "/usr/bin/python3.11 -B -m commsched.run pretrain_gpt.py\n"),
    ("env -u X torchrun --nproc_per_node=2 a.py\n", "env -u X torchrun --nproc_per_node=2 -m commsched.run a.py\n"),
    ("CMD=(torchrun pretrain_gpt.py)\n", "CMD=(torchrun -m commsched.run pretrain_gpt.py)\n"),
    ("bash -c 'torchrun x.py'\n", "bash -c 'torchrun -m commsched.run x.py'\n"),
    ("export CMD='python -u pretrain_gpt.py'\n", "export CMD='python -u -m commsched.run pretrain_gpt.py'\n"),
    ("python -m pip install x; torchrun a.py && echo ok\n",
     "python -m pip install x; torchrun -m commsched.run a.py && echo ok\n"),
    ("torchrun -m commsched.run -m pkg.train\ntorchrun b.py\n",
     "torchrun -m commsched.run -m pkg.train\ntorchrun -m commsched.run b.py\n"),
])
def test_one_line_shapes(before, after):
    assert patch_script(before) == after


@pytest.mark.parametrize("text", [
    "python tools/preprocess_data.py --input x\n",  # a tool, not training
    "torchrun --no-python ./train.sh\n",  # the entry point is not Python
    "python -c 'import torch' pretrain_gpt.py\n",
    "echo torchrun pretrain_gpt.py\n",
    "cat <<EOF\ntorchrun pretrain_gpt.py\nEOF\n",
    "torchrun $ARGS $SCRIPT\n",  # unquoted variables: launcher options, as far as we can tell
    "cat <<EOF\n${PROFILE} python pretrain_gpt.py\nEOF\n",  # a here-document cat prints
    "sbatch job.sh <<< 'torchrun x.py'\n",  # a here-string is not a script read by sbatch
])
def test_not_a_launch(text):
    with pytest.raises(LaunchPatchError):
        patch_script(text)


# --- the export block ----------------------------------------------------------------------

def test_export_block_follows_sbatch_header_and_comments():
    lines = patch_script(read("srun_python.sh"), {"COMMSCHED": "1"}).splitlines()
    begin = lines.index(next(x for x in lines if x.startswith("# commsched: begin")))
    assert all(x.startswith("#") or not x.strip() for x in lines[:begin])
    assert max(i for i, x in enumerate(lines) if x.startswith("#SBATCH")) < begin
    assert lines[begin + 1] == "export COMMSCHED=1"


def test_rerun_with_other_settings_keeps_the_earlier_ones_in_one_block():
    once = patch_script(read("torchrun_basic.sh"),
                        {"COMMSCHED": "1", "COMMSCHED_POLICY": "fifo"})
    twice = patch_script(once, {"COMMSCHED": "0", "COMMSCHED_VERIFY": "1"})
    assert twice == patch_script(read("torchrun_basic.sh"), {
        "COMMSCHED": "0", "COMMSCHED_POLICY": "fifo", "COMMSCHED_VERIFY": "1"})
    assert split_export_block(twice)[1] == [
        "export COMMSCHED=0", "export COMMSCHED_POLICY=fifo", "export COMMSCHED_VERIFY=1"]


def test_unset_and_reset_drop_earlier_settings():
    once = patch_script(read("torchrun_basic.sh"),
                        {"COMMSCHED": "1", "COMMSCHED_POLICY": "fifo"})
    assert split_export_block(patch_script(once, unset=("COMMSCHED_POLICY",)))[1] == [
        "export COMMSCHED=1"]
    assert split_export_block(patch_script(once, {"COMMSCHED_VERIFY": "1"}, reset=True))[1] \
        == ["export COMMSCHED_VERIFY=1"]
    assert patch_script(once, reset=True) == patch_script(read("torchrun_basic.sh"))
    with pytest.raises(LaunchPatchError, match="--unset COMMSCHED_VERIFY: not exported by an "
                                               "earlier run"):
        patch_script(once, unset=("COMMSCHED_VERIFY",))


@needs_bash
def test_exported_values_reach_the_shell_unchanged(tmp_path):
    value = "a b $HOME 'q' \"d\" `x` \\"
    script = patch_script("#!/bin/bash\ntorchrun a.py\n", {"COMMSCHED_TELEMETRY_DIR": value})
    block = "".join(line for line in script.splitlines(True) if line.startswith("export"))
    out = subprocess.run(["bash", "-c", block + 'printf %s "$COMMSCHED_TELEMETRY_DIR"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == value


@pytest.mark.parametrize("name", ["FOO", "commsched", "COMMSCHEDX", "COMMSCHED_a", "X;rm"])
def test_invalid_setting_name_is_rejected(name):
    with pytest.raises(LaunchPatchError, match="COMMSCHED"):
        patch_script("torchrun a.py\n", {name: "1"})


def test_crlf_script_gets_a_crlf_export_block():
    out = patch_script(read("crlf_mamba.sh"), {"COMMSCHED": "1"})
    assert out.count("\n") == out.count("\r\n")


# --- behaviour: run the patched scripts against fake launchers ----------------------------

FAKE_PROGRAM = r"""#!/bin/sh
printf '%s\0' "$(basename "$0")" "$@" >> "$ARGV_LOG"; printf '\n' >> "$ARGV_LOG"
"""
FAKE_SRUN = r"""#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in --container-image) shift 2;; -*) shift;; *) break;; esac; done
exec "$@"
"""
FAKE_UV = "#!/bin/sh\nshift; while [ \"${1#-}\" != \"$1\" ]; do shift; done; exec \"$@\"\n"
FAKE_SBATCH = "#!/bin/sh\nexec bash -s\n"      # runs the job script it reads at once

# fixture -> argv tail that must follow the inserted `-m commsched.run`
BEHAVIOUR = {
    "torchrun_basic.sh": ["pretrain_gpt.py", "--num-layers", "24"],
    "torchrun_multiline.sh": ["/opt/megatron-lm/pretrain_gpt.py", "--num-layers", "24"],
    "dist_run_bert.sh": ["{dir}/pretrain_bert.py", "--num-layers", "24"],
    "dist_launch_t5.sh": ["./pretrain_t5.py", "--encoder-num-layers", "12"],
    "srun_python.sh": ["/opt/megatron-lm/pretrain_gpt.py", "--num-layers", "24"],
    "run_cmd_eval.sh": ["pretrain_gpt.py", "--num-layers", "2"],
    "sh_c_cmd.sh": ["/opt/megatron-lm/pretrain_gpt.py", "--tensor-model-parallel-size", "8"],
    "torchrun_module.sh": ["-m", "megatron.training.pretrain", "--num-layers", "2"],
    "uv_module.sh": ["-m", "mypkg.train", "--micro-batch-size", "2"],
    "mentions_untouched.sh": ["train_llama.py", "--lr", "3e-4"],
    "torchrun_script_var.sh": ["pretrain_gpt.py", "--num-layers", "96"],
    "sbatch_heredoc_cmd.sh": ["/opt/megatron-lm/pretrain_gpt.py", "--num-layers", "24"],
}


def run_with_fakes(text: str, tmp_path: Path) -> list[list[str]]:
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    for prog, body in [("torchrun", FAKE_PROGRAM), ("python", FAKE_PROGRAM),
                       ("python3", FAKE_PROGRAM), ("srun", FAKE_SRUN), ("uv", FAKE_UV),
                       ("sbatch", FAKE_SBATCH)]:
        (bin_dir / prog).write_text(body)
        (bin_dir / prog).chmod(0o755)
    script, log = work / "launch.sh", tmp_path / "argv.log"
    script.write_text(text)
    log.write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_LOG": str(log), "HOME": str(tmp_path)}
    subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, timeout=60)
    return [line.split("\0")[:-1] for line in log.read_text().splitlines()]


@needs_bash
@pytest.mark.parametrize("name", sorted(BEHAVIOUR))
def test_launcher_receives_commsched_run_before_the_entry_point(name, tmp_path):
    original = run_with_fakes(read(name), tmp_path)
    patched = run_with_fakes(patch_script(read(name)), tmp_path)
    tail = [a.replace("{dir}", str(tmp_path / "work")) for a in BEHAVIOUR[name]]
    want = ["-m", "commsched.run"] + tail
    hits = [(n, k) for n, argv in enumerate(patched) for k in range(len(argv))
            if argv[k:k + len(want)] == want]
    assert len(hits) == 1, patched
    # Apart from those two arguments, every launcher saw exactly what it saw before.
    n, k = hits[0]
    patched[n][k:k + 2] = []
    assert patched == original


# --- command line: through main() and through `python launch_script.py` -----------------

@pytest.fixture(params=["main", "subprocess"])
def cli(request, capsys):
    def run(*argv: str) -> tuple[int, str, str]:
        if request.param == "subprocess":
            proc = subprocess.run([sys.executable, str(MODULE_PATH), *argv],
                                  capture_output=True, text=True, timeout=60)
            return proc.returncode, proc.stdout, proc.stderr
        try:
            code = launch_script.main(list(argv))
        except SystemExit as e:  # argparse errors and --help
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.sh"
    shutil.copy(FIXTURES / "torchrun_basic.sh", path)
    path.chmod(0o751)
    return path


def test_cli_default_prints_the_patched_script(cli, script):
    code, out, _ = cli(str(script))
    assert (code, out) == (0, patch_script(script.read_text()))


def test_cli_check_prints_a_diff_and_changes_nothing(cli, script):
    before = script.read_bytes()
    code, out, _ = cli("--check", "--set", "COMMSCHED=1", str(script))
    assert code == 0 and script.read_bytes() == before
    assert out.startswith(f"--- a/{script}\n+++ b/{script}\n")
    assert "+torchrun $DISTRIBUTED_ARGS -m commsched.run pretrain_gpt.py" in out
    assert "+export COMMSCHED=1\n" in out


def test_cli_check_on_a_patched_script_prints_nothing_and_exits_0(cli, script):
    script.write_text(patch_script(script.read_text()))
    code, out, err = cli("--check", str(script))
    assert (code, out) == (0, "") and "already patched" in err


def test_cli_output_file_gets_the_source_mode(cli, script, tmp_path):
    out_path = tmp_path / "patched.sh"
    code, out, _ = cli(str(script), "-o", str(out_path), "--set", "COMMSCHED=1")
    assert (code, out) == (0, "")
    assert out_path.read_text() == patch_script(script.read_text(), {"COMMSCHED": "1"})
    assert stat.S_IMODE(out_path.stat().st_mode) == 0o751


def test_cli_in_place_keeps_mode_and_leaves_no_temp_file(cli, script, tmp_path):
    expected = patch_script(script.read_text(), {"COMMSCHED_CREDIT_BYTES": "8MiB"})
    code, _, _ = cli("--in-place", "--set", "COMMSCHED_CREDIT_BYTES=8MiB", str(script))
    assert code == 0 and script.read_text() == expected
    assert stat.S_IMODE(script.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.sh"]


@pytest.mark.parametrize("arg", ["FOO=1", "commsched=1", "COMMSCHED"])
def test_cli_rejects_a_bad_set(cli, script, arg):
    before = script.read_bytes()
    code, out, err = cli("--in-place", "--set", arg, str(script))
    assert code == 2 and out == "" and script.read_bytes() == before
    assert "--set" in err and arg in err and "Traceback" not in err


@pytest.mark.parametrize("arg,message", [
    ("COMMSCHED_POLCY=fifo", "COMMSCHED_POLCY: unknown commsched variable; did you mean "
                             "COMMSCHED_POLICY?"),
    ("COMMSCHED_POLICY=nope", "COMMSCHED_POLICY='nope': expected one of priority, fifo"),
    ("COMMSCHED_CREDIT_BYTES=4 MiBs", "COMMSCHED_CREDIT_BYTES='4 MiBs': expected a byte count"),
])
def test_cli_rejects_a_setting_the_job_would_reject(cli, script, arg, message):
    """commsched patch-launch --set COMMSCHED_POLCY=fifo / COMMSCHED_POLICY=nope"""
    before = script.read_bytes()
    code, out, err = cli("--in-place", "--set", "COMMSCHED=1", "--set", arg, str(script))
    assert (code, out) == (2, "") and script.read_bytes() == before
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_cli_rerun_keeps_the_settings_of_the_earlier_run(cli, script):
    assert cli("--in-place", "--set", "COMMSCHED=1", "--set", "COMMSCHED_POLICY=fifo",
               str(script))[0] == 0
    assert cli("--in-place", "--set", "COMMSCHED_CREDIT_BYTES=8MiB", str(script))[0] == 0
    assert split_export_block(script.read_text())[1] == [
        "export COMMSCHED=1", "export COMMSCHED_POLICY=fifo",
        "export COMMSCHED_CREDIT_BYTES=8MiB"]
    assert cli("--in-place", "--unset", "COMMSCHED_POLICY", str(script))[0] == 0
    assert split_export_block(script.read_text())[1] == [
        "export COMMSCHED=1", "export COMMSCHED_CREDIT_BYTES=8MiB"]


def test_cli_missing_script_exits_2_without_traceback(cli, tmp_path):
    missing = tmp_path / "nope.sh"
    code, out, err = cli(str(missing))
    assert (code, out) == (2, "")
    assert str(missing) in err and "No such file" in err and "Traceback" not in err


def test_cli_no_launch_line_exits_2_naming_file_and_shapes(cli, tmp_path):
    path = tmp_path / "prep.sh"
    shutil.copy(FIXTURES / "no_launch.sh", path)
    code, out, err = cli("--in-place", str(path))
    assert (code, out) == (2, "") and path.read_bytes() == (FIXTURES / "no_launch.sh").read_bytes()
    assert str(path) in err and "torchrun [ARGS] SCRIPT.py" in err and "Traceback" not in err


def test_cli_output_and_in_place_are_exclusive(cli, script, tmp_path):
    code, _, err = cli(str(script), "--in-place", "-o", str(tmp_path / "x.sh"))
    assert code == 2 and "not allowed with" in err


def test_cli_help_documents_exit_codes(cli):
    code, out, _ = cli("--help")
    assert code == 0 and "commsched patch-launch" in out and "exit codes" in out


def test_cli_keeps_bytes_that_are_not_utf8(cli, tmp_path):
    path = tmp_path / "latin1.sh"
    path.write_bytes(b"#!/bin/bash\n# caf\xe9\ntorchrun a.py  \n")
    code, _, _ = cli("--in-place", str(path))
    assert code == 0 and path.read_bytes() == b"#!/bin/bash\n# caf\xe9\ntorchrun -m commsched.run a.py  \n"
