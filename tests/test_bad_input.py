"""Bad input to the public entry points: one CommschedError (or one CommschedWarning) that
names the input and the rule, before anything is applied; never a builtin exception from
deep inside, never a setting silently without effect, never a measurement lost."""

import json
import math
import os
import shutil
import sqlite3
import warnings

import pytest
import torch
import torch.distributed as dist

import commsched
from commsched import cli, floor
from commsched.adapter import build_scheduler
from commsched.config import Config
from commsched.data_parallel import drain, wrap
from commsched.hooks.ddp import registered_state
from commsched.inputs import IneffectiveSettingWarning
from commsched.telemetry import nvtx_ranges
from commsched.telemetry.errors import TelemetryError
from commsched.telemetry.store import create_store, load_run
from commsched.telemetry.writer import StoreWriter

from sim import synthetic
from telemetry.helpers import write_run
from tiny_nets import tiny_mlp


def _ddp(net):
    return torch.nn.parallel.DistributedDataParallel(net)


# --- commsched.wrap / drain ---------------------------------------------------------------

def test_wrap_refuses_a_model_that_a_live_wrap_still_owns(world1):
    net = tiny_mlp()
    model, _ = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        with pytest.raises(commsched.CommschedError, match="earlier commsched.wrap"):
            wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        outer = torch.nn.Sequential(net)       # a model holding the wrapped one
        with pytest.raises(commsched.CommschedError, match="submodule Sequential"):
            wrap(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
    finally:
        model.close()
    again, _ = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))   # closed: free again
    again.close()


def test_a_refused_second_wrap_leaves_the_first_training_as_plain_sgd(world1):
    net, reference = tiny_mlp(), tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        with pytest.raises(commsched.CommschedError):
            wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in range(4):       # one rank: the average is the rank's own gradient
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (reference, ref_opt)):
                m(x).square().sum().backward()
                o.step()
                o.zero_grad()
        drain(model)
        for ours, theirs in zip(net.parameters(), reference.parameters()):
            assert torch.equal(ours, theirs)
    finally:
        model.close()


def test_wrap_refuses_an_optimizer_over_another_models_parameters(world1):
    net = tiny_mlp()
    with pytest.raises(commsched.CommschedError,
                       match="4 parameter\\(s\\) that are not the model's"):
        wrap(net, torch.optim.SGD(tiny_mlp().parameters(), lr=0.1))


def test_a_refused_rs_ag_wrap_leaves_the_model_training_as_before(world1):
    """rs_ag needs the optimizer to hold exactly the trainable parameters; refused, the
    model keeps none of the engine's hooks: its gradients are plain autograd's, and it can
    be wrapped again."""
    net, reference = tiny_mlp(), tiny_mlp()
    partial = torch.optim.SGD(list(net.parameters())[:2], lr=0.1)
    with pytest.raises(commsched.CommschedError, match="exactly"):
        wrap(net, partial, Config(decompose="rs_ag"))
    for p in net.parameters():
        assert not p._post_accumulate_grad_hooks and not p._backward_hooks
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    for m in (net, reference):
        m(x).square().sum().backward()
    for ours, theirs in zip(net.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad)
        ours.grad = None
    model, _ = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), Config(decompose="rs_ag"))
    model.close()


def test_wrap_refuses_a_dict_for_a_config(world1):
    net = tiny_mlp()
    with pytest.raises(commsched.ConfigError, match="config=builtins.dict: expected a "
                                                    "commsched.Config"):
        wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), {"decompose": "rs_ag"})


