"""The DDP hook's state, as Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)`` takes it: a ``CommschedState`` built from the module before
torch.distributed starts builds its scheduler at the first bucket and trains as stock DDP
does; a state that is not a ``CommschedState`` is a ``HookStateError`` (a
``CommschedError``) that says what to pass, never an AttributeError. One gloo rank,
in-process; the launcher's registration in a subprocess."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched
from commsched.hooks import CommschedState, HookStateError, commsched_hook
from distributed import free_port

SAYS_WHAT_TO_PASS = ("in Lightning pass DDPStrategy(ddp_comm_state=CommschedState("
                     "lightning_module), ddp_comm_hook=commsched_hook)")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def uninitialised():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_state_built_before_the_process_group_builds_its_scheduler_at_the_first_bucket(
        uninitialised):
    module = _model()
    state = CommschedState(module)              # (as DDPStrategy(ddp_comm_state=...) takes it)
    assert state.deferred is not None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    hooked = DDP(module)
    hooked.register_comm_hook(state, commsched_hook)
    try:
        got = _train(hooked)
        assert state.deferred is None and isinstance(state.scheduler, commsched.Scheduler)
        assert state.scheduler.stats()["chunks"] > 0
    finally:
        state.close()
    expected = _train(DDP(_model()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("state, named", [(None, "got None"),
                                          ({"scheduler": 1}, "got builtins.dict")])
def test_a_state_that_is_not_a_commsched_state_is_an_error_saying_what_to_pass(
        world1, state, named):
    model = DDP(_model())
    model.register_comm_hook(state, commsched_hook)
    with pytest.raises(HookStateError) as err:
        model(torch.randn(4, 8)).sum().backward()
    assert isinstance(err.value, commsched.CommschedError)
    assert named in str(err.value) and SAYS_WHAT_TO_PASS in str(err.value)


def test_under_the_launcher_the_wrong_state_is_refused_at_registration(tmp_path):
    script = tmp_path / "register_none.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from commsched.hooks import commsched_hook, HookStateError\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', "
        "rank=0, world_size=1)\n"
        "model = DDP(torch.nn.Linear(4, 2))\n"
        "try:\n"
        "    model.register_comm_hook(None, commsched_hook)\n"
        "except HookStateError as exc:\n"
        "    print('refused:', exc)\n"
        "print('hooks:', len(model._comm_hooks))\n")
    proc = subprocess.run([sys.executable, "-m", "commsched.run", str(script)],
                          env={**_env(), "COMMSCHED": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused: commsched_hook: the hook's state must be a " in proc.stdout
    assert SAYS_WHAT_TO_PASS in proc.stdout
    assert proc.stdout.strip().endswith("hooks: 0")


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
