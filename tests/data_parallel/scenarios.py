"""Multi-rank scenarios for the data-parallel mode.

Each scenario trains a tiny model twice in the same worker, on the same per-rank data:
first with stock ``DistributedDataParallel`` and the plain optimizer (the reference), then
with ``commsched.data_parallel.wrap``. It returns numbers, not verdicts: the largest differences
of losses, of the parameters each module *saw at its forward pre-hook* (against DDP's
parameters after the previous step), of final parameters, evaluation outputs and optimizer
state. The tests decide (bitwise with 2 ranks, a tolerance with 4).

Spawning a rank costs seconds here, so one ``run_workers`` call runs every scenario of a
world size (see conftest.py); each rank appends a JSON line per scenario to its file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import random
import time
import warnings
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Spec(NamedTuple):
    model: str = "mlp"              # mlp | branchy | tied | bn
    opt: str = "sgd"                # key of OPTIMIZERS
    sched: Optional[str] = None     # None | step | onecycle | lambda
    steps: int = 20
    accum: int = 1                  # micro-batches per step (all but the last under no_sync)
    clip: Optional[float] = None    # clip_grad_norm_ between backward and step
    scaler: bool = False            # GradScaler, with an inf gradient on rank 1 at step 7
    sleeps: bool = False            # random per-rank sleeps in forward / backward / step
    eval: bool = False              # a no_grad eval forward after every step
    state_dict_at_end: bool = False  # state_dict() right after the last step (no drain)
    decompose: str = "none"
    reads_grads: bool = False
    subgroups: bool = False         # ranks {0,1} and {2,3} train separately (group=...)
    user_collective: bool = False   # the loop all-reduces the loss on the group every step
    set_to_none: bool = True        # zero_grad(set_to_none=...)
    zero_grad: str = "optimizer"    # whose zero_grad() the loop calls: optimizer | model
                                    # (what DDP / wrap returned) | module (the plain model)
    per_rank_init: bool = False     # every rank initialises differently (see make_model)
    credit: int = 1024              # Config.credit_bytes; 0: a window of whole layer groups
    groups_in_flight: int = 2       # Config.groups_in_flight: that window, in groups (0: none)
    partition: int = 256            # Config.partition_bytes
    hold_first: bool = False        # the lane's plans send the first-submitted group last


class FusedLAMB(torch.optim.Adam):
    """A coupled optimizer: its name is one the data-parallel mode steps once over the whole model
    (update._COUPLED, as apex's FusedLAMB), and like LAMB it couples parameters through a
    global gradient norm: the learning rate is scaled by 1 / (1 + ||all gradients||).
    Stepped per layer group it would see only the group's gradients, and diverge."""

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        saved = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] / (1.0 + norm)
        try:
            return super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, saved):
                g["lr"] = lr


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_single": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, weight_decay=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "fused_lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=1e-3),
}

SCHEDULERS = {
    "step": lambda opt, n: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    # cycles betas too: the recorded step must carry them
    "onecycle": lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05,
                                                                   total_steps=n),
    "lambda": lambda opt, n: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
}


# ---- models ---------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, step=0, rank=0):
        return self.l2(F.relu(self.l1(F.relu(self.l0(x)))))


class Branchy(nn.Module):
    """``b`` is used by some ranks only in some steps (a zero contribution from the
    others); ``c`` by no rank in most steps (its gradient must stay untouched)."""

    def __init__(self):
        super().__init__()
        self.l0, self.b, self.c, self.head = (nn.Linear(8, 16), nn.Linear(16, 16),
                                              nn.Linear(16, 16), nn.Linear(16, 4))

    def forward(self, x, step=0, rank=0):
        h = F.relu(self.l0(x))
        if (rank == 0 and step % 2 == 1) or step % 4 == 0:
            h = h + F.relu(self.b(h))
        if step % 3 == 0:
            h = h + torch.tanh(self.c(h))
        return self.head(h)


class Tied(nn.Module):
    """First and last layer share their weight."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out.weight = self.inp.weight

    def forward(self, x, step=0, rank=0):
        return self.out(F.relu(self.mid(F.relu(self.inp(x)))))[:, :4]


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.bn, self.l1 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x, step=0, rank=0):
        return self.l1(F.relu(self.bn(self.l0(x))))


MODELS = {"mlp": MLP, "branchy": Branchy, "tied": Tied, "bn": WithBN}


def make_model(spec: Spec, rank: int = 0) -> nn.Module:
    """The same model on every rank, unless ``spec.per_rank_init``: then rank r's comes from
    another seed and its buffers are filled with rank-specific values (rank 0's model is
    the one every rank gets otherwise), which DDP and wrap() must replace by rank 0's."""
    torch.manual_seed(1234 + (rank if spec.per_rank_init else 0))
    model = MODELS[spec.model]()
    if spec.per_rank_init and rank != 0:
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.uniform_(0.5, 1.5)        # BatchNorm running mean / var (> 0)
                else:
                    b.fill_(rank)               # num_batches_tracked
    return model


