"""Telemetry through the real scheduler: 2 gloo processes, DDP + the commsched hook."""

import json

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import commsched.hooks
from commsched.config import Config
from commsched.telemetry import load_run, report_main, step, trace_main

from distributed import run_workers    # tests/ is on sys.path (tests/conftest.py)

from .test_trace import slices_nest_per_thread, validate_trace_event_format

ITERS = 5
TABLES = {"runs", "intra_node_topo", "nvlink_metrics", "nvlink_health", "comm_ops",
          "iterations", "iteration_links", "app_steps"}


def _train(rank, world_size, runs):
    """One DDP training run per (run_dir, decompose), in the same process group (spawning
    processes is what costs time here)."""
    for run_dir, decompose in runs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        # ~10 KB of gradients cut into 2 KiB chunks under an 8 KiB credit window: several
        # chunks per iteration, some in flight together.
        ddp = DistributedDataParallel(model)
        config = Config(enabled=True, telemetry_dir=run_dir, partition_bytes=2048,
                        credit_bytes=8192, decompose=decompose)
        state = commsched.hooks.register(ddp, config)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(ITERS):
            ddp(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            step()
        state.scheduler.drain(timeout=30)
        state.scheduler.close()
        state.recorder.close()


RUNS = {"none": 1, "rs_ag": 2}      # decompose -> collective steps per chunk


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    runs = [(str(base / decompose), decompose) for decompose in RUNS]
    run_workers(_train, 2, runs, timeout=120)
    return dict((d, r) for r, d in runs)


@pytest.mark.parametrize("decompose", list(RUNS))
def test_every_chunk_step_and_iteration_is_stored(run_dirs, decompose):
    run = load_run(run_dirs[decompose])
    assert set(run.tables) == TABLES | {"topology"}
    assert run.ranks == [0, 1]
    for rank in (0, 1):
        assert run.rows("runs", rank)[0]["nvml_status"] == "no_gpu"
        its = run.rows("iterations", rank)
        assert [i["iteration"] for i in its] == list(range(ITERS))
        assert all(i["complete"] == 1 for i in its)
        ops = run.rows("comm_ops", rank)
        # one row per chunk step: every chunk of every iteration, each step once
        keys = [(o["iteration"], o["request_key"], o["chunk_index"], o["step"]) for o in ops]
        assert len(keys) == len(set(keys))
        assert len(ops) == RUNS[decompose] * sum(i["chunks"] for i in its)
        assert all(o["ok"] == 1 and o["group_size"] == 2 for o in ops)
        assert [s["step"] for s in run.rows("app_steps", rank)] == list(range(ITERS))


def test_report_and_trace_work_on_a_real_run(run_dirs, tmp_path, capsys):
    run_dir = run_dirs["rs_ag"]
    assert report_main([run_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 2 * ITERS
    assert all(r["comm_ms"] > 0 and r["bytes"] > 0 for r in report["rows"])
    out = tmp_path / "trace.json"
    assert trace_main([run_dir, "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    validate_trace_event_format(trace)
    slices_nest_per_thread(trace["traceEvents"])
    comm = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"]
    assert len(comm) == len(load_run(run_dir).comm_ops)


@pytest.mark.parametrize("decompose", list(RUNS))
def test_report_names_the_topology_and_the_decomposition_in_effect(run_dirs, decompose,
                                                                  capsys):
    run = load_run(run_dirs[decompose])
    assert report_main([run_dirs[decompose], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the workers get no LOCAL_WORLD_SIZE: both ranks on one node
    assert (report["topology"]["nodes"], report["topology"]["local_ranks"]) == (1, 2)
    decomposition = report["decomposition"]
    assert decomposition["configured"] == decompose and decomposition["auto"] == {}
    # every all-reduce ran with the configured decomposition: per lane, rank 0's requests
    # and chunks as its iteration records count them
    its = run.rows("iterations", 0)
    assert decomposition["in_effect"] == {lane: {decompose: {
        "requests": sum(i["requests"] for i in its if i["lane"] == lane),
        "chunks": sum(i["chunks"] for i in its if i["lane"] == lane),
        "bytes": sum(i["nbytes"] for i in its if i["lane"] == lane)}}
        for lane in {i["lane"] for i in its}}
