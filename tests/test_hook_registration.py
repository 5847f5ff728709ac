"""commsched.hooks.register on what it is given: a DistributedDataParallel without a hook
(registered), with commsched's (the same state back when nothing else is asked; an error
naming the conflict otherwise), with another hook (an error naming it), or something else
(an error saying what was expected). One gloo rank, in-process."""

import warnings

import pytest
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched
import commsched.hooks
from commsched import Config
from commsched.hooks import HookConflictError, NotDDPError


def _ddp():
    return DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))


def _register(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", commsched.CommschedWarning)
        return commsched.hooks.register(*args, **kwargs)


def test_registering_twice_returns_the_first_state(world1):
    model = _ddp()
    state = _register(model, Config(partition_bytes=1024))
    try:
        assert _register(model) is state
        assert _register(model, Config(partition_bytes=1024)) is state
        assert [h for h, _ in model._comm_hooks] == [commsched.hooks.commsched_hook]
    finally:
        state.close()


def test_registering_again_with_other_settings_is_an_error_that_says_so(world1):
    model = _ddp()
    state = _register(model, Config())
    try:
        with pytest.raises(HookConflictError, match="already has the commsched hook, "
                                                    "registered with other settings"):
            _register(model, Config(partition_bytes=1024))
        with pytest.raises(commsched.CommschedError):
            _register(model, Config(), group=None)
    finally:
        state.close()


@pytest.mark.parametrize("hook", [default_hooks.allreduce_hook,
                                  default_hooks.fp16_compress_hook])
def test_a_model_with_another_hook_is_an_error_naming_it(world1, hook):
    model = _ddp()
    model.register_comm_hook(None, hook)
    with pytest.raises(HookConflictError, match=f"already has the comm hook {hook.__name__}"):
        _register(model)
    assert [h for h, _ in model._comm_hooks] == [hook]


def test_a_plain_module_is_an_error_naming_what_was_expected():
    with pytest.raises(NotDDPError, match="expected a torch.nn.parallel."
                                          "DistributedDataParallel, got torch.nn.modules."
                                          "linear.Linear") as caught:
        commsched.hooks.register(nn.Linear(4, 2))
    assert isinstance(caught.value, TypeError)
    assert isinstance(caught.value, commsched.CommschedError)
