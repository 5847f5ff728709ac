"""NVTX helpers never fail, with or without a profiler attached."""

from commsched.config import Config
from commsched.telemetry import nvtx_range_pop, nvtx_range_push, open_recorder
from commsched.telemetry import nvtx_ranges

from .helpers import iteration


def test_push_pop_and_ranges_are_safe_without_a_profiler():
    assert nvtx_ranges.backend() in ("torch.cuda.nvtx", "nvtx", "none")
    nvtx_range_push("commsched all_reduce bucket0#0")
    nvtx_range_pop()
    handle = nvtx_ranges.range_start("commsched iteration 0")
    nvtx_ranges.range_end(handle)
    nvtx_ranges.mark("flush")


def test_recorder_with_nvtx_marks_iterations(tmp_path):
    rec = open_recorder(Config(telemetry_dir=str(tmp_path), nvtx=True), rank=0, world_size=1,
                        nvml_period_ms=0)
    rec.on_iteration(iteration())
    rec.step()
    rec.step()
    rec.close()
