"""The rs_ag variant of the data-parallel mode (``COMMSCHED_DECOMPOSE=rs_ag``): ZeRO-1.

Each layer group's gradient buffer is reduce-scattered in backward; rank r updates only
shard r of the group's parameters (the optimizer keeps state for that shard alone, so
optimizer memory per rank is divided by the group size); the updated shards are
all-gathered during the next forward, in forward order, each module waiting only for its
own group's all-gather:

  group buffer (W = 2)     [ shard 0            | shard 1            ]
  backward                 reduce_scatter: rank r receives the average of shard r
  next forward (1st hook)  rank r: optimizer on shard r (params are views of a flat
                           parameter buffer), then all_gather -> every rank has all shards
  forward pre-hook of g    wait all_gather(g)

Invariant 1: per iteration every rank submits reduce_scatter(G-1 .. 0), then one small
all-reduce of the per-parameter usage flags ("used"), then — at the next forward's first
pre-hook — the all-gathers in ascending group order, all of a step's all-gathers before
the next iteration's first reduce-scatter. Only timing differs between ranks.

Invariant 2: nothing is submitted from step() or zero_grad(). The updates and all-gathers
of a step start at the first forward pre-hook after it (or at drain(), a state_dict() or
the next backward), at the same point of the program on every rank. Which all-gathers a
rank submits at a given pre-hook depends on when its reduce-scatters completed, so if
step() submitted those that were ready, one rank could leave step() with all-gathers
issued that the other issues only in its next forward: a device synchronisation or a
barrier between step() and that forward (a timing loop, a checkpoint) would then wait on
the first rank for a collective the second never reaches, a deadlock. What is in flight
when step() returns (the reduce-scatters) is issued by the lanes without the training
thread, on every rank. For the same reason the round takes every group at once, waiting
for each group's reduce-scatter (on a GPU: for its issue only), rather than the groups
whose reduce-scatters happen to be done: otherwise a rank could submit an all-gather at a
pre-hook where the other submits it only at a later one, and a device synchronisation
plus a host-blocking collective inside the forward, between the two, would deadlock.

Requires an optimizer whose update is elementwise within a parameter (SGD, Adam(W),
RMSprop, Adagrad, ...): a shard is a slice of a parameter.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from commsched.config import ConfigError
from commsched.errors import (CommschedError, DataParallelError, NotSupportedError,
                              UnsupportedError)

from .actions import UPDATE, Zeroing, zero_action
from .engine import WHOLE, DataParallelEngine, sibling_group
from .groups import LayerGroup, copy_flags
from .update import PER_GROUP, StepRecord, is_elementwise, snapshot

__all__ = ["ZeroEngine"]

# A layer group's reduce-scatter and all-gather go as one collective each, whatever the
# partition size: a piece of every rank's shard is strided across the shards, so a
# partitioned chunk needs the list form of the collective, for which NCCL allocates a flat
# output of the chunk's full size and copies out of it, and which costs more Python to
# issue. Whole, each is the single-tensor form, in place. The layer group size
# (``group_bytes``) sets the collective size instead, as DDP's bucket size does.


class ZeroEngine(DataParallelEngine):
    """The data-parallel mode with reduce-scatter, a sharded optimizer update and all-gather."""

    decompose = "rs_ag"
    windowed = False    # groups_in_flight windows whole all-reduces only
    lazy_forward_hooks = False  # the forward's first pre-hook runs the round (Invariant 2)

    @property
    def whole_groups(self) -> bool:
        return True             # reduce-scatters and all-gathers always go WHOLE

    @property
    def views_known(self) -> bool:
        return False            # an averaged reduce-scatter's chunks are views of the buffer

    def __init__(self, module, optimizer, config, group=None, **kwargs):
        if not is_elementwise(optimizer):
            raise UnsupportedError(
                f"commsched data-parallel rs_ag: {type(optimizer).__name__} is not known to "
                "update each element of a parameter independently, so a parameter shard cannot "
                "be updated on its own; use decompose=none (all-reduce) with this optimizer")
        self._round = False         # a step's updates and all-gathers are not submitted yet
        self.used_request = None
        self._used_cache: Optional[List[bool]] = None
        super().__init__(module, optimizer, config, group, **kwargs)
        # All-gathers run in a lane (process group) of their own. Within one lane an
        # iteration may be dispatched by a priority plan that waits, head-of-line, for
        # requests not submitted yet; a forward waiting for an all-gather must never wait
        # behind a reduce-scatter of the backward that follows it.
        self.gather_group = sibling_group(group)
        try:
            if self.local or not all(g.fully_owned for g in self.groups):
                raise ConfigError("commsched data-parallel rs_ag: the optimizer must hold "
                                  "exactly the model's trainable parameters")
            if self.mode != PER_GROUP:
                raise UnsupportedError(
                    "commsched data-parallel rs_ag needs a per-parameter optimizer")
        except CommschedError:
            # Known only once the base engine built its groups: nothing of it stays on the
            # model (its hooks, threads and process groups).
            self.release()
            raise
        # All-gathers are submitted in forward (= priority) order from a forward pre-hook,
        # drain() or the next backward: their lane must not block on a collective there (a
        # plan exchange, or the configuration check of its creation, done here instead).
        self.scheduler.set_fifo(self.gather_group, self.groups[0].device)

    # ---- layout ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        W, r = self.world_size, self.rank
        with torch.no_grad():
            for g in self.groups:
                g.allocate(self.view_cls, flags=False, multiple=W)
                g.param_buffer = torch.zeros(g.padded, dtype=g.dtype, device=g.device)
                for off, p in zip(g.offsets, g.params):
                    view = g.param_buffer.narrow(0, off, p.numel())
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view(p.shape)
                size = g.padded // W
                g.shard = (r * size, (r + 1) * size)
                g.consistent = True
        self.used_buf = torch.zeros(len(self.params), dtype=torch.float32,
                                    device=self.groups[0].device)

    def _assign_owners(self) -> None:
        super()._assign_owners()
        state = self.optimizer.state
        for g in self.groups:
            lo, hi = g.shard
            by_k = {}
            for j, (off, p) in enumerate(zip(g.offsets, g.params)):
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a >= b or not g.owned[j]:
                    continue
                piece = g.param_buffer.narrow(0, a, b - a)
                piece.grad = g.buffer.narrow(0, a, b - a)
                full = state.pop(p, None)
                if full:        # state from before wrap (Adagrad's initial sum, a checkpoint)
                    state[piece] = {k: _slice_state(v, p, a - off, b - off)
                                    for k, v in full.items()}
                by_k.setdefault(self._owner[id(p)], []).append((piece, j))
            g.shard_params = sorted(by_k.items())
        # Full-parameter state left over belongs to parameters sharded to other ranks.
        for g in self.groups:
            for p in g.params:
                state.pop(p, None)

    # ---- backward -------------------------------------------------------------------------
    def _before_accumulate(self, g: LayerGroup, i: int) -> None:
        if not g.consistent and self.params[i].grad is not None:
            raise DataParallelError(
                "commsched data-parallel rs_ag: a second synchronised backward accumulates "
                "into gradients that were reduce-scattered (each rank holds only its shard). "
                "Call optimizer.zero_grad() after each step, and use model.no_sync() for "
                "gradient accumulation.")

    def _begin_backward(self) -> None:
        # All of the last step's all-gathers go before this iteration's reduce-scatters.
        self._finish_round()
        super()._begin_backward()

    def _submit(self, g: LayerGroup) -> None:
        if g.request is not None or g.actions:
            self._settle(g)
        self._prepare_submit(g)
        g.request = self.scheduler.submit(g.buffer, key=("rs", g.index), priority=g.index,
                                          op="reduce_scatter", group=self.reduce_group,
                                          average=True, partition_bytes=WHOLE)
        g.submitted_iter = self._bw_iter
        g.consistent = False
        g.grads_full = False

    def _end_iteration(self) -> None:
        copy_flags(self.used_buf, self.used)
        self._used_cache = None
        # Which parameters some rank used, as DDP's find_unused_parameters learns it: the
        # per-iteration small kernels of this mode (a fill of the flags, the collective).
        # A few bytes: one all-reduce, not the lane's reduce-scatter + all-gather.
        self.used_request = self.scheduler.submit(self.used_buf, key="used", priority=-1,
                                                  group=self.reduce_group, decompose="none")
        super()._end_iteration()

    def _after_comm(self, g: LayerGroup) -> None:
        if g.all_used:
            return
        used = self._used()
        first = g.first
        for j, p in enumerate(g.params):
            self.clean[first + j] = False
            if used[first + j] and p.grad is None:
                p.grad = g.grad_views[j]

    def _used(self) -> List[bool]:
        if self._used_cache is None:
            self.used_request.wait()
            self._used_cache = (self.used_buf > 0).tolist()
        return self._used_cache

    # ---- update and all-gather ------------------------------------------------------------
    def _run_updates(self, record: StepRecord, groups: List[LayerGroup]) -> None:
        """One optimizer step over this rank's shards of ``groups``; their all-gathers are
        submitted after it (_advance)."""
        for g in groups:
            if g.param_request is not None:     # the last all-gather still reads this shard
                g.param_request.wait()
                g.param_request = None
            g.needs_gather = True
        self._step_merged(record, ((k, [piece for piece, j in pieces
                                        if g.params[j].grad is not None])
                                   for g in groups for k, pieces in g.shard_params))

    def _zero(self, g: LayerGroup, zeroing: Zeroing) -> None:
        super()._zero(g, zeroing)
        g.consistent = True
        g.grads_full = True

    def _run_zeros(self, groups: List[LayerGroup], zeroing: Zeroing) -> None:
        for g in groups:
            self._zero(g, zeroing)

    def _finish_round(self) -> None:
        """Run the round of the last step(): every group's update, then its all-gather, in
        forward order. Each group waits for its reduce-scatter (on a GPU only for its issue,
        which the lanes do without the training thread; the update then waits on the
        device), so the same groups go at the same call on every rank (Invariant 2).

        The first group goes alone, its all-gather (the one the forward waits for first)
        submitted right after its update; then every other group in one optimizer step:
        the optimizer's fixed cost per call is paid twice, not once per group."""
        if not self._round:
            return
        for batch in (self.groups[:1], self.groups[1:]):
            if not batch:
                continue
            self._settle_batch(batch)
            for g in batch:
                if g.needs_gather:
                    g.needs_gather = False
                    g.param_request = self.scheduler.submit(
                        g.param_buffer, key=("ag", g.index), priority=g.index,
                        op="all_gather", group=self.gather_group, partition_bytes=WHOLE)
        self._round = False
        self.scheduler.end_iteration(self.gather_group)

    def _forward_pre_hook(self, groups: List[LayerGroup], module, args) -> None:
        if self._round:                 # the forward's first pre-hook runs the round
            self._finish_round()
        for g in groups:
            if self._bw and g.submitted_iter == self._bw_iter:
                continue
            if g.actions and (g.request is None or g.request.done()):
                self._settle(g)
            if g.param_request is not None:
                g.param_request.wait()
                g.param_request = None

    def _own_groups(self) -> list:
        return super()._own_groups() + [self.gather_group]

    def in_flight(self) -> int:
        """Number of reduce-scatters and all-gathers not completed yet."""
        return sum(1 for g in self.groups for r in (g.request, g.param_request)
                   if r is not None and not r.done())

    # ---- optimizer entry points -----------------------------------------------------------
    def step(self, kwargs: dict) -> None:
        self._check_open("optimizer.step()")
        self._finish_backward()
        self._finish_round()
        record = snapshot(self.optimizer.param_groups, kwargs)
        for g in self.groups:
            g.actions.append((UPDATE, record))
        self._round = True          # run by the next forward (Invariant 2)
        self._recorder_step()

    def zero_grad(self, set_to_none: bool = True, every: bool = False) -> None:
        """Queued behind the pending update of every group, and run with it (the optimizer
        holds only the model's trainable parameters here: the model's zero_grad() alone
        has others to clear now, those outside the layer groups)."""
        self._check_open("model.zero_grad()" if every else "optimizer.zero_grad()")
        action = zero_action(set_to_none, every)
        for g in self.groups:
            g.actions.append(action)
        self._zero_now(set_to_none, every)

    def drain(self) -> None:
        self._finish_backward()
        self.settle_all()
        self._finish_round()
        for g in self.groups:
            if g.param_request is not None:
                g.param_request.wait()
                g.param_request = None
        if self.used_request is not None:
            self._used()
        self.scheduler.drain()

    def on_grad_access(self) -> None:
        """Gradients read from Python: every rank holds only its shard of the reduced
        gradients, so all-gather them (an all-reduce's worth of traffic) first."""
        if self._in_update or self._bw:
            return
        if all(g.grads_full and g.request is None for g in self.groups):
            return
        if not self.reads_grads:
            self._warn_once(
                "grads",
                "commsched data-parallel rs_ag: gradients were read while reduce-scattered "
                "(clip_grad_norm_, GradScaler.unscale_, logging?): all-gathering them and "
                "waiting, so this step does not overlap the next forward. Pass "
                "wrap(..., reads_grads=True) to make this explicit and silence this warning.")
        self._finish_round()
        gathers = []
        for g in self.groups:
            self._settle(g)
            if not g.grads_full:
                gathers.append(self.scheduler.submit(
                    g.buffer, key=("gather_grads", g.index), priority=g.index,
                    op="all_gather", group=self.gather_group, partition_bytes=WHOLE))
                g.grads_full = True
                g.consistent = True
        self.scheduler.end_iteration(self.gather_group)
        for req in gathers:
            req.wait()

    def _make_grads_readable(self) -> None:
        # The full gradients are gathered back (shards only were reduced in backward).
        self.on_grad_access()

    # ---- state dicts ----------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        """This rank's shard of the optimizer state (not consolidated)."""
        self.drain()
        opt = self.optimizer
        pieces = []
        for g in self.groups:
            for k, shard in g.shard_params:
                for piece, j in shard:
                    st = opt.state.get(piece, {})
                    off = piece.storage_offset() - g.param_buffer.storage_offset()
                    pieces.append({"param": g.names[j], "start": off - g.offsets[j],
                                   "numel": piece.numel(),
                                   "state": {key: (v.detach().clone()
                                                   if isinstance(v, torch.Tensor) else v)
                                             for key, v in st.items()}})
        return {"rs_ag_shard": {"rank": self.rank, "world_size": self.world_size},
                "param_groups": [{k: v for k, v in pg.items() if k != "params"}
                                 for pg in opt.param_groups],
                "state": pieces}

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self.drain()
        meta = state_dict.get("rs_ag_shard")
        if meta != {"rank": self.rank, "world_size": self.world_size}:
            raise ConfigError(f"commsched data-parallel rs_ag: state dict of shard {meta}, this "
                              f"is rank {self.rank} of {self.world_size}")
        opt = self.optimizer
        for pg, saved in zip(opt.param_groups, state_dict["param_groups"]):
            pg.update(saved)
        by_key = {(s["param"], s["start"], s["numel"]): s["state"] for s in state_dict["state"]}
        for g in self.groups:
            for k, shard in g.shard_params:
                for piece, j in shard:
                    off = piece.storage_offset() - g.param_buffer.storage_offset()
                    saved = by_key.get((g.names[j], off - g.offsets[j], piece.numel()))
                    if saved is not None:
                        opt.state[piece] = {key: (v.to(piece.device).clone()
                                                  if isinstance(v, torch.Tensor) and v.dim()
                                                  else v.clone() if isinstance(v, torch.Tensor)
                                                  else v)
                                            for key, v in saved.items()}

    def add_param_group(self, param_group: dict) -> None:
        raise NotSupportedError("commsched data-parallel rs_ag: add_param_group after wrap")


def _slice_state(value, param, start: int, stop: int):
    if isinstance(value, torch.Tensor):
        if value.shape == param.shape:
            return value.detach().reshape(-1)[start:stop].clone()
        return value.detach().clone()
    return value
