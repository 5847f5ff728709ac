"""Lightning's own convention on one CUDA GPU, as docs/integrations.md gives it:
``DDPStrategy(ddp_comm_state=CommschedState(module), ddp_comm_hook=commsched_hook)`` puts
commsched's hook on Lightning's DDP model and trains to the losses of stock
``DDPStrategy()``; ``ddp_comm_state=None`` ends with the HookStateError saying what to
pass. (On CPU Lightning registers no comm hook: tests/test_lightning.py covers the
launcher there.) Runs only where a GPU is visible."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU: Lightning registers comm hooks on CUDA only")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "integrations", "lightning_train.py")


def _run(tmp_path, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    proc = subprocess.run([sys.executable, SCRIPT, "--accelerator", "gpu", "--devices", "1",
                           "--out", str(tmp_path / "out"), *extra], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    path = tmp_path / "out.rank0.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def test_the_documented_state_registers_the_hook_and_trains_as_stock(tmp_path):
    (tmp_path / "stock").mkdir()
    (tmp_path / "convention").mkdir()
    _, stock = _run(tmp_path / "stock")
    proc, convention = _run(tmp_path / "convention", "--comm-state", "commsched")
    assert convention is not None, proc.stderr[-3000:]
    assert stock["hooks"] == [] and convention["hooks"] == ["commsched_hook"]
    assert convention["losses"] == stock["losses"]


def test_no_state_is_the_error_that_says_what_to_pass(tmp_path):
    proc, _ = _run(tmp_path, "--comm-state", "none")
    assert proc.returncode != 0
    assert ("HookStateError: commsched_hook: the hook's state must be a "
            "commsched.hooks.CommschedState, got None") in proc.stderr, proc.stderr[-3000:]
    assert "DDPStrategy(ddp_comm_state=CommschedState(lightning_module)" in proc.stderr
