"""The overlap-mode engine: gradient hooks, rank-invariant submission, deferred updates.

One iteration, for layer groups g0 (first layer) .. g3 (last layer):

  training thread   fwd k ──► backward k ──────────────────► step() zero_grad() fwd k+1
  autograd hooks          g3 ready ─ g2 ready ─ g1 ready ─ g0 ready
  submissions             sub g3 ── sub g2 ─── sub g1 ──── sub g0 ─ end_iteration
  scheduler lane                [ar g3 ]  [ar g2 ]  [ar g1 ]   [ar g0 ]
  fwd k+1 pre-hooks                                          g0: wait ar g0, update g0, run
                                                             g1: wait ar g1, update g1, run ...
  step() records the hyper-parameters and returns; the update of a group runs when the
  group's request completed: at step() if the request is already done, in the forward
  pre-hook of the first module that needs it, or in drain(). Updates that can run at the
  same point run as one optimizer step (at step(), zero_grad(), drain(), and the first
  pre-hook of a forward): a step() call costs a fixed amount of Python whatever its size,
  and with many layer groups per-group steps cost more CPU than the whole update of DDP.

The lane sends the groups in submission order for ``profile_iters`` iterations, then in
the order of its plan (policy priority): with whole groups and ``plan_forward``, the order
that ends the next forward soonest under a model of it (commsched.plan); a group may then
wait in the lane for one that the forward needs earlier.

Invariant 1 (same requests, same order, on every rank). Groups are submitted strictly in
descending index order (the reverse of forward order, i.e. the order backward normally
produces them): a group goes when all its parameters' gradients were accumulated AND every
group with a higher index was submitted, as DDP's reducer does with bucket indices. At the
end of every backward (an autograd engine callback) the groups not submitted yet — those
holding parameters unused on this rank — are submitted in the same order, with a zero
contribution for the missing parameters. Every synchronised backward therefore submits all
groups, in the same order, on every rank; only the timing differs. With embedding gradients
as rows (sparse.py) their all-gathers follow, at the end of backward, in group order.

Unused parameters (DDP with find_unused_parameters=True): each group buffer carries one
usage flag per parameter after the gradients; it is reduced with them. A parameter that no
rank used keeps its gradient untouched (None after zero_grad(), so the optimizer skips it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from commsched.config import MAX_BYTES, Config
from commsched.errors import CommschedWarning
from commsched.scheduler import Scheduler
from commsched.telemetry import open_rank_recorder

from .groups import LayerGroup, build_groups, grad_view_class
from .sparse import SparseSlot, find_sparse_embeddings
from .update import (PER_GROUP, StepRecord, params_by_group, snapshot, step_subset,
                     update_mode)

__all__ = ["OverlapEngine", "OverlapWarning"]


class OverlapWarning(CommschedWarning):
    """Overlap mode fell back to synchronous behaviour for a reason the user can fix."""


_UPDATE, _ZERO = "update", "zero"
WHOLE = 0       # Scheduler.submit(partition_bytes=WHOLE): the request goes as one chunk


class OverlapEngine:
    """Everything overlap mode does for one (model, optimizer) pair: the layer groups, the
    autograd and forward hooks, the submissions to the scheduler, and the deferred
    per-group actions (optimizer updates, zero_grad)."""

    decompose = "none"
    windowed = True     # groups_in_flight applies (see _lane_config)
    # A module's forward pre-hook is installed only while one of its groups has a request
    # or actions pending (see _arm): with none, the forward runs without hooks.
    lazy_forward_hooks = True

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: Config, group=None, *, group_bytes: Optional[int] = None,
                 reads_grads: bool = False, broadcast_buffers: bool = True,
                 scheduler: Optional[Scheduler] = None, observer=None):
        if not dist.is_initialized():
            raise RuntimeError("commsched.wrap: torch.distributed is not initialized")
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.reads_grads = reads_grads
        self.mode = update_mode(optimizer)
        self.recorder = None
        embeddings = find_sparse_embeddings(module, config.sparse_embedding_rows)
        for name, var, used in (
                ("grad_reduce_dtype", "COMMSCHED_GRAD_REDUCE_DTYPE",
                 config.grad_reduce_dtype is not None),
                ("sparse_embedding_rows", "COMMSCHED_SPARSE_EMBEDDING_ROWS", embeddings)):
            if used and self.decompose != "none":
                raise ValueError(f"commsched.wrap: {name}={getattr(config, name)!r} ({var}) "
                                 f"needs decompose='none', not {self.decompose!r}")
        self.reduce_dtype = (None if config.grad_reduce_dtype is None
                             else getattr(torch, config.grad_reduce_dtype))
        # Untied row-gradient weights send no all-reduce: no copy in the narrower type.
        self._rows_only_weights = {id(m.weight) for _, m, tied in embeddings if not tied}
        self.groups, module_groups = build_groups(
            module, config.group_bytes if group_bytes is None else group_bytes,
            {id(m.weight): tied for _, m, tied in embeddings}, config.first_group_bytes)
        if not self.groups:
            raise ValueError("commsched.wrap: the model has no parameter that requires grad")
        devices = {g.device for g in self.groups}
        if len(devices) > 1:
            raise ValueError(f"commsched.wrap: parameters on several devices "
                             f"{sorted(map(str, devices))}; overlap mode drives one device "
                             "per process")
        self.params: List[torch.nn.Parameter] = [p for g in self.groups for p in g.params]
        self.names: List[str] = [n for g in self.groups for n in g.names]
        self.slot = [(g, j) for g in self.groups for j in range(len(g.params))]
        self.clean = [True] * len(self.params)    # slot known to be zero
        self.used = [False] * len(self.params)    # hook fired in this backward
        self.view_cls = grad_view_class(self)

        # Initial state from rank 0, like DDP.
        _broadcast([p.detach() for p in module.parameters()]
                   + [b for b in module.buffers()], group, self.src)
        # Gradients are reduced on a process group of their own. With a bounded credit
        # window the lane issues an iteration's last chunks from its completion thread
        # after backward returned, at times that differ between ranks: a collective the
        # application issues on ``group`` meanwhile (a loss average, a barrier) would pair
        # with different chunks on different ranks.
        self.reduce_group = sibling_group(group)
        # Each layer group goes as one collective, unless the credit window is set in bytes
        # (or autotune, which may set it): queued chunks are then what priorities overtake.
        # Under a window of whole groups (``groups_in_flight``) the queued groups are, and
        # with no window at all a group's chunks would go one after the other as soon as
        # it is submitted, in the order the whole group would: cutting it changes no order
        # and costs one more collective to issue per chunk. The layer group size
        # (``group_bytes``) is then the collective size, as DDP's bucket size is.
        lanes = config if scheduler is None else scheduler.config
        self.partition_bytes = None if lanes.credit_bytes or lanes.autotune else WHOLE
        self.buffer_group = None
        self.buffers = [b for b in module.buffers()]
        if broadcast_buffers and self.buffers:
            # Buffers are broadcast from the training thread at each forward, as DDP does.
            # They get their own process group: collectives on one group must come in the
            # same order on every rank, and the scheduler's lane issues its own from
            # another thread at times that differ between ranks.
            self.buffer_group = sibling_group(group)
        self._allocate()
        if scheduler is None:
            lane_config = self._lane_config(config)
            if observer is None and config.telemetry_dir:
                # (records the window the lane runs under)
                observer = self.recorder = open_rank_recorder(lane_config,
                                                              self.groups[0].device)
            scheduler = Scheduler(lane_config, observer, owns_groups=True, feeds_forward=True)
        self.scheduler = scheduler
        self._adopt_existing_grads()
        self._assign_owners()

        self._iter = 0          # synchronised iterations ended so far
        self._bw = False        # inside a synchronised backward (hooks fired, callback queued)
        self._bw_iter = -1      # iteration collected by the current backward
        self._next = len(self.groups) - 1
        self.sync = True        # set by the wrapper's forward: False under no_sync()
        self._buffers_stale = True
        self._in_update = False
        self._fresh = False     # no module of the current wrapped forward has run yet
        self._warned = set()
        self._hooks = []
        # Forward pre-hooks installed while pending (_arm): per group, its modules'; and
        # whether each group is counted in them.
        self._module_hooks: List[_ModuleHook] = []
        self._group_modules: List[List[_ModuleHook]] = [[] for _ in self.groups]
        self._armed = [False] * len(self.groups)
        # Row gradients (sparse.py), in group order: their all-gathers go at the end of
        # every backward, after the groups, in this order on every rank. ``_rows_only``:
        # the untied ones, whose groups send no dense all-reduce.
        self.sparse_groups: List[LayerGroup] = []
        for name, m, tied in embeddings:
            g, _ = self.slot[next(i for i, p in enumerate(self.params) if p is m.weight)]
            g.sparse = SparseSlot(name, m, tied)
            if tied:
                g.priority = -1         # backward's first, the next forward's first need
            self.sparse_groups.append(g)
        self.sparse_groups.sort(key=lambda g: g.index)
        self._rows_only = [g for g in self.sparse_groups if not g.sparse.tied]
        self._register_hooks(module_groups)
        for g in self.sparse_groups:
            g.sparse.module.forward = g.sparse.lookup

    def _lane_config(self, config: Config) -> Config:
        """The configuration of the engine's own scheduler: ``config``, with a credit window
        of ``groups_in_flight`` times the largest group's buffer where ``config`` leaves
        the window unbounded.

        The first layers' group is reduced last in backward and needed first by the next
        forward. With every group issued as soon as it is ready, it queues on the device
        behind all the groups still running; under the window the later groups wait in the
        lane instead, where its priority puts it first."""
        config = config.with_policy("priority")
        n = config.groups_in_flight
        if not self.windowed or not n or config.credit_bytes or config.autotune:
            return config
        largest = max(_sent(g).nbytes for g in self.groups)
        return config.replace(credit_bytes=min(n * largest, MAX_BYTES))

    @property
    def whole_groups(self) -> bool:
        """Whether each layer group goes as one collective (the partition size unused)."""
        return self.partition_bytes == WHOLE

    # ---- layout ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        for g in self.groups:
            g.allocate(self.view_cls, flags=True)
            if (self.reduce_dtype is not None and _narrows(g.dtype, self.reduce_dtype)
                    and id(g.params[0]) not in self._rows_only_weights):
                g.allocate_comm(self.reduce_dtype)

    def _adopt_existing_grads(self) -> None:
        with torch.no_grad(), _plain():
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    g, j = self.slot[i]
                    g.grads[j].copy_(p.grad)
                    p.grad = g.grad_views[j]
                    self.clean[i] = False

    def _assign_owners(self) -> None:
        """Which of each group's parameters the optimizer updates, per optimizer param
        group; optimizer parameters outside the model are 'local' (stepped at step())."""
        owner = self._owner = params_by_group(self.optimizer)
        in_model = set()
        for g in self.groups:
            by_k: Dict[int, list] = {}
            g.owned = []
            for p in g.params:
                in_model.add(id(p))
                k = owner.get(id(p))
                g.owned.append(k is not None)
                if k is not None:
                    by_k.setdefault(k, []).append(p)
            g.opt_params = sorted(by_k.items())
            g.fully_owned = all(g.owned)
        self.local = []
        for k, pg in enumerate(self.optimizer.param_groups):
            extra = [p for p in pg["params"] if id(p) not in in_model]
            if extra:
                self.local.append((k, extra))

    def _register_hooks(self, module_groups) -> None:
        # (functools.partial: called from C, with no Python frame of its own)
        bind = functools.partial
        rows_only = {id(g.params[0]) for g in self._rows_only}
        for i, p in enumerate(self.params):
            if id(p) in rows_only:
                # Autograd has no gradient to hand it: one would be a use the rows miss.
                self._hooks.append(p.register_hook(bind(self._dense_grad_of_rows, i)))
                continue
            self._hooks.append(p.register_hook(bind(self._grad_pre_hook, i)))
            self._hooks.append(p.register_post_accumulate_grad_hook(
                bind(self._grad_post_hook, i)))
        for m, idx in module_groups.items():
            groups = [self.groups[k] for k in idx]
            hook = bind(self._forward_pre_hook, groups)
            if not self.lazy_forward_hooks:
                self._hooks.append(m.register_forward_pre_hook(hook, prepend=True))
                continue
            entry = _ModuleHook(m, hook)
            self._module_hooks.append(entry)
            for k in idx:
                self._group_modules[k].append(entry)

    def _arm(self, g: LayerGroup) -> None:
        """``g`` has a request or actions pending: its modules' forward pre-hooks must run
        before their next forward (they settle it there).

        Installed only then and removed once it settled (_disarm): a module with a
        forward pre-hook takes nn.Module's slower call path and a Python call at every
        forward, which in a forward that the host issues just ahead of the device is the
        device's time. Groups settle at step() when their requests are due (see _due),
        before the forward; only those still pending keep hooks into it."""
        if self._armed[g.index]:
            return
        self._armed[g.index] = True
        for entry in self._group_modules[g.index]:
            entry.add()

    def _disarm(self, g: LayerGroup) -> None:
        """``g`` settled (no request, no actions): its modules lose the forward pre-hook
        unless another of their groups still needs it."""
        if not self._armed[g.index] or g.request is not None or g.actions:
            return
        self._armed[g.index] = False
        for entry in self._group_modules[g.index]:
            entry.drop()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for entry in self._module_hooks:
            entry.clear()
        self._armed = [False] * len(self.groups)
        for g in self.sparse_groups:
            g.sparse.module.__dict__.pop("forward", None)     # the class's forward again

    # ---- autograd hooks (autograd engine thread) ------------------------------------------
    def _grad_pre_hook(self, i: int, grad):
        """Before autograd accumulates into parameter i: its slot must be free (the last
        iteration's request done, its update and zeroing applied).

        With no .grad yet, autograd hands its new gradient over as .grad without a copy,
        and it is copied into the slot later, with the rest of its group's, in one
        multi-tensor copy (see _adopt; with a narrower communication type it is cast
        straight into the group's copy in that type instead): one pass over
        the gradient, where accumulating into the slot would take two (zeroing it, then
        an add that reads it back), and one Python call per group rather than one per
        parameter. A sparse gradient cannot be copied into a dense slot: it is
        accumulated into the zeroed slot instead, as is every gradient after the first."""
        g, j = self.slot[i]
        if self._bw and g.submitted_iter == self._bw_iter:
            raise RuntimeError(
                f"commsched overlap: parameter {self.names[i]!r} received a gradient after "
                "its layer group was handed to communication in this backward (reentrant "
                "checkpointing, or a parameter reached twice through separate graphs?). "
                "Use torch.utils.checkpoint with use_reentrant=False, and no_sync() for "
                "gradient accumulation.")
        if g.request is not None or g.actions:
            if any(a[0] == _UPDATE for a in g.actions):
                raise RuntimeError(
                    f"commsched overlap: parameter {self.names[i]!r} was used in forward "
                    "before the pending optimizer update of its layer group was applied: it "
                    "is used outside the forward of the module that owns it. Call "
                    "commsched.drain(model) before such a forward, or use "
                    "DistributedDataParallel for this model.")
            self._settle(g)
        self._before_accumulate(g, i)
        p = self.params[i]
        if p.grad is None and grad.is_sparse:
            if not self.clean[i]:
                g.grads[j].zero_()
            p.grad = g.grad_views[j]
        self.clean[i] = False
        return None

    def _dense_grad_of_rows(self, i: int, grad):
        """A weight whose gradient goes as rows got a dense gradient: refused."""
        raise RuntimeError(
            f"commsched overlap: embedding weight {self.names[i]!r} received a dense "
            "gradient from outside its module's lookup (an output layer sharing it "
            "through a functional call?), but sends its gradient as rows "
            "(COMMSCHED_SPARSE_EMBEDDING_ROWS): tie it by registering the same "
            "Parameter in the output module, or set COMMSCHED_SPARSE_EMBEDDING_ROWS=0")

    def _before_accumulate(self, g: LayerGroup, i: int) -> None:
        """Checks of the rs_ag variant."""

    def _grad_post_hook(self, i: int, param) -> None:
        g, j = self.slot[i]
        if not self.sync:
            # Under no_sync() the next micro-batches accumulate into the slot.
            grad = param.grad
            if grad is not g.grad_views[j]:
                with torch.no_grad(), _plain():
                    g.grads[j].copy_(grad)
                param.grad = g.grad_views[j]
            return
        if not self._bw:
            self._begin_backward()
        if not self.used[i]:
            self.used[i] = True
            g.ready += 1
            if g.ready == len(g.params):
                if g.index == self._next:
                    self._submit_ready()
                else:
                    # Waits for a group with a parameter unused so far: hold no handed-over
                    # gradient meanwhile.
                    self._adopt(g)

    def _begin_backward(self) -> None:
        self._bw = True
        self._bw_iter = self._iter
        self._next = len(self.groups) - 1
        for g in self.groups:
            g.ready = 0
        self.used = [False] * len(self.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._rows_only:
            # A weight with only row gradients has nothing for autograd to accumulate: its
            # group is passed over in order (its rows go at the end, see _flush).
            for g in self._rows_only:
                g.ready = len(g.params)
            self._submit_ready()

    def _end_backward(self) -> None:
        """Autograd engine callback at the end of a synchronised backward."""
        try:
            self._flush()
        finally:
            self._bw = False
        if self.reads_grads:
            self._make_grads_readable()

    def _make_grads_readable(self) -> None:
        """``reads_grads``: the loop reads gradients before step(); finish what they need."""
        self.settle_all()

    def _submit_ready(self) -> None:
        while self._next >= 0:
            g = self.groups[self._next]
            if g.ready != len(g.params):
                return
            self._submit(g)
            self._next -= 1
        if not self.sparse_groups:
            self._end_iteration()
        # (else rows are recorded until the end of backward: _flush ends the iteration)

    def _flush(self) -> None:
        """Submit every group not submitted yet in this backward, in order, then the row
        gradients, and end the iteration."""
        if not self._bw or (self._next < 0 and not self.sparse_groups):
            return
        while self._next >= 0:
            self._submit(self.groups[self._next])
            self._next -= 1
        if self.sparse_groups:
            self._submit_rows()
        self._end_iteration()

    def _prepare_submit(self, g: LayerGroup) -> None:
        """Make what the group sends (its buffer, or its copy in the communication type) hold
        exactly this rank's contribution: .grad if defined, else 0."""
        self._adopt(g, zero_missing=True, into=None if g.comm is None else g.comm_grads)
        g.all_used = g.ready == len(g.params)

    def _adopt(self, g: LayerGroup, zero_missing: bool = False,
               into: Optional[List[torch.Tensor]] = None) -> None:
        """Copy into their slots the group's gradients that are not slot views (handed
        over by autograd, or set by the caller), in one multi-tensor copy, and make .grad
        the slot; ``zero_missing``: zero the slots of parameters without a gradient.

        ``into`` (the per-parameter views of the group's copy in the communication type):
        copy every gradient there instead, from its slot or from where it was handed
        over, cast in the same copy, and zero there every missing one. The slots are
        then written once, by the cast back (_unpack), not once more before it."""
        first = g.first
        dst, src, zero = [], [], []
        for j, p in enumerate(g.params):
            grad = p.grad
            if grad is None:
                if into is not None:
                    zero.append(into[j])
                elif zero_missing and not self.clean[first + j]:
                    zero.append(g.grads[j])
                    self.clean[first + j] = True
            elif grad is not g.grad_views[j]:
                dst.append(g.grads[j] if into is None else into[j])
                src.append(grad)
                p.grad = g.grad_views[j]
                self.clean[first + j] = False
            elif into is not None:
                dst.append(into[j])
                src.append(g.grads[j])
        if dst or zero:
            with torch.no_grad(), _plain():
                if dst:
                    torch._foreach_copy_(dst, src)
                if zero:
                    torch._foreach_zero_(zero)

    def _submit(self, g: LayerGroup) -> None:
        if g.request is not None or g.actions:
            # Untouched since the last iteration (no forward or gradient reached it).
            self._settle(g)
        g.submitted_iter = self._bw_iter
        if g.sparse is not None and not g.sparse.tied:
            g.all_used = True           # (its gradient is the rows: _submit_rows)
            return
        self._prepare_submit(g)
        flags = g.flags if g.comm is None else g.comm_flags
        if g.all_used:
            flags.fill_(1)
        else:
            copy_flags(flags, self.used[g.first:g.first + len(g.params)])
        request = self.scheduler.submit(_sent(g), key=g.index, priority=g.priority,
                                        group=self.reduce_group, average=True,
                                        decompose="none",
                                        partition_bytes=self.partition_bytes)
        if g.sparse is not None:
            # Tied: the group's request is its rows' (the last issued); nothing settles
            # the group before they are submitted.
            g.sparse.requests = [request]
        else:
            g.request = request
            self._arm(g)

    def _submit_rows(self) -> None:
        """End of backward: all-gather each row-gradient weight's token ids and rows (the
        group's request is the rows'; see sparse.py)."""
        w, r = self.world_size, self.rank
        for g in self.sparse_groups:
            slot = g.sparse
            ids, rows = slot.take()
            tokens = ids.numel()
            if slot.tokens is None:
                self._agree_tokens(g, tokens)
            elif tokens != slot.tokens:
                raise RuntimeError(
                    f"commsched overlap: embedding {slot.name!r} looked up {tokens} tokens "
                    f"in this backward, {slot.tokens} in the first: with "
                    "COMMSCHED_SPARSE_EMBEDDING_ROWS every backward must look up as many "
                    "tokens on every rank (pad the batch, or set it to 0)")
            with torch.no_grad():
                slot.ids_all.narrow(0, r * tokens, tokens).copy_(ids)
                slot.rows_all.view(w * tokens, -1).narrow(0, r * tokens, tokens).copy_(rows)
            submit = functools.partial(self.scheduler.submit, priority=g.priority,
                                       op="all_gather", group=self.reduce_group)
            slot.requests.append(submit(slot.ids_all, key=("ids", g.index)))
            g.request = submit(slot.rows_all, key=("rows", g.index))
            self._arm(g)

    def _agree_tokens(self, g: LayerGroup, tokens: int) -> None:
        """First backward: every rank's token count, all-gathered and read on the host
        (once); they must be equal."""
        counts = torch.zeros(self.world_size, dtype=torch.long, device=g.device)
        counts[self.rank] = tokens
        self.scheduler.submit(counts, key=("tokens", g.index), priority=g.priority,
                              op="all_gather", group=self.reduce_group).wait()
        counts = counts.tolist()
        if len(set(counts)) != 1:
            raise RuntimeError(
                f"commsched overlap: embedding {g.sparse.name!r} looked up {counts} tokens "
                "on ranks 0.. in the first backward: with COMMSCHED_SPARSE_EMBEDDING_ROWS "
                "every rank must look up as many (pad the batch, or set it to 0)")
        g.sparse.allocate(tokens, self.world_size)
        rows = g.sparse.weight.shape[0]
        if self.world_size * tokens >= rows:
            # A ring all-reduce sends about twice the weight per rank, the all-gather the
            # rows of every rank: at as many rows as the weight has, the dense one is
            # cheaper or about even.
            self._warn_once(
                "rows",
                f"commsched overlap: embedding {g.sparse.name!r} sends "
                f"{self.world_size} x {tokens} gradient rows per backward, at least its "
                f"{rows} rows: the dense all-reduce would send about as much or less; "
                "raise COMMSCHED_SPARSE_EMBEDDING_ROWS above its rows or set it to 0")

    def _end_iteration(self) -> None:
        self.scheduler.end_iteration(self.reduce_group, private=True)
        self._iter += 1

    # ---- forward (training thread) --------------------------------------------------------
    def _forward_pre_hook(self, groups: List[LayerGroup], module, args) -> None:
        # The first pre-hook of a wrapped forward runs before any module used a parameter
        # of a group with pending actions (those of modules that ran before it, without a
        # hook, had all settled): there, and only there, other groups' ready updates may
        # run early, batched.
        fresh, self._fresh = self._fresh, False
        for g in groups:
            if g.request is not None or g.actions:
                if self._bw and g.submitted_iter == self._bw_iter:
                    continue        # recomputation inside this backward (checkpointing)
                if fresh and not self._bw:
                    self._settle_with_ready(g)
                else:
                    self._settle(g)

    def before_forward(self, sync: bool) -> None:
        """Called by the wrapper at the start of forward. Buffers are broadcast from rank 0
        before a forward that follows a synchronised training forward, as DDP does."""
        if self._buffers_stale and self.buffer_group is not None:
            _broadcast(self.buffers, self.buffer_group, self.src)
        grad = torch.is_grad_enabled()
        self._buffers_stale = grad and sync
        self._fresh = True
        if grad:
            self.sync = sync

    # ---- completion and deferred actions (training thread) ---------------------------------
    def _settle(self, g: LayerGroup) -> None:
        """Wait for the group's request, then run its pending actions in order."""
        req = g.request
        if req is not None:
            g.request = None
            req.wait()
            self._after_comm(g)
        while g.actions:
            self._run(g, g.actions.pop(0))
        self._disarm(g)

    def _settle_with_ready(self, g: LayerGroup) -> None:
        """Settle ``g`` together with every other group with pending actions whose request
        is due by ``g``'s (see _due): their updates run as one or two optimizer steps (see
        _settle_groups). Only where no parameter was used since step() (an update after a
        use would go unnoticed): at the first forward pre-hook of a wrapped forward.

        Updates are per parameter, so running them earlier, or several groups' in one
        step, gives the same values; what it saves is the optimizer's fixed cost per
        step() call, paid once instead of per group."""
        req = g.request
        if req is not None and not req.done():
            # Blocks this thread: wait first, more groups are done after it.
            g.request = None
            req.wait()
            self._after_comm(g)
        cutoff = _issue_order(g)
        self._settle_groups([g] + [h for h in self.groups
                                   if h is not g and h.actions and _due(h.request, cutoff)],
                            pivot=g)

    def _settle_groups(self, groups: List[LayerGroup],
                       pivot: Optional[LayerGroup] = None) -> None:
        """Wait for the groups' requests, then run their pending actions.

        On a GPU a request is done once issued, and its wait makes the stream wait for
        its collectives: updates queued after that wait cannot start before they
        finished. So while the pivot's collectives (default: the last issued request's)
        still run on the device, the groups whose requests were issued before it are
        settled first: their updates run beside the pivot's collectives instead of after
        them, for one optimizer step more."""
        if len(groups) > 1:
            order = [_issue_order(g) for g in groups]
            last = max(order) if pivot is None else _issue_order(pivot)
            head = pivot if pivot is not None else groups[order.index(last)]
            if _running(head.request):
                early = [g for g, o in zip(groups, order) if o < last]
                if early:
                    self._settle_batch(early)
                    groups = [g for g, o in zip(groups, order) if o >= last]
        self._settle_batch(groups)

    def _settle_batch(self, groups: List[LayerGroup]) -> None:
        """Wait for the groups' requests, then run their pending actions: round by round
        (each group's actions stay in order), one optimizer step per round for all the
        groups whose next action is the same step's update."""
        for g in groups:
            req = g.request
            if req is not None:
                g.request = None
                req.wait()
                self._after_comm(g)
        while True:
            updates: Dict[int, tuple] = {}
            zeros: Dict[bool, List[LayerGroup]] = {}
            for g in groups:
                if g.actions:
                    kind, arg = g.actions.pop(0)
                    if kind == _UPDATE:
                        updates.setdefault(id(arg), (arg, []))[1].append(g)
                    else:
                        zeros.setdefault(arg, []).append(g)
            if not updates and not zeros:
                for g in groups:
                    self._disarm(g)
                return
            for record, gs in updates.values():
                self._run_updates(record, gs)
            for set_to_none, gs in zeros.items():
                self._run_zeros(gs, set_to_none)

    def _after_comm(self, g: LayerGroup) -> None:
        if g.sparse is not None:
            self._add_rows(g)
        else:
            self._unpack(g)
        if g.all_used:
            return
        # Some parameter got no local gradient: the reduced flags say which were used on
        # some rank (their .grad becomes the reduced slot) and which on none (untouched).
        used = (g.flags > 0).tolist()
        first = g.first
        for j, p in enumerate(g.params):
            self.clean[first + j] = False
            if used[j] and p.grad is None:
                p.grad = g.grad_views[j]

    def _add_rows(self, g: LayerGroup) -> None:
        """The group's rows arrived (its request): after the dense all-reduce of a tied
        weight, add them into the gradient slot, divided by the group size."""
        slot = g.sparse
        requests, slot.requests = slot.requests, []
        for request in requests:
            request.wait()
        self._unpack(g)
        with torch.no_grad(), _plain():
            grad = g.grads[0]
            if not slot.tied:
                grad.zero_()
            slot.apply(grad, self.world_size)
        g.params[0].grad = g.grad_views[0]
        self.clean[g.first] = False

    @staticmethod
    def _unpack(g: LayerGroup) -> None:
        """The group's all-reduce completed (its request waited for): with a narrower
        communication type, its result back into the gradient buffer."""
        if g.comm is not None:
            with torch.no_grad(), _plain():
                g.buffer.copy_(g.comm)

    def _run(self, g: LayerGroup, action) -> None:
        kind, arg = action
        if kind == _UPDATE:
            self._update(g, arg)
        else:
            self._zero(g, arg)

    def _update(self, g: LayerGroup, record: StepRecord) -> None:
        self._run_updates(record, [g])

    def _run_updates(self, record: StepRecord, groups: List[LayerGroup]) -> None:
        """One optimizer step over the owned parameters of ``groups`` that have a
        gradient, with the hyper-parameters of ``record``."""
        self._step_merged(record, ((k, [p for p in params if p.grad is not None])
                                   for g in groups for k, params in g.opt_params))

    def _step_merged(self, record: StepRecord, subsets) -> None:
        """One optimizer step over (param group index, tensors) pairs, those of one index
        merged, with the hyper-parameters of ``record``."""
        by_k: Dict[int, list] = {}
        for k, tensors in subsets:
            subset = by_k.get(k)
            if subset is None:
                subset = by_k[k] = []
            subset.extend(tensors)
        with self._update_context():
            step_subset(self.optimizer, record, sorted(by_k.items()))

    def _zero(self, g: LayerGroup, set_to_none: bool) -> None:
        if g.fully_owned and not set_to_none:
            g.buffer.zero_()
        self._zero_slots(g, set_to_none)

    def _run_zeros(self, groups: List[LayerGroup], set_to_none: bool) -> None:
        if not set_to_none:
            buffers = [g.buffer for g in groups if g.fully_owned]
            if buffers:
                torch._foreach_zero_(buffers)      # one call, not one per group
        for g in groups:
            self._zero_slots(g, set_to_none)

    def _zero_slots(self, g: LayerGroup, set_to_none: bool) -> None:
        """zero_grad() of the group's parameters, its buffer already zeroed if the
        optimizer owns all of them and the gradients stay tensors. Set to None, a slot
        keeps its old values: the next backward overwrites it (see _grad_pre_hook), or
        zeroes it if its parameter gets no gradient (_prepare_submit)."""
        first = g.first
        for j, p in enumerate(g.params):
            if not g.owned[j]:
                continue
            grad = p.grad
            if grad is not None and grad is not g.grad_views[j]:
                if set_to_none:
                    p.grad = None
                else:
                    with torch.no_grad(), _plain():
                        grad.zero_()
                continue
            if set_to_none:
                p.grad = None
                self.clean[first + j] = False
                continue
            if not g.fully_owned:
                g.grads[j].zero_()
            self.clean[first + j] = True

    @contextlib.contextmanager
    def _update_context(self):
        """Optimizer updates run with GradView dispatch off, outside inference mode (state
        created lazily must be a normal tensor) and outside autocast."""
        device = self.groups[0].device.type
        self._in_update = True
        try:
            with _plain(), torch.inference_mode(False), (
                    torch.autocast(device, enabled=False)
                    if torch.is_autocast_enabled(device) else contextlib.nullcontext()):
                yield
        finally:
            self._in_update = False

    def _add_actions(self, action) -> None:
        """Queue ``action`` on every group; run it now (batched) where the group's
        request is due by the first group's (see _due), the others at their forward
        pre-hook."""
        cutoff = _issue_order(self.groups[0])      # the first group the forward needs
        ready = []
        for g in self.groups:
            g.actions.append(action)
            if _due(g.request, cutoff):
                ready.append(g)
        if ready:
            self._settle_groups(ready)
        for g in self.groups:
            if g.actions:
                self._arm(g)

    # ---- optimizer entry points (training thread) ------------------------------------------
    def step(self, kwargs: dict) -> None:
        self._finish_backward()
        if self.mode != PER_GROUP:
            self.settle_all()
            with self._update_context():
                self.optimizer.step(**kwargs)
            self._recorder_step()
            return
        record = snapshot(self.optimizer.param_groups, kwargs)
        self._add_actions((_UPDATE, record))
        if self.local:
            with self._update_context():
                step_subset(self.optimizer, record, self.local)
        self._recorder_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._add_actions((_ZERO, set_to_none))
        for _, params in self.local:
            for p in params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def _recorder_step(self) -> None:
        if self.recorder is not None:
            self.recorder.step()

    # ---- synchronisation ------------------------------------------------------------------
    def _finish_backward(self) -> None:
        # Normally the end-of-backward callback did this; it did not if backward raised.
        if self._bw:
            self._flush()
            self._bw = False

    def settle_all(self) -> None:
        self._settle_groups(self.groups)

    def drain(self) -> None:
        """Complete all outstanding communication and pending updates."""
        self._finish_backward()
        self.settle_all()
        self.scheduler.drain()

    def in_flight(self) -> int:
        """Number of layer groups whose request has not completed yet."""
        return sum(1 for g in self.groups
                   if g.request is not None and not g.request.done())

    def on_grad_access(self) -> None:
        """A gradient was read from Python (GradView): finish what is in flight first."""
        if self._in_update or self._bw:
            return
        if not any(g.request is not None for g in self.groups):
            return
        if not self.reads_grads:
            self._warn_once(
                "grads",
                "commsched overlap: gradients were read while their communication was in "
                "flight (clip_grad_norm_, GradScaler.unscale_, logging?): waiting for all "
                "gradient communication, so the optimizer step is synchronous and does not "
                "overlap the next forward. Pass wrap(..., reads_grads=True) to make this "
                "explicit and silence this warning.")
        self.drain()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, OverlapWarning, stacklevel=3)

    # ---- state dicts ----------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        self.drain()
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self.drain()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.drain()
        self.optimizer.add_param_group(param_group)
        self._assign_owners()

    def close(self) -> None:
        """Drain, remove every hook and stop the scheduler's threads."""
        self.drain()
        self.remove_hooks()
        self.scheduler.close()
        if self.recorder is not None:
            self.recorder.close()
        for pg in self._own_groups():
            dist.destroy_process_group(pg)

    def _own_groups(self) -> list:
        return [self.reduce_group] + ([self.buffer_group] if self.buffer_group is not None
                                      else [])


class _ModuleHook:
    """A module's forward pre-hook, installed while at least one of its pending layer
    groups counts on it (OverlapEngine._arm)."""

    __slots__ = ("module", "hook", "handle", "pending")

    def __init__(self, module: torch.nn.Module, hook) -> None:
        self.module, self.hook = module, hook
        self.handle = None
        self.pending = 0            # the module's armed groups

    def add(self) -> None:
        self.pending += 1
        if self.pending == 1:
            self.handle = self.module.register_forward_pre_hook(self.hook, prepend=True)

    def drop(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.clear()

    def clear(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle, self.pending = None, 0


def sibling_group(group):
    """A new process group with the ranks of ``group`` (None: the world); collective over
    those ranks only."""
    if group is None:
        return dist.new_group()
    return dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)


def _due(request, cutoff: float) -> bool:
    """Whether waiting for ``request`` costs the device nothing beyond a wait there is
    anyway, for the request numbered ``cutoff`` in the lane's issue order (-1: none): no
    request pending, finished, or issued no later than that one (a lane runs its
    collectives in issue order). Off the GPU a request is done once finished.

    On a GPU a request's wait makes the stream wait for its collectives, and the updates
    queued after it run before the next forward's kernels. The forward waits for its first
    group's collectives in any case, hence for those issued before them too. A group
    issued after that one (a priority plan put the first layers' gradients ahead of it)
    is left to its own forward pre-hook: batched in, the forward would wait for it."""
    if request is None:
        return True
    if not request.done():
        return False
    seq = request.issue_seq
    return (seq is not None and seq <= cutoff) or request.finished()


def _sent(g: LayerGroup) -> torch.Tensor:
    """What the group's all-reduce sends: its buffer, or its copy in the communication
    type (``COMMSCHED_GRAD_REDUCE_DTYPE``)."""
    return g.buffer if g.comm is None else g.comm


def _narrows(dtype: torch.dtype, to: torch.dtype) -> bool:
    """Whether casting floating-point gradients of ``dtype`` to ``to`` halves their bytes
    or more (float32 or float64 to bfloat16 or float16); gradients already that narrow go
    as they are."""
    return dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(to).bits


def _running(request) -> bool:
    """Issued (done: on CUDA, once issued) but still running on the device."""
    return request is not None and request.done() and not request.finished()


def _issue_order(group: LayerGroup) -> float:
    """Where the group's pending request stands in its lane's issue order: -1 without
    one, infinity while it is not fully issued."""
    req = group.request
    if req is None:
        return -1
    return math.inf if req.issue_seq is None else req.issue_seq


def copy_flags(dst: torch.Tensor, values: List[bool]) -> None:
    """``dst[:] = values`` (1 or 0) without making the host wait for the device: all true
    is a fill; otherwise a copy from pinned memory queued on the stream (the caching host
    allocator keeps that memory until the copy ran). A copy from pageable memory would
    synchronise the stream, i.e. wait for every kernel queued so far."""
    if all(values):
        dst.fill_(1)
    elif dst.is_cuda:
        dst.copy_(torch.tensor(values, dtype=dst.dtype, pin_memory=True), non_blocking=True)
    else:
        dst.copy_(torch.tensor(values, dtype=dst.dtype))


def _plain():
    return torch._C.DisableTorchFunctionSubclass()


def _broadcast(tensors: List[torch.Tensor], group, src: int) -> None:
    """Broadcast ``tensors`` from ``src``, coalesced per dtype."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.broadcast(flat, src, group=group)
            off = 0
            for t in ts:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n