def test_wrap_refuses_what_env_refuses_and_warns_what_env_warns(world1, monkeypatch, capsys):
    net = tiny_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monkeypatch.setenv("COMMSCHED_DECOMPOSE", "rs_ag")
    monkeypatch.setenv("COMMSCHED_GRAD_REDUCE_DTYPE", "bfloat16")
    assert cli.main(["env"]) == 2
    assert ("commsched env: error: COMMSCHED_GRAD_REDUCE_DTYPE=bfloat16 needs "
            "COMMSCHED_DECOMPOSE=none") in capsys.readouterr().err
    with pytest.raises(commsched.ConfigError, match="COMMSCHED_GRAD_REDUCE_DTYPE"):
        wrap(net, opt)
    monkeypatch.delenv("COMMSCHED_DECOMPOSE")
    monkeypatch.delenv("COMMSCHED_GRAD_REDUCE_DTYPE")
    monkeypatch.setenv("COMMSCHED_GROUPS_IN_FLIGHT", "2")
    monkeypatch.setenv("COMMSCHED_CREDIT_BYTES", "4MiB")
    assert cli.main(["env"]) == 0
    err = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert err == ["commsched env: warning: COMMSCHED_GROUPS_IN_FLIGHT=2 has no effect: "
                   "COMMSCHED_CREDIT_BYTES sets a byte window"]
    with pytest.warns(IneffectiveSettingWarning, match="COMMSCHED_GROUPS_IN_FLIGHT=2 has no "
                                                       "effect"):
        model, _ = wrap(net, opt)
    model.close()


def test_groups_in_flight_under_rs_ag_is_named_as_without_effect():
    [line] = commsched.inputs.ineffective_settings(Config(groups_in_flight=2,
                                                          decompose="rs_ag"))
    assert "COMMSCHED_DECOMPOSE=rs_ag" in line
    assert commsched.inputs.ineffective_settings(Config(groups_in_flight=2)) == []


BAD = [None, 1, "not a model", [], {}, object(), torch.zeros(2), torch.nn.Linear]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_wrap_and_drain_answer_every_wrong_kind_with_a_commsched_error(world1, bad):
    net = tiny_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls = [lambda: wrap(bad, opt), lambda: wrap(net, bad), lambda: drain(bad)]
    if bad is not None:
        calls += [lambda: wrap(net, opt, bad), lambda: wrap(net, opt, scheduler=bad),
                  lambda: wrap(net, opt, group=bad), lambda: wrap(net, opt, observer=bad)]
    if bad is not None and not isinstance(bad, int):
        calls.append(lambda: wrap(net, opt, group_bytes=bad))
    for call in calls:
        with pytest.raises(commsched.CommschedError):
            call()


# --- commsched.hooks.register -----------------------------------------------------------

def test_register_refuses_a_dict_for_a_config_and_unknown_arguments(world1):
    ddp = _ddp(tiny_mlp())
    with pytest.raises(commsched.ConfigError, match="config=builtins.dict"):
        commsched.hooks.register(ddp, {"partition_bytes": 1 << 20})
    with pytest.raises(commsched.ConfigError, match="unexpected argument\\(s\\) partition"):
        commsched.hooks.register(ddp, partition_bytes=1 << 20)
    assert registered_state(ddp) is None


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_register_answers_every_wrong_kind_with_a_commsched_error(world1, bad):
    ddp = _ddp(tiny_mlp())
    calls = [lambda: commsched.hooks.register(bad)]
    if bad is not None:
        calls += [lambda: commsched.hooks.register(ddp, bad),
                  lambda: commsched.hooks.register(ddp, scheduler=bad),
                  lambda: commsched.hooks.register(ddp, group=bad),
                  lambda: commsched.hooks.register(ddp, observer=bad)]
    for call in calls:
        with pytest.raises(commsched.CommschedError):
            call()
    assert registered_state(ddp) is None


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_state_built_directly_answers_every_wrong_kind_with_a_commsched_error(world1, bad):
    from commsched.hooks import CommschedState

    ddp = _ddp(tiny_mlp())
    calls = [lambda: CommschedState(bad)]
    if bad is not None:
        calls += [lambda: CommschedState(ddp, bad), lambda: CommschedState(ddp, scheduler=bad),
                  lambda: CommschedState(ddp, group=bad),
                  lambda: CommschedState(ddp, observer=bad)]
    for call in calls:
        with pytest.raises(commsched.CommschedError):
            call()


