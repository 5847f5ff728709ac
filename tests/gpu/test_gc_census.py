"""CUDA + NCCL, one GPU: what a training iteration leaves to Python's cycle collector
([Note: no cycles on the hot path] in docs/design.md), against stock DDP measured in the
same process. The CPU tests (tests/test_no_cycles.py) measure gloo and fake CUDA; this is
the real CUDA path (futures issued at once, their per-bucket callbacks).

Runs only where a GPU is visible; on CPU-only CI it is skipped."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (NCCL); run on the GPU machine")

CHILD = os.path.join(os.path.dirname(__file__), "gc_census_child.py")
HOOK_ABOVE_STOCK = 2           # as tests/test_no_cycles.py allows the hook
DATA_PARALLEL_MOST = 6         # as tests/test_no_cycles.py allows the data-parallel mode


def test_an_iteration_on_nccl_leaves_the_collector_no_more_than_stock_plus_a_constant():
    proc = subprocess.run([sys.executable, CHILD], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    stock, hook, dp = seen["stock_ddp"], seen["hook"], seen["data_parallel"]
    assert hook["per_iteration"] <= stock["per_iteration"] + HOOK_ABOVE_STOCK, seen
    assert dp["per_iteration"] <= DATA_PARALLEL_MOST, seen
    assert stock["survivors"] == hook["survivors"] == dp["survivors"] == 0, seen
    # every bucket's future resolved through its callback, and no buffer is held after
    assert hook["callbacks"] > 0 and hook["held_buffers"] == 0, seen
