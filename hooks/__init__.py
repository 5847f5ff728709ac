"""DDP communication hooks that route gradient buckets through the commsched scheduler.

Example::
    state = commsched.hooks.register(ddp_model)          # one line
    # or: ddp_model.register_comm_hook(commsched.hooks.CommschedState(ddp_model), commsched.hooks.commsched_hook)
"""

from .ddp import (CommschedState, HookConflictError, HookStateError, NotDDPError,
                  commsched_hook, register)

__all__ = ["CommschedState", "commsched_hook", "register", "HookConflictError", "NotDDPError",
           "HookStateError"]
