"""The data-parallel mode's telemetry: each layer group's all-reduce of every iteration is
recorded with its priority (the group's forward position) and size, step() marks the
iterations, and the run's recorded configuration is the one its lane ran under (the
window of layer groups included). One process, gloo."""

import json

import torch
import torch.nn as nn

import commsched
from commsched.data_parallel import wrap
from commsched.telemetry.store import load_run

STEPS = 5


def test_every_layer_group_all_reduce_is_recorded_with_the_lane_window(world1, tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 2))
    config = commsched.Config(telemetry_dir=str(tmp_path), telemetry_nvml_period_ms=0,
                              groups_in_flight=2)
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), config, group_bytes=0)
    try:
        groups = {str(g.index): g.buffer.numel() * g.buffer.element_size()
                  for g in model._engine.groups}
        window = model._engine.scheduler.config.credit_bytes
        for step in range(STEPS):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        model.close()
    assert len(groups) == 3 and window == 2 * max(groups.values())

    run = load_run(str(tmp_path))
    [row] = run.runs
    assert json.loads(row["config_json"])["credit_bytes"] == window
    assert len(run.rows("app_steps")) == STEPS
    ops = [op for op in run.comm_ops if op["op"] == "all_reduce"]
    by_iteration = {}
    for op in ops:
        assert op["ok"] == 1 and op["num_chunks"] == 1       # whole groups
        assert op["nbytes"] == groups[op["request_key"]]
        assert op["priority"] == int(op["request_key"])
        by_iteration.setdefault(op["iteration"], []).append(op["request_key"])
    assert sorted(by_iteration) == list(range(STEPS))
    assert all(sorted(keys) == sorted(groups) for keys in by_iteration.values())
