"""Nothing silent (commsched.unused): under ``COMMSCHED=1 python -m commsched.run``, a
process that takes optimizer steps without giving commsched anything to schedule warns
once, at its 10th step or at exit if it took fewer; one that hooked a DDP model, or took
no step, says nothing."""

import os
import subprocess
import sys

import pytest

from distributed import free_port

WARNING = "CommschedWarning: commsched: COMMSCHED=1, but "
SCRIPT = """
import sys, torch, torch.distributed as dist
steps, ddp = int(sys.argv[1]), sys.argv[2] == "ddp"
if "other_hook" in sys.argv[3:]:     # a global step hook of the script's own (a profiler's)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(lambda opt, args, kwargs: None)
model = torch.nn.Linear(4, 1)
if ddp:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(steps):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    print("step", step + 1, file=sys.stderr, flush=True)
print("end", file=sys.stderr, flush=True)
"""


def _run(tmp_path, steps, ddp, *extra):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(port=free_port()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    proc = subprocess.run([sys.executable, "-m", "commsched.run", str(script), str(steps),
                           "ddp" if ddp else "plain", *extra], env={**env, "COMMSCHED": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    return [(i, line) for i, line in enumerate(lines) if WARNING in line], lines


def test_a_single_process_says_so_once_at_its_10th_optimizer_step(tmp_path):
    warned, lines = _run(tmp_path, 12, ddp=False)
    assert len(warned) == 1, lines
    index, line = warned[0]
    # (during the 10th step: the script prints a step once it returned)
    assert [l for l in lines[:index] if l.startswith("step")] == [
        f"step {n}" for n in range(1, 10)]
    assert ("by its 10th optimizer step this process gave commsched nothing to schedule: "
            "torch.distributed was never initialised: it ran as a single process") in line


@pytest.mark.parametrize("ddp", [False, True])
def test_the_step_count_leaves_other_global_step_hooks_alone(tmp_path, ddp):
    """torch calls the global step hooks while it iterates over them: the count must
    not remove its own hook there, or a step with another global hook registered fails
    ("OrderedDict mutated during iteration")."""
    warned, lines = _run(tmp_path, 12, ddp, "other_hook")
    assert "step 12" in lines and "end" in lines
    assert len(warned) == (0 if ddp else 1), lines


def test_fewer_steps_say_so_at_exit(tmp_path):
    warned, lines = _run(tmp_path, 3, ddp=False)
    assert len(warned) == 1, lines
    index, line = warned[0]
    assert "end" in lines[:index]
    assert "in the 3 optimizer steps it took this process gave commsched nothing" in line


@pytest.mark.parametrize("steps, ddp", [(12, True), (0, False)])
def test_a_hooked_model_or_no_training_says_nothing(tmp_path, steps, ddp):
    warned, lines = _run(tmp_path, steps, ddp)
    assert warned == [], lines