def model_state(model: nn.Module) -> List[torch.Tensor]:
    """Parameters, then buffers, detached copies."""
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * rank + micro)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


EVAL_X = torch.randn(8, 8, generator=torch.Generator().manual_seed(7))


# ---- the training loop shared by both runs --------------------------------------------------
class Trace:
    def __init__(self):
        self.losses: List[float] = []
        self.params_after: List[List[torch.Tensor]] = []     # DDP: after each step
        self.seen: Dict[int, Dict[str, torch.Tensor]] = {}   # data-parallel: at forward pre-hooks
        self.evals: List[torch.Tensor] = []
        self.in_flight: List[int] = []
        self.final: List[torch.Tensor] = []
        self.state_dict: Dict[str, torch.Tensor] = {}
        self.opt_state: List[Dict[str, torch.Tensor]] = []
        self.skipped: List[int] = []
        self.warnings = 0
        self.current_step = 0
        self.state_bytes = 0
        self.before_wrap: List[torch.Tensor] = []   # data-parallel: this rank's own initial state
        self.after_wrap: List[torch.Tensor] = []    # data-parallel: the state wrap() left
        self.opt_steps = 0                          # data-parallel: real optimizer step() calls
        self.plans: List[tuple] = []                # data-parallel: (feeds_forward, key order)
        self.dispatch: Dict[int, list] = {}         # data-parallel: keys in dispatch order


def train(model, inner, opt, spec: Spec, rank: int, trace: Trace, on_step=None, group=None):
    sched = SCHEDULERS[spec.sched](opt, spec.steps) if spec.sched else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if spec.scaler else None
    for step in range(spec.steps):
        trace.current_step = step
        for micro in range(spec.accum):
            x, y = batch(rank, step, micro)
            last = micro == spec.accum - 1
            with (contextlib.nullcontext() if last else model.no_sync()):
                loss = F.mse_loss(model(x, step, rank), y)
                if last:
                    trace.losses.append(loss.item())
                if scaler is not None:
                    if step == 7 and rank == 1:
                        loss = loss * math.inf
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
        if spec.sleeps:
            time.sleep(random.random() * 0.003)
        if scaler is not None:
            if spec.clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                trace.skipped.append(step)
        else:
            if spec.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
            opt.step()
        if sched is not None:
            sched.step()
        {"optimizer": opt, "model": model, "module": inner}[spec.zero_grad].zero_grad(
            set_to_none=spec.set_to_none)
        if spec.user_collective:
            # The application's own collective on the training group (a loss average for
            # logging), while the last chunks of the step may still wait for credit.
            total = torch.tensor([trace.losses[-1]])
            dist.all_reduce(total, group=group)
        if on_step is not None:
            on_step(step)
        if spec.eval:
            inner.eval()
            with torch.no_grad():
                trace.evals.append(model(EVAL_X, step, rank).clone())
            inner.train()


def run_ddp(spec: Spec, rank: int, group=None) -> Trace:
    from torch.nn.parallel import DistributedDataParallel as DDP
    inner = make_model(spec, rank)
    model = DDP(inner, find_unused_parameters=spec.model == "branchy", process_group=group)
    opt = OPTIMIZERS[spec.opt](inner.parameters())
    trace = Trace()

    def snap(step):
        trace.params_after.append([p.detach().clone() for p in inner.parameters()])

    train(model, inner, opt, spec, rank, trace, snap, group)
    trace.final = [p.detach().clone() for p in inner.parameters()]
    trace.state_dict = {k: v.clone() for k, v in inner.state_dict().items()}
    trace.opt_state = _opt_state(opt.state_dict())
    trace.state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values()
                            for v in st.values() if isinstance(v, torch.Tensor))
    del model
    return trace


