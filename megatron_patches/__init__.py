"""commsched for Megatron-LM: megatron-core patches and the launch-script patcher.

``apply()`` routes the gradient syncs (all-reduce, or reduce-scatter with the distributed
optimizer) and parameter all-gathers of megatron-core's DDP bucket groups through one
commsched :class:`~commsched.Scheduler` per process; ``remove()`` restores megatron's
methods. ``apply_on_import()`` defers ``apply()`` until megatron-core is imported; the
launcher (``python -m commsched.run pretrain_gpt.py ...`` with ``COMMSCHED=1``) calls it,
so Megatron-LM needs no change. ``commsched patch-launch`` (``launch_script.py``) rewrites a
launch script to start training under that launcher.

Supported megatron-core series and what each patched method must look like:
:data:`SUPPORTED` (``versions.py``). How the calls map onto the scheduler, iterations,
priorities and fallbacks: ``bucket_group.py``.

Example::
    import commsched.megatron_patches as mp
    mp.apply(commsched.Config(partition_bytes=4 << 20))   # before megatron's DDP is built
"""

from .install import apply, apply_on_import, current_runtime, is_applied, remove
from .versions import SUPPORTED, UnsupportedMegatronVersion, megatron_version

__all__ = ["apply", "remove", "apply_on_import", "is_applied", "current_runtime",
           "SUPPORTED", "UnsupportedMegatronVersion", "megatron_version"]
