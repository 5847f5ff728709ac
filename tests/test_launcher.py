"""The launcher on an unmodified script: off means off, on registers the hook."""

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "scripts", "train_ddp.py")


def _torchrun(log_dir, env_overrides, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update(env_overrides)
    # --log-dir: torchrun's per-launch directory goes there, not to a fresh one in /tmp.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "--log-dir", str(log_dir), "-m", "commsched.run", SCRIPT, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    # The head has what the ranks printed; the tail, torchrun's summary of who failed.
    assert proc.returncode == 0, proc.stderr[:2000] + "\n[...]\n" + proc.stderr[-2000:]
    lines = sorted(l for l in proc.stdout.splitlines() if l.startswith("rank="))
    assert len(lines) == 2, proc.stdout + proc.stderr[-2000:]
    return lines


def _field(line, name):
    return re.search(rf"{name}=(\[.*?\]|\S+)", line).group(1)


def test_off_leaves_ddp_untouched_and_on_registers_the_hook(tmp_path):
    off = _torchrun(tmp_path, {"COMMSCHED": "0"}, "--lr", "0.1")
    for line in off:
        assert _field(line, "hooks") == "[]"
        assert _field(line, "patched") == "False"
        assert "argv=['--lr', '0.1']" in line          # arguments reach the script
    on = _torchrun(tmp_path, {"COMMSCHED": "1", "COMMSCHED_PARTITION_BYTES": "1KiB",
                              "COMMSCHED_CREDIT_BYTES": "4KiB"})
    for line in on:
        assert _field(line, "hooks") == "['commsched.hooks.ddp.CommschedState']"
        assert _field(line, "patched") == "True"
    # Same training result with and without the scheduler (2 ranks: bitwise).
    assert {_field(l, "checksum") for l in off} == {_field(l, "checksum") for l in on}


def test_unset_is_off(tmp_path):
    noop = tmp_path / "noop.py"
    noop.write_text("pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    code = ("import commsched.run as r; "
            "from torch.nn.parallel import DistributedDataParallel as D; "
            f"before = D.__init__; r.main([{str(noop)!r}]); print(D.__init__ is before)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("True")


def test_missing_script_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "commsched.run", "/nonexistent/train.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "SCRIPT '/nonexistent/train.py' is not a file" in proc.stderr
