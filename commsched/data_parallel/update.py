"""Per-layer-group optimizer updates with the hyper-parameters of the step that asked.

``optimizer.step()`` in the data-parallel mode records a ``StepRecord`` (a copy of every param
group's hyper-parameters at that moment) and returns; each layer group is updated later,
once its gradients arrived, by calling the *real* optimizer's ``step()`` on that group's
parameters only. The optimizer's ``param_groups`` are swapped for the duration of the call:

  real param_groups   [{lr: 0.1, params: [w0 b0 w1 b1 w2]}, {lr: 0.1, wd: 0, params: [...]}]
  update of group g1  [{lr: <recorded>, params: [w1 b1]}, {lr: <recorded>, wd: 0, params: [...]}]

State (``optimizer.state``, keyed by parameter) is shared, so for an optimizer whose update
of a parameter depends only on that parameter's gradient and state — every torch.optim
optimizer except LBFGS, foreach and fused variants included — per-group steps give exactly
the result of one step over all parameters. Optimizers that couple parameters (a global
gradient norm, as in apex's FusedLAMB) are stepped once over the whole model instead.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from commsched.errors import UnsupportedError

__all__ = ["StepRecord", "snapshot", "step_subset", "update_mode", "is_elementwise",
           "state_bytes"]

# Update modes.
PER_GROUP = "per_group"       # per-layer-group updates (crossing the iteration barrier)
WHOLE_MODEL = "whole_model"   # one synchronous step over all parameters

# Optimizers whose step couples parameters (by class name: apex is detected, not imported).
_COUPLED = {"FusedLAMB", "FusedMixedPrecisionLamb", "LBFGS"}

# Optimizers whose update is elementwise within a parameter, so that a shard (a slice of a
# parameter) can be updated on its own: the rs_ag (ZeRO-1) variant needs this.
_ELEMENTWISE_TORCH = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                      "Adagrad", "Adadelta", "ASGD", "Rprop")
_ELEMENTWISE_APEX = ("FusedAdam", "FusedSGD")


class StepRecord:
    """The hyper-parameters of every optimizer param group when ``step()`` was called.

    ``written`` holds the indices of the param groups into which the first update of this
    step wrote back group-level values the optimizer itself changed (apex's FusedAdam
    counts steps in ``group["step"]``): every layer group starts from the recorded value,
    and the real group moves on once per step.
    """

    __slots__ = ("groups", "kwargs", "written")

    def __init__(self, groups: List[dict], kwargs: dict):
        self.groups = groups
        self.kwargs = kwargs
        self.written = set()


def _frozen(value):
    # An LR scheduler may update a tensor-valued lr in place (fill_): keep a copy.
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_frozen(v) for v in value)
    return value


def snapshot(param_groups: Sequence[dict], kwargs: dict = None) -> StepRecord:
    """Record the hyper-parameters in force now (everything but ``params``)."""
    return StepRecord([{k: _frozen(v) for k, v in g.items() if k != "params"}
                       for g in param_groups], dict(kwargs or {}))


def step_subset(optimizer: torch.optim.Optimizer, record: StepRecord,
                subsets: Sequence[Tuple[int, List[torch.Tensor]]]) -> None:
    """Run ``optimizer.step()`` on ``subsets`` — (param group index, parameters) pairs —
    with the hyper-parameters of ``record``; parameters whose ``.grad`` is None are skipped
    by the optimizer, as in a whole step."""
    subsets = [(k, params) for k, params in subsets if params]
    if not subsets:
        return
    groups = [dict(record.groups[k], params=list(params)) for k, params in subsets]
    saved = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        optimizer.step(**record.kwargs)
    finally:
        optimizer.param_groups = saved
    for (k, _), group in zip(subsets, groups):
        if k not in record.written:
            record.written.add(k)
            recorded = record.groups[k]
            for key, value in group.items():
                if key != "params" and value is not recorded.get(key, _MISSING):
                    saved[k][key] = value


_MISSING = object()


def update_mode(optimizer: torch.optim.Optimizer) -> str:
    """PER_GROUP for optimizers whose update is per parameter, WHOLE_MODEL otherwise."""
    name = type(optimizer).__name__
    if name == "LBFGS":
        raise UnsupportedError("commsched data-parallel mode: LBFGS re-evaluates the model "
                               "inside step() (closure) and cannot defer its update; use "
                               "DistributedDataParallel")
    return WHOLE_MODEL if name in _COUPLED else PER_GROUP


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a slice of a parameter can be updated on its own (rs_ag / ZeRO-1)."""
    cls = type(optimizer)
    if cls.__module__.startswith("apex."):
        return cls.__name__ in _ELEMENTWISE_APEX
    return any(cls is getattr(torch.optim, n, None) for n in _ELEMENTWISE_TORCH)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by tensors in ``optimizer.state`` (this rank)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def params_by_group(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """id(parameter) -> index of the optimizer param group holding it."""
    out = {}
    for k, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            out[id(p)] = k
    return out