def test_a_state_built_directly_names_a_destroyed_group(world1):
    from commsched.hooks import CommschedState

    group = dist.new_group([0])
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_mlp(), process_group=group)
    dist.destroy_process_group(group)
    with pytest.raises(commsched.CommschedError,
                       match="CommschedState: process group .* cannot be used .destroyed"):
        CommschedState(ddp)


def test_register_refuses_a_model_whose_process_group_was_destroyed(world1):
    group = dist.new_group([0])
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_mlp(), process_group=group)
    dist.destroy_process_group(group)
    with pytest.raises(commsched.CommschedError, match="cannot be used .destroyed"):
        commsched.hooks.register(ddp)
    assert registered_state(ddp) is None


def test_a_group_destroyed_after_register_is_named_at_the_first_backward(world1):
    group = dist.new_group([0])
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_mlp(), process_group=group)
    state = commsched.hooks.register(ddp)
    dist.destroy_process_group(group)
    try:
        with pytest.raises(commsched.CommschedError, match="cannot be used .destroyed"):
            ddp(torch.randn(3, 4)).sum().backward()
    finally:
        state.close()


# --- settings ------------------------------------------------------------------------------

def test_a_tiny_partition_size_from_the_environment_gets_one_warning():
    with pytest.warns(commsched.CommschedWarning, match="COMMSCHED_PARTITION_BYTES=1: "):
        Config.from_env({"COMMSCHED_PARTITION_BYTES": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Config.from_env({"COMMSCHED_PARTITION_BYTES": "4MiB"}).partition_bytes == 4 << 20


def test_nvtx_without_a_backend_gets_one_warning(monkeypatch):
    monkeypatch.setattr(nvtx_ranges, "_impl", dict(nvtx_ranges._select(), name="none"))
    with pytest.warns(commsched.CommschedWarning, match="COMMSCHED_NVTX=1 has no effect"):
        scheduler, _ = build_scheduler(Config(nvtx=True))
    scheduler.close()


# --- commsched floor -----------------------------------------------------------------------

@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def _result(own, options, target):
    times = {"compute": 10.0, "comm": 5.0, "hook": 12.5}
    per_mode = {m: [{"ms_per_iteration": t, "collectives": 1, "backwards": 1, "layout": [
        {"bytes": 1024, "dtype": "float32"}]}] for m, t in times.items()}
    return floor.summarize(per_mode, own, target)


def test_floor_refuses_an_unwritable_save_path_before_any_launch(tmp_path, script,
                                                                 monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(floor, "measure", lambda *a: launched.append(a))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert floor.main(["--save", str(blocker / "run"), "--nproc-per-node", "1", script]) == 2
    assert f"--save '{blocker / 'run'}': {blocker} is not a directory" in capsys.readouterr().err
    assert launched == []


def test_floor_prints_its_measurement_when_the_save_fails(tmp_path, script, monkeypatch,
                                                          capsys):
    save = tmp_path / "run"

    def measure(own, options, target):     # the path is taken while the launches run
        save.write_text("")
        return _result(own, options, target)

    monkeypatch.setattr(floor, "measure", measure)
    assert floor.main(["--save", str(save), "--nproc-per-node", "1", script]) == 1
    out, err = capsys.readouterr()
    assert "efficiency         80.0%" in out and "floor              10.00" in out
    assert err.startswith(f"commsched floor: error: --save '{save}': not saved: ")


@pytest.mark.parametrize("doc, why", [
    ([1, 2], "holds a JSON list, not a commsched.floor/1 object"),
    ({"schema": "commsched.floor/1", "compute_only_ms": math.nan, "comm_only_ms": 1.0},
     "compute_only_ms=nan: expected a finite number > 0 (ms)"),
    ({"schema": "commsched.floor/1", "compute_only_ms": 2.0, "comm_only_ms": "inf"},
     "comm_only_ms='inf': expected a finite number >= 0 (ms)"),
])
def test_a_floor_file_that_is_no_floor_is_named_and_not_used(tmp_path, doc, why):
    path = tmp_path / "floor.json"
    path.write_text(json.dumps(doc))        # (json writes NaN as NaN)
    result, note = floor.load_floor(str(tmp_path))
    assert result is None
    assert note == f"{path} not used: {why}"


# --- run directories ---------------------------------------------------------------------

def _mix_two_launches(tmp_path):
    """rank 0 of launch a and rank 1 of launch b, started 105 s later, in one directory."""
    stores = {}
    for rank, name, start in ((0, "20261128-100000-000", 0), (1, "20261128-100145-000", 105)):
        path = write_run(str(tmp_path / name), rank, [], start_ns=synthetic.T0 + start * 10**9)
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE runs SET config_json = ?",
                         (json.dumps({"telemetry_dir": f"runs/{name}"}),))
        stores[rank] = path
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for rank, path in stores.items():
        shutil.copy(path, mixed / f"rank{rank}.sqlite")
    return str(mixed)


def test_stores_of_two_launches_in_one_run_directory_are_refused(tmp_path, capsys):
    mixed = _mix_two_launches(tmp_path)
    with pytest.raises(TelemetryError, match="come from 2 different launches .rank.s. 0: run "
                                             "20261128-100000-000, world size 2, started "
                                             "\\+0.0 s; rank.s. 1: run 20261128-100145-000, "
                                             "world size 2, started \\+105.0 s"):
        load_run(mixed)
    for argv in (["report", mixed], ["trace", mixed, "-o", str(tmp_path / "t.json")],
                 ["simulate", mixed, "--world-size", "8", "--bandwidth", "10"]):
        assert cli.main(argv) != 0
        assert "different launches" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "t.json")


def test_stores_of_two_world_sizes_are_refused(tmp_path):
    write_run(str(tmp_path), 0, [], world_size=2)
    write_run(str(tmp_path), 1, [], world_size=4)
    with pytest.raises(TelemetryError, match="world size 2.*world size 4"):
        load_run(str(tmp_path))


def test_simulate_names_the_store_it_skipped(tmp_path, capsys):
    run_dir = synthetic.write_run(str(tmp_path / "run"))
    (tmp_path / "run" / "rank1.sqlite").write_bytes(b"\x01" * 4096)
    assert cli.main(["simulate", run_dir, "--world-size", "8", "--bandwidth", "10"]) == 0
    assert f"skipped {tmp_path / 'run' / 'rank1.sqlite'}: cannot open" in capsys.readouterr().out


@pytest.mark.parametrize("size", [0, 100])
def test_a_store_cut_short_as_it_was_created_is_called_so(tmp_path, size):
    good = synthetic.write_run(str(tmp_path / "good"))
    (tmp_path / "cut").mkdir()
    with open(os.path.join(good, "rank0.sqlite"), "rb") as f:
        (tmp_path / "cut" / "rank0.sqlite").write_bytes(f.read()[:size])
    with pytest.raises(TelemetryError, match="cut short as it was created"):
        load_run(str(tmp_path / "cut"))


def test_a_store_at_its_size_cap_names_the_cap_not_the_disk(tmp_path):
    cap = 64 << 10
    conn = create_store(str(tmp_path / "rank0.sqlite"), max_bytes=cap)
    writer = StoreWriter(conn, 0)
    writer.max_bytes = cap

    def fill():
        for i in range(10_000):
            conn.execute("INSERT INTO meta VALUES (?, ?)", (f"k{i}", "x" * 512))
        return True

    with pytest.warns(commsched.CommschedWarning, match="COMMSCHED_TELEMETRY_MAX_BYTES=65536"):
        assert not writer._guarded(fill)
    assert "the disk is not full" in writer.failed
    conn.close()
