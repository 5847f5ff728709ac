"""The harness with data-parallel modes whose own process groups take NCCL options: is
capping the CTAs of the scheduler's background gradient traffic, or giving it a
high-priority stream, worth a setting?

    python examples/bench/dp_nccl_options.py --model gpt2_lib --regime host --rounds 2 \\
        --modes compute_only,ddp_default,commsched_dp,commsched_dp_cta2,commsched_dp_hp

Every ``harness.py`` option applies. The added modes run ``commsched.wrap`` as mode 6 does,
except that the process groups the data-parallel mode creates for itself (its gradient
reduction, and the all-gathers of rs_ag) are created with
``ProcessGroupNCCL.Options``:

  commsched_dp_cta{1,2,4,8,16}   ``config.max_ctas`` = N (and ``min_ctas`` 1): at most N
                                 CTAs per collective of those groups
  commsched_dp_hp                ``is_high_priority_stream``: the groups' NCCL stream at
                                 the device's highest priority

They are n/a on gloo. The measurement that decided against such a setting:
``benchmarks/archive/dp_nccl_options_2xH100_2026-11-28.md``.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

import harness
from benchlib import ModeUnavailable

CTA_CAPS = (1, 2, 4, 8, 16)

_options = {"max_ctas": 0, "high_priority": False}


def _engine_modules():
    harness.benchlib.import_commsched()
    import commsched.data_parallel.engine as engine
    import commsched.data_parallel.zero as zero

    return engine, zero


def _sibling_group_with_options(original):
    """``commsched.data_parallel.engine.sibling_group``, with the options of the running mode."""
    def sibling_group(group):
        if not (_options["max_ctas"] or _options["high_priority"]):
            return original(group)
        options = dist.ProcessGroupNCCL.Options()
        if _options["max_ctas"]:
            options.config.min_ctas = 1
            options.config.max_ctas = _options["max_ctas"]
        options.is_high_priority_stream = _options["high_priority"]
        if group is None:
            return dist.new_group(pg_options=options)
        return dist.new_group(dist.get_process_group_ranks(group), pg_options=options,
                              use_local_synchronization=True)
    return sibling_group


def _install() -> None:
    engine, zero = _engine_modules()
    if getattr(engine.sibling_group, "_nccl_options", False):
        return
    replacement = _sibling_group_with_options(engine.sibling_group)
    replacement._nccl_options = True
    engine.sibling_group = zero.sibling_group = replacement


def _mode(max_ctas: int = 0, high_priority: bool = False):
    def run(bench):
        if bench.backend != "nccl":
            raise ModeUnavailable("NCCL process-group options (needs GPUs)")
        _install()
        _options.update(max_ctas=max_ctas, high_priority=high_priority)
        try:
            return harness.run_commsched_dp(bench)
        finally:
            _options.update(max_ctas=0, high_priority=False)
    return run


def add_modes() -> None:
    """Add the modes after the harness's own (run order = table order). Runs in the parent
    and, as the spawned workers' main module, in each worker."""
    if any(m.name == "commsched_dp_hp" for m in harness.MODES):
        return
    extra = [harness.Mode(f"commsched_dp_cta{n}", f"6 as 6, NCCL max_ctas {n} on its own "
                          "groups", _mode(max_ctas=n)) for n in CTA_CAPS]
    extra.append(harness.Mode("commsched_dp_hp", "6 as 6, its own groups' NCCL stream at "
                              "high priority", _mode(high_priority=True)))
    harness.MODES.extend(extra)
    harness.MODE_NAMES[:] = [m.name for m in harness.MODES]


add_modes()

if __name__ == "__main__":
    sys.exit(harness.main())