def run_data_parallel(spec: Spec, rank: int, group=None) -> Trace:
    import commsched
    from commsched.data_parallel import drain, state_bytes, wrap
    inner = make_model(spec, rank)
    opt = OPTIMIZERS[spec.opt](inner.parameters())
    trace = Trace()
    trace.before_wrap = model_state(inner)
    opt.register_step_pre_hook(lambda *a: setattr(trace, "opt_steps", trace.opt_steps + 1))
    names = {id(p): n for n, p in inner.named_parameters()}
    if spec.sleeps:
        random.seed(rank * 7919 + 17)
        for m in inner.modules():
            m.register_forward_pre_hook(lambda m, a: time.sleep(random.random() * 0.002))
        for p in inner.parameters():
            p.register_hook(lambda g: time.sleep(random.random() * 0.002))
    # (beside a byte window or under rs_ag the group window has no effect, and says so)
    window = 0 if spec.credit or spec.decompose == "rs_ag" else spec.groups_in_flight
    config = commsched.Config(decompose=spec.decompose, partition_bytes=spec.partition,
                              credit_bytes=spec.credit, groups_in_flight=window)
    with warnings.catch_warnings(record=True) as caught, _plans(spec, trace):
        warnings.simplefilter("always")
        model, wopt = wrap(inner, opt, config, group, group_bytes=0,
                           reads_grads=spec.reads_grads)
        engine = model._engine
        engine.scheduler.trace_dispatch = True        # (read when its lanes are created)
        trace.after_wrap = model_state(inner)
        # Registered after wrap: runs after the data-parallel mode's own pre-hook (which is
        # prepended).
        for m in inner.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(_recorder(trace, m, names))
        model.register_forward_pre_hook(
            lambda m, a: trace.in_flight.append(engine.in_flight()) if torch.is_grad_enabled()
            else None)
        train(model, inner, wopt, spec, rank, trace, group=group)
        if spec.state_dict_at_end:
            trace.state_dict = {k[len("module."):]: v.clone()
                                for k, v in model.state_dict().items()}
        trace.opt_state = _opt_state(wopt.state_dict()) if spec.decompose == "none" else []
        drain(model)
        trace.final = [p.detach().clone() for p in inner.parameters()]
        trace.state_bytes = state_bytes(opt)
        trace.dispatch = _dispatched(engine.scheduler.dispatch_log(engine.reduce_group))
        model.close()
    trace.warnings = sum(1 for w in caught if "commsched" in str(w.message))
    return trace


@contextlib.contextmanager
def _plans(spec: Spec, trace: Trace):
    """Record the plans the scheduler's lanes build (whether the lane feeds the next
    forward, and the order); with ``spec.hold_first``, move the request profiled ready
    first (the group submitted first) to the end of each plan of whole requests: it then
    waits in the lane for every other one, the longest hold a plan can ask for. The plan's
    own first entry is not necessarily that group: it depends on the profiled timings."""
    import commsched.order as order
    from commsched.plan import Plan
    real = order.lane_plan

    def lane_plan(profile, credit_bytes, seconds_per_byte, feeds_forward=False,
                  spread_s=0.0):
        plan = real(profile, credit_bytes, seconds_per_byte, feeds_forward, spread_s)
        if spec.hold_first and all(n == 1 for n in plan.layout.values()):
            first = min(profile, key=lambda r: r.ready_s).key
            plan = Plan(tuple(e for e in plan.order if e[0] != first) + ((first, 0),),
                        plan.layout)
        trace.plans.append((feeds_forward, [key for key, _ in plan.order]))
        return plan

    order.lane_plan = lane_plan
    try:
        yield
    finally:
        order.lane_plan = real


def _dispatched(log) -> Dict[int, list]:
    """Per iteration, the request keys in the order their first collective was issued."""
    out: Dict[int, list] = {}
    for entry in log:
        if entry[0] != "plan" and entry[2] == 0 and entry[3] == 0:
            out.setdefault(entry[0], []).append(entry[1])
    return out


def _recorder(trace: Trace, module, names):
    def hook(m, args):
        if torch.is_grad_enabled():
            seen = trace.seen.setdefault(trace.current_step, {})
            for p in m.parameters(recurse=False):
                seen.setdefault(names[id(p)], p.detach().clone())
    return hook


def _opt_state(sd) -> List[Dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in sd["state"][i].items() if isinstance(v, torch.Tensor)}
            for i in sorted(sd["state"])]


def _maxdiff(a, b) -> float:
    """Largest |got - ref| / max(1, |ref|) (0.0 exactly when bitwise equal)."""
    if len(a) != len(b):
        return math.inf
    d = 0.0
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape:
                return math.inf
            both_nan = torch.isnan(x) & torch.isnan(y)
            # relative to max(1, |reference|): optimizer state can be O(10)
            diff = ((x.double() - y.double()).abs() / y.double().abs().clamp(min=1)
                    ).masked_fill(both_nan, 0)
            d = max(d, float(diff.max()) if diff.numel() else 0.0)
        else:
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                d = max(d, abs(x - y) if math.isfinite(x - y) else math.inf)
    return d


