"""The GPU self-check's driver and comparison, run on CPU with a fake NVML whose counters
move exactly the ring all-reduce payload."""

import pytest
import torch

from commsched.config import Config
from commsched.telemetry import open_recorder
from commsched.telemetry.nvml import FakeGpu, FakeLink, FakeNvmlBackend
from commsched.telemetry.selfcheck import compare, drive_allreduces, nvlink_allreduce_check

WORLD = 2


def test_windows_hold_exactly_one_allreduce_each(tmp_path):
    moved_kib = {"data": 0}

    def counters(gpu, link, name, read):
        # two links share the traffic evenly; RAW is DATA + 25% protocol overhead
        per_link = moved_kib["data"] // 2
        return per_link * 5 // 4 if name.startswith("raw") else per_link

    def fake_all_reduce(x):
        # ring all-reduce payload of one rank: 2 (n-1)/n * bytes, sent and received
        moved_kib["data"] += int(2 * (WORLD - 1) / WORLD * x.numel() * 4) // 1024

    backend = FakeNvmlBackend([FakeGpu(links=[FakeLink(), FakeLink()])], counter_fn=counters)
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=WORLD,
                        device=0, nvml_backend=backend, nvml_period_ms=1000)
    sizes = [64 << 10, 1 << 20]
    planned = drive_allreduces(
        rec, sizes, iters=3, warmup=2, group_ranks=(0, 1),
        make_tensor=lambda size: torch.ones(size // 4), all_reduce=fake_all_reduce,
        synchronize=lambda: None, barrier=lambda: None)
    rec.close()
    # step 0 = start, step 1 closes the warm-up of size 1, steps 2-4 its all-reduces,
    # step 5 the warm-up of size 2, steps 6-8 its all-reduces
    assert [p["step"] for p in planned] == [2, 3, 4, 6, 7, 8]
    out = compare(str(tmp_path), 0, WORLD, planned, sizes)
    assert out["nvml_status"] == "ok" and out["ok"]
    for r in out["results"]:
        assert r["data_tx_bytes"] == r["expected_bytes"] == r["size"]
        assert r["ratio_tx"] == pytest.approx(1.0) and r["ratio_rx"] == pytest.approx(1.0)
        assert r["raw_tx_bytes"] == pytest.approx(1.25 * r["size"])
        assert r["link_tx_bytes"] == {0: r["size"] // 2, 1: r["size"] // 2}


def test_needs_cuda():
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        nvlink_allreduce_check([1 << 20], 1)
