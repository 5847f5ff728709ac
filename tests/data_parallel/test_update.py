"""Per-layer-group optimizer steps give exactly one whole step's result.

Reference: the plain optimizer stepping all parameters. Under test: the same optimizer
class stepping three subsets of the parameters one after the other (step_subset), with the
hyper-parameters recorded before an LR scheduler changed them. Single process, bitwise.
"""

import pytest
import torch

from commsched.data_parallel.update import (PER_GROUP, WHOLE_MODEL, is_elementwise, snapshot,
                                      state_bytes, step_subset, update_mode)

CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True)),
    ("Adam", dict(lr=0.01, amsgrad=True)),
    ("AdamW", dict(lr=0.01, foreach=True)),
    ("AdamW", dict(lr=0.01, foreach=False)),
    ("AdamW", dict(lr=0.01, fused=True)),
    ("Adamax", dict(lr=0.01)),
    ("NAdam", dict(lr=0.01)),
    ("RAdam", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, momentum=0.5, centered=True)),
    ("Adagrad", dict(lr=0.1)),
    ("Adadelta", dict(lr=0.5)),
    ("ASGD", dict(lr=0.01)),
    ("Rprop", dict(lr=0.01)),
    ("Adafactor", dict(lr=0.01)),
]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 7),
                               torch.nn.Linear(7, 3))


def _optimizer(model, name, kwargs):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name in ("Rprop", "Adafactor", "ASGD"):
        groups = [{"params": decay}, {"params": no_decay}]
    return getattr(torch.optim, name)(groups, **kwargs)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_per_group_steps_equal_one_whole_step(name, kwargs):
    ref, got = _model(), _model()
    ref_opt, got_opt = _optimizer(ref, name, kwargs), _optimizer(got, name, kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.7)
    got_sched = torch.optim.lr_scheduler.StepLR(got_opt, 1, 0.7)
    owner = {id(p): k for k, g in enumerate(got_opt.param_groups) for p in g["params"]}
    params = list(got.parameters())
    subsets = [params[4:], params[2:4], params[:2]]         # last layer first, as in backward
    for step in range(5):
        x = torch.randn(4, 5)
        for m in (ref, got):
            m(x).square().sum().backward()
        ref_opt.step()
        ref_sched.step()
        record = snapshot(got_opt.param_groups)
        got_sched.step()                                    # changes lr before the updates run
        for subset in subsets:
            by_k = {}
            for p in subset:
                by_k.setdefault(owner[id(p)], []).append(p)
            step_subset(got_opt, record, sorted(by_k.items()))
        for opt in (ref_opt, got_opt):
            opt.zero_grad()
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), got.parameters()):
        for key, value in ref_opt.state[a].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got_opt.state[b][key]), key


def test_snapshot_keeps_tensor_hyperparameters_as_recorded():
    p = torch.zeros(2, requires_grad=True)
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5))
    record = snapshot(opt.param_groups)
    opt.param_groups[0]["lr"].fill_(0.1)       # what LRScheduler does to a tensor lr
    assert float(record.groups[0]["lr"]) == 0.5
    assert "params" not in record.groups[0]


def test_update_modes():
    p = [torch.zeros(2, requires_grad=True)]
    assert update_mode(torch.optim.AdamW(p)) == PER_GROUP
    with pytest.raises(TypeError, match="LBFGS"):
        update_mode(torch.optim.LBFGS(p))
    FusedLAMB = type("FusedLAMB", (torch.optim.SGD,), {})     # coupled: global grad norm
    assert update_mode(FusedLAMB(p, lr=0.1)) == WHOLE_MODEL
    assert is_elementwise(torch.optim.AdamW(p))
    assert not is_elementwise(torch.optim.Adafactor(p))


def test_state_bytes_counts_tensors_in_optimizer_state():
    p = torch.zeros(10, requires_grad=True)
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(10)
    opt.step()
    assert state_bytes(opt) == 2 * 10 * 4 + 4          # exp_avg, exp_avg_sq, step


class GroupStepSGD(torch.optim.SGD):
    """Counts steps in the param group, as apex's FusedAdam does, and uses the count."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["step"])


def test_group_level_optimizer_state_advances_once_per_step():
    ref, got = _model(), _model()
    ref_opt = GroupStepSGD(ref.parameters(), lr=0.1)
    got_opt = GroupStepSGD(got.parameters(), lr=0.1)
    params = list(got.parameters())
    for step in range(3):
        x = torch.randn(4, 5)
        for m in (ref, got):
            m(x).square().sum().backward()
        ref_opt.step()
        record = snapshot(got_opt.param_groups)
        for subset in (params[4:], params[2:4], params[:2]):
            step_subset(got_opt, record, [(0, subset)])
        ref_opt.zero_grad()
        got_opt.zero_grad()
    assert got_opt.param_groups[0]["step"] == 3
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)