def compare(spec: Spec, ref: Trace, got: Trace, names: List[str]) -> dict:
    seen = []
    for step in range(1, spec.steps):
        row = got.seen.get(step, {})
        for name, after in zip(names, ref.params_after[step - 1]):
            if name in row:
                seen.append((row[name], after))
    out = {
        "loss": _maxdiff(ref.losses, got.losses),
        "seen": _maxdiff([a for a, _ in seen], [b for _, b in seen]) if seen else math.inf,
        "seen_count": len(seen),
        "final": _maxdiff(ref.final, got.final),
        "in_flight": sum(got.in_flight),
        "warnings": got.warnings,
        "skipped_ref": ref.skipped,
        "skipped": got.skipped,
        "state_bytes": got.state_bytes,
        "ref_state_bytes": ref.state_bytes,
        "opt_steps": got.opt_steps,
        "plans": got.plans,
        "dispatch": [got.dispatch[i] for i in sorted(got.dispatch)],
    }
    if spec.eval:
        out["eval"] = _maxdiff(ref.evals, got.evals)
    if spec.state_dict_at_end:
        keys = sorted(ref.state_dict)
        out["state_dict"] = _maxdiff([ref.state_dict[k] for k in keys],
                                     [got.state_dict.get(k, torch.empty(0)) for k in keys])
    if got.opt_state:
        flat_ref = [v for st in ref.opt_state for _, v in sorted(st.items())]
        flat_got = [v for st in got.opt_state for _, v in sorted(st.items())]
        out["opt_state"] = _maxdiff(flat_ref, flat_got)
    return out


def run_scenarios(rank: int, world_size: int, cases: Dict[str, Spec], out_dir: str,
                  stacks_at: float = 0) -> None:
    """Worker: run every scenario of ``cases``, appending one JSON line per scenario.
    ``stacks_at`` (a time.time()): dump every thread's stack to ``stacks<rank>.txt`` then,
    if still running (a hang's diagnosis; the parent kills the workers a little later)."""
    torch.set_num_threads(1)
    if stacks_at:
        faulthandler.dump_traceback_later(
            max(1.0, stacks_at - time.time()),
            file=open(os.path.join(out_dir, f"stacks{rank}.txt"), "w"))
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for name, spec in cases.items():
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "started": True}) + "\n")
        t0 = time.perf_counter()
        group = None
        if spec.subgroups:
            pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]
            group = pairs[rank // 2]
        ref = run_ddp(spec, rank, group)
        dist.barrier()
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "started": True, "ddp_seconds":
                                time.perf_counter() - t0}) + "\n")
        got = run_data_parallel(spec, rank, group)
        dist.barrier()
        names = [n for n, _ in make_model(spec).named_parameters()]
        result = compare(spec, ref, got, names)
        if spec.per_rank_init:
            rank0 = model_state(make_model(spec, 0))
            result["init_before"] = _maxdiff(got.before_wrap, rank0)
            result["init"] = _maxdiff(got.after_wrap, rank0)
        result.update(name=name, rank=rank, seconds=time.perf_counter() - t0)
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


# ---- the scenarios of the test suite ----------------------------------------------------------
CASES_2 = {
    "sgd_momentum": Spec(opt="sgd"),
    "sgd_nesterov_lambda_lr": Spec(opt="sgd_nesterov", sched="lambda"),
    "adamw_foreach": Spec(opt="adamw_foreach"),
    "adamw_foreach_step_lr": Spec(opt="adamw_foreach", sched="step"),
    "adamw_single_onecycle": Spec(opt="adamw_single", sched="onecycle"),
    "rmsprop": Spec(opt="rmsprop"),
    "adagrad_step_lr": Spec(opt="adagrad", sched="step"),
    "accumulation": Spec(opt="adamw_foreach", accum=2),
    "unused": Spec(model="branchy", opt="adamw_foreach"),
    "unused_accumulation_zeroed_grads": Spec(model="branchy", opt="adamw_foreach", accum=2,
                                             set_to_none=False),
    "adversarial_timing": Spec(model="branchy", opt="sgd", sleeps=True),
    "eval_and_state_dict": Spec(opt="adamw_foreach", eval=True, state_dict_at_end=True),
    "clip": Spec(opt="adamw_foreach", clip=0.05),
    "clip_declared": Spec(opt="adamw_foreach", clip=0.05, reads_grads=True),
    "grad_scaler": Spec(opt="sgd", scaler=True),
    "tied": Spec(model="tied", opt="adamw_foreach"),
    "buffers": Spec(model="bn", opt="sgd", eval=True, state_dict_at_end=True),
    "rs_ag_adamw_onecycle": Spec(opt="adamw_foreach", sched="onecycle", decompose="rs_ag"),
    "rs_ag_unused_accumulation": Spec(model="branchy", opt="sgd", accum=2, decompose="rs_ag"),
    "rs_ag_clip": Spec(opt="adamw_single", clip=0.05, decompose="rs_ag"),
    "rs_ag_grad_scaler": Spec(opt="rmsprop", scaler=True, decompose="rs_ag"),
    "rs_ag_tied_adagrad_timing_eval": Spec(model="tied", opt="adagrad", sleeps=True, eval=True,
                                           state_dict_at_end=True, decompose="rs_ag"),
    "branchy_adamw_timing": Spec(model="branchy", opt="adamw_foreach", sleeps=True),
    "user_collective_timing": Spec(model="branchy", opt="sgd", sleeps=True,
                                   user_collective=True),
    "rs_ag_user_collective_timing": Spec(opt="adamw_foreach", sleeps=True,
                                                  user_collective=True, decompose="rs_ag"),
    "rs_ag_tied_accumulation": Spec(model="tied", opt="sgd", accum=2,
                                                    decompose="rs_ag"),
    # each rank initialises parameters and buffers differently: rank 0's must win
    "per_rank_init": Spec(model="bn", opt="sgd", per_rank_init=True, eval=True,
                          state_dict_at_end=True),
    "rs_ag_per_rank_init": Spec(model="bn", opt="adamw_foreach", per_rank_init=True,
                                decompose="rs_ag"),
    # a coupled optimizer (by name: update._COUPLED) is stepped once over the whole model
    "whole_model_fused_lamb": Spec(opt="fused_lamb"),
    "adamw_fused": Spec(opt="adamw_fused"),
    # windows of whole layer groups (1, and the default 2), the others queued by priority
    "group_window_timing": Spec(model="branchy", opt="adamw_foreach", sleeps=True, credit=0,
                                groups_in_flight=1),
    "group_window_tied_accumulation": Spec(model="tied", opt="sgd", accum=2, credit=0),
    # a plan that holds the first-submitted group back until every other one went
    "plan_holds_first_group_timing": Spec(opt="adamw_foreach", sleeps=True, credit=0,
                                          hold_first=True),
    # no window at all (the default): the plan orders whole groups, or their chunks
    "plan_no_window_timing": Spec(model="branchy", opt="adamw_foreach", sleeps=True,
                                  credit=0, groups_in_flight=0, partition=0),
    "plan_no_window_chunks_unused": Spec(model="branchy", opt="rmsprop", credit=0,
                                         groups_in_flight=0),
    "plan_holds_first_group_unused": Spec(model="branchy", opt="rmsprop",
                                                          credit=0, hold_first=True),
    # the loop zeroes gradients with the model's zero_grad() (nn.Module's), not the
    # optimizer's: that of the model wrap returned, or of the plain model passed to it
    "model_zero_grad": Spec(opt="adamw_foreach", zero_grad="model"),
    "model_zero_grad_keep": Spec(opt="sgd", zero_grad="model", set_to_none=False),
    "module_zero_grad_timing": Spec(model="branchy", opt="adamw_foreach", sleeps=True,
                                    zero_grad="module"),
    "module_zero_grad_keep_unused": Spec(model="branchy", opt="adamw_foreach", accum=2,
                                         zero_grad="module", set_to_none=False),
    "rs_ag_model_zero_grad": Spec(opt="adamw_foreach", zero_grad="model",
                                  decompose="rs_ag"),
    "rs_ag_model_zero_grad_keep": Spec(opt="sgd", zero_grad="model", set_to_none=False,
                                       decompose="rs_ag"),
}

CASES_4 = {
    "unused_accumulation_adamw_step_lr": Spec(model="branchy", opt="adamw_foreach", accum=2,
                                              sched="step"),
    "adversarial_timing_rmsprop": Spec(model="branchy", opt="rmsprop",
                                                       sleeps=True),
    "rs_ag_adamw_timing": Spec(model="branchy", opt="adamw_single", sleeps=True,
                               decompose="rs_ag"),
    "subgroups_rs_ag_adamw": Spec(model="bn", opt="adamw_foreach", subgroups=True,
                                  decompose="rs_ag"),
    # plain all-reduce (default decompose) with two more optimizers
    "sgd_momentum": Spec(opt="sgd"),
    "adamw_single": Spec(opt="adamw_single"),
    "group_window_timing_rmsprop": Spec(model="branchy", opt="rmsprop", sleeps=True, credit=0),
}
