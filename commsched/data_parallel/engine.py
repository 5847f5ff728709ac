"""The data-parallel mode's engine: one (model, optimizer) pair, its layer groups and
their scheduler; the gradient side is submission.py, the deferred side actions.py.

One iteration, for layer groups g0 (first layer) .. g3 (last layer):

  training thread   fwd k ──► backward k ──────────────────► step() zero_grad() fwd k+1
  autograd hooks          g3 ready ─ g2 ready ─ g1 ready ─ g0 ready
  submissions             sub g3 ── sub g2 ─── sub g1 ──── sub g0 ─ end_iteration
  scheduler lane                [ar g3 ]  [ar g2 ]  [ar g1 ]   [ar g0 ]
  fwd k+1 pre-hooks                                          g0: wait ar g0, update g0, run
                                                             g1: wait ar g1, update g1, run ...
  step() records the hyper-parameters and returns; when each group's update runs is
  actions.py's to say.

The lane sends the groups in submission order for ``profile_iters`` iterations, then in
the order of its plan (policy priority): with whole groups and ``plan_forward``, the order
that ends the next forward soonest under a model of it (commsched.plan); a group may then
wait in the lane for one that the forward needs earlier.

State: the layout (groups, parameters and their slots, owners) is set here at
construction; the backward in progress belongs to the gradient side, pending requests and
actions to the deferred side.
"""

from __future__ import annotations

import functools
import hashlib
import types
import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from commsched.adapter import DATA_PARALLEL, adapter_config, build_scheduler, close
from commsched.config import MAX_BYTES, Config, ConfigError, env_fields
from commsched.errors import CommschedWarning, DataParallelError, UnavailableError
from commsched.safety import agreement_timeout, check_agreement
from commsched.scheduler import Scheduler
from commsched.version import __version__

from .actions import UPDATE, DeferredActions, ModuleHook, zero_action
from .groups import LayerGroup, build_groups, grad_view_class, narrows, plain, sent
from .sparse import SparseSlot, find_sparse_embeddings
from .storage import count_owned
from .submission import GradientSubmission
from .update import PER_GROUP, params_by_group, snapshot, step_subset, update_mode

__all__ = ["DataParallelEngine", "DataParallelWarning", "WHOLE", "sibling_group"]


class DataParallelWarning(CommschedWarning):
    """The data-parallel mode fell back to synchronous behaviour for a reason the user can fix."""


WHOLE = 0       # Scheduler.submit(partition_bytes=WHOLE): the request goes as one chunk


class DataParallelEngine(GradientSubmission, DeferredActions):
    """Everything the data-parallel mode does for one (model, optimizer) pair: the layer
    groups, the autograd and forward hooks, the submissions to the scheduler, and the
    deferred per-group actions (optimizer updates, zero_grad)."""

    decompose = "none"
    windowed = True     # groups_in_flight applies (see _lane_config)
    # A module's forward pre-hook is installed only while one of its groups has a request
    # or actions pending (see DeferredActions._arm): with none, the forward runs without
    # hooks.
    lazy_forward_hooks = True

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: Config, group=None, *, group_bytes: Optional[int] = None,
                 reads_grads: bool = False, broadcast_buffers: bool = True,
                 scheduler: Optional[Scheduler] = None, observer=None):
        if not dist.is_initialized():
            raise UnavailableError("commsched.wrap: torch.distributed is not initialized")
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
        variables = {f.name: f" ({var})" for var, f in env_fields().items()}
        for name, used in (("grad_reduce_dtype", config.grad_reduce_dtype is not None),
                           ("sparse_embedding_rows", embeddings)):
            if used and self.decompose != "none":
                where = variables.get(name, "")
                raise ConfigError(f"commsched.wrap: {name}={getattr(config, name)!r}{where} "
                                  f"needs decompose='none', not {self.decompose!r}")
        self.reduce_dtype = (None if config.grad_reduce_dtype is None
                             else getattr(torch, config.grad_reduce_dtype))
        # Untied row-gradient weights send no all-reduce: no copy in the narrower type.
        self._rows_only_weights = {id(m.weight) for _, m, tied in embeddings if not tied}
        self.groups, module_groups = build_groups(
            module, config.group_bytes if group_bytes is None else group_bytes,
            {id(m.weight): tied for _, m, tied in embeddings}, config.first_group_bytes)
        if not self.groups:
            raise ConfigError("commsched.wrap: the model has no parameter that requires grad")
        devices = {g.device for g in self.groups}
        if len(devices) > 1:
            raise ConfigError(f"commsched.wrap: parameters on several devices "
                              f"{sorted(map(str, devices))}; the data-parallel mode drives "
                              "one device per process")
        self.params: List[torch.nn.Parameter] = [p for g in self.groups for p in g.params]
        # The model's parameters in no layer group (frozen at wrap): the model's
        # zero_grad() clears theirs at once, as nn.Module's does.
        grouped = {id(p) for p in self.params}
        self.outside = [p for p in module.parameters() if id(p) not in grouped]
        self.names: List[str] = [n for g in self.groups for n in g.names]
        self.slot = [(g, j) for g in self.groups for j in range(len(g.params))]
        self.clean = [True] * len(self.params)    # slot known to be zero
        self.used = [False] * len(self.params)    # hook fired in this backward
        self._unused = [False] * len(self.params)
        self.view_cls = grad_view_class(self)

        # Before the first collective (the broadcast below): every rank wraps the same
        # model in the same groups, or its broadcast and every group's collectives would
        # pair with other tensors; a rank that never wraps is named within the bound.
        check_agreement(
            _layout(module, self.groups, self.decompose, config, broadcast_buffers), group,
            what="commsched.wrap", timeout_s=agreement_timeout(config.timeout_s))
        # Initial state from rank 0, like DDP.
        _broadcast([p.detach() for p in module.parameters()]
                   + [b for b in module.buffers()], group, self.src)
        # Gradients are reduced on a process group of their own. With a bounded credit
        # window the lane issues an iteration's last chunks from its completion thread
        # after backward returned, at times that differ between ranks: a collective the
        # application issues on ``group`` meanwhile (a loss average, a barrier) would pair
        # with different chunks on different ranks.
        self.reduce_group = sibling_group(group)
        # Layer groups are cut into chunks of the partition size (none by default), which
        # the plan may interleave: a chunk of a group the next forward needs first then
        # overtakes the queued chunks of others. Under a window of whole groups
        # (``groups_in_flight``) the queued groups are what overtakes, and each goes whole.
        lanes = config if scheduler is None else scheduler.config
        self.partition_bytes = (WHOLE if self._group_window(lanes) else None)
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
            # (the recorder records the window the lane runs under)
            scheduler, self.recorder = build_scheduler(
                self._lane_config(config), self.groups[0].device, adapter=DATA_PARALLEL,
                observer=observer, feeds_forward=True)
        self.scheduler = scheduler
        self._adopt_existing_grads()
        self._assign_owners()

        self.closed = False     # released (close(), or the wrapped model dropped)
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
        self._module_hooks: List[ModuleHook] = []
        self._group_modules: List[List[ModuleHook]] = [[] for _ in self.groups]
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
        self._own_zero_grad = None     # set on the model by route_zero_grad()
        count_owned(self.groups)

    def _lane_config(self, config: Config) -> Config:
        """The configuration of the engine's own scheduler: ``config``, with a credit window
        of ``groups_in_flight`` times the largest group's buffer where that is set and
        ``config`` leaves the window unbounded. Without one (the default) the plan orders
        the groups in the stream ([Note: order by the device's clock] in docs/design.md);
        under one, later groups wait in the lane, where the priority of the first layers'
        group, reduced last in backward and needed first by the next forward, puts it
        first."""
        config = adapter_config(config, DATA_PARALLEL)
        if not self._group_window(config):
            return config
        largest = max(sent(g).nbytes for g in self.groups)
        return config.replace(credit_bytes=min(config.groups_in_flight * largest, MAX_BYTES))

    def _group_window(self, config: Config) -> bool:
        """Whether the lane runs under a window of whole layer groups: ``groups_in_flight``
        set, where no byte window (or the tuner) applies."""
        return bool(self.windowed and config.groups_in_flight and not config.credit_bytes
                    and not config.autotune)

    @property
    def whole_groups(self) -> bool:
        """Whether each layer group goes as one collective."""
        return self.partition_bytes == WHOLE or not self.scheduler.config.partition_bytes

    @property
    def views_known(self) -> bool:
        """Whether every view of a group buffer that outlives its request is the engine's
        own (storage.py): whole groups all-reduced; partitioned chunks are views the lane
        keeps into the next iteration."""
        return self.whole_groups

    def _allocate(self) -> None:
        for g in self.groups:
            g.allocate(self.view_cls, flags=True)
            if (self.reduce_dtype is not None and narrows(g.dtype, self.reduce_dtype)
                    and id(g.params[0]) not in self._rows_only_weights):
                g.allocate_comm(self.reduce_dtype)
        # What a group's usage flags are set from when every parameter got a gradient:
        # copied with the gradients, in the same multi-tensor copy (see _adopt), not one
        # fill kernel per group and step.
        sizes: Dict[torch.dtype, int] = {}
        for g in self.groups:
            sizes[g.dtype] = max(sizes.get(g.dtype, 0), len(g.params))
        ones = {dtype: torch.ones(n, dtype=dtype, device=self.groups[0].device)
                for dtype, n in sizes.items()}
        self._ones = [ones[g.dtype].narrow(0, 0, len(g.params)) for g in self.groups]

    def _adopt_existing_grads(self) -> None:
        with torch.no_grad(), plain():
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
            entry = ModuleHook(m, hook)
            self._module_hooks.append(entry)
            for k in idx:
                self._group_modules[k].append(entry)

    def route_zero_grad(self) -> None:
        """The plain model's ``zero_grad()`` (of the model passed to wrap, which the loop
        may hold beside the wrapped one) goes through the engine, as the wrapped model's
        does: nn.Module's would set every ``.grad`` to None at once, and an update still
        pending would then find no gradient and skip its parameters. An instance
        attribute (``RoutedZeroGrad``), removed with the hooks; a model class with a
        ``zero_grad`` of its own, or one already set on the instance, keeps it."""
        module = self.module
        if (type(module).zero_grad is not torch.nn.Module.zero_grad
                or "zero_grad" in module.__dict__):
            return
        self._own_zero_grad = RoutedZeroGrad(self)
        module.zero_grad = self._own_zero_grad

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for entry in self._module_hooks:
            entry.clear()
        self._armed = [False] * len(self.groups)
        for g in self.sparse_groups:
            g.sparse.module.__dict__.pop("forward", None)     # the class's forward again
        if self._own_zero_grad is not None:
            if self.module.__dict__.get("zero_grad") is self._own_zero_grad:
                del self.module.__dict__["zero_grad"]          # nn.Module's again
            self._own_zero_grad = None

    def before_forward(self, sync: bool) -> None:
        """Called by the wrapper at the start of forward. Buffers are broadcast from rank 0
        before a forward that follows a synchronised training forward, as DDP does."""
        self._check_open("a forward")
        if self._buffers_stale and self.buffer_group is not None:
            # This broadcast's per-step kernels (the collective; a copy in and out where a
            # dtype has several buffers) are DDP's too (broadcast_buffers=True): every
            # rank's forward must see rank 0's buffers, whatever a forward did to them.
            _broadcast(self.buffers, self.buffer_group, self.src)
        grad = torch.is_grad_enabled()
        self._buffers_stale = grad and sync
        self._fresh = True
        if grad:
            self.sync = sync

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise DataParallelError(f"commsched.wrap: {what} after the wrapped model was closed "
                                    "(model.close(), or the model dropped)")

    def step(self, kwargs: dict) -> None:
        self._check_open("optimizer.step()")
        self._finish_backward()
        if self.mode != PER_GROUP:
            self.settle_all()
            with self._update_context():
                self.optimizer.step(**kwargs)
            self._recorder_step()
            return
        record = snapshot(self.optimizer.param_groups, kwargs)
        self._add_actions((UPDATE, record))
        if self.local:
            with self._update_context():
                step_subset(self.optimizer, record, self.local)
        self._recorder_step()

    def zero_grad(self, set_to_none: bool = True, every: bool = False) -> None:
        """The optimizer's zero_grad() (``every``: the model's, for all of its parameters),
        queued on every layer group behind its pending update (actions.py); parameters
        that no pending update reads are cleared now: the optimizer's outside the model,
        or the model's outside its layer groups."""
        self._check_open("model.zero_grad()" if every else "optimizer.zero_grad()")
        self._add_actions(zero_action(set_to_none, every))
        self._zero_now(set_to_none, every)

    def _zero_now(self, set_to_none: bool, every: bool) -> None:
        for params in ((self.outside,) if every else (ps for _, ps in self.local)):
            for p in params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def _recorder_step(self) -> None:
        if self.recorder is not None:
            self.recorder.step()

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
                "commsched data-parallel: gradients were read while their communication was in "
                "flight (clip_grad_norm_, GradScaler.unscale_, logging?): waiting for all "
                "gradient communication, so the optimizer step is synchronous and does not "
                "overlap the next forward. Pass wrap(..., reads_grads=True) to make this "
                "explicit and silence this warning.")
        self.drain()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, DataParallelWarning, stacklevel=3)

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
        """Drain, then release what the engine holds (``release``)."""
        if not self.closed:
            self.drain()
            self.release()

    def release(self) -> None:
        """Remove every hook, stop the scheduler's threads and destroy the engine's own
        process groups, with no collective and no wait for pending updates: what happens
        once the wrapped model and optimizer were dropped (see ``wrap``), after which
        nothing refers to the engine, the model or the optimizer state any more. The
        hooks are what held them: autograd keeps a parameter's hooks alive from C++, where
        the cycle collector cannot see that they refer back to the engine. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.remove_hooks()
        close(self.scheduler, self.recorder, drain=False)
        if dist.is_initialized():     # (else the groups went with the default group)
            for pg in self._own_groups():
                dist.destroy_process_group(pg)

    def _own_groups(self) -> list:
        return [self.reduce_group] + ([self.buffer_group] if self.buffer_group is not None
                                      else [])


class RoutedZeroGrad:
    """``zero_grad(set_to_none=True)`` of the plain model while it is wrapped: the engine's,
    for every parameter of the model. Holds the engine weakly: set on the model, it would
    otherwise close a cycle model -> engine -> model.

    A deep copy of the model (an EMA copy, say) is not wrapped: its ``zero_grad`` is
    nn.Module's, bound to the copy, where copying this object would copy the engine (its
    threads and process groups with it)."""

    __slots__ = ("engine",)

    def __init__(self, engine: "DataParallelEngine"):
        self.engine = weakref.ref(engine)

    def __call__(self, set_to_none: bool = True) -> None:
        engine = self.engine()
        if engine is None:
            raise DataParallelError("commsched.wrap: model.zero_grad() after the wrapped "
                                    "model was dropped")
        engine.zero_grad(set_to_none, every=True)

    def __deepcopy__(self, memo):
        engine = self.engine()
        copy = memo.get(id(engine.module)) if engine is not None else None
        if copy is None:
            return self
        return types.MethodType(torch.nn.Module.zero_grad, copy)


def sibling_group(group):
    """A new process group with the ranks of ``group`` (None: the world); collective over
    those ranks only."""
    if group is None:
        return dist.new_group()
    return dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)


def _layout(module: torch.nn.Module, groups: List[LayerGroup], decompose: str,
            config: Config, broadcast_buffers: bool) -> Dict[str, object]:
    """What decides the wrapped model's collectives, for the agreement check: the model
    (a line naming it, with a digest of every parameter's and buffer's name, shape and
    dtype), the layer groups' sizes and how they are reduced."""
    tensors = [(kind, name, tuple(t.shape), str(t.dtype))
               for kind, named in (("parameter", module.named_parameters()),
                                   ("buffer", module.named_buffers()))
               for name, t in named]
    digest = hashlib.sha256(repr(tensors).encode()).hexdigest()[:12]
    count = sum(p.numel() for p in module.parameters())
    return {
        "commsched version": __version__,
        "model": (f"{type(module).__name__}, {count:,} parameters in {len(tensors)} "
                  f"tensors (layout {digest})"),
        "layer groups (elements)": [g.numel for g in groups],
        "decompose": decompose, "grad_reduce_dtype": config.grad_reduce_dtype,
        "broadcast_buffers": broadcast_buffers,
    }


def _broadcast(tensors: List[torch.Tensor], group, src: int) -> None:
    """Broadcast ``tensors`` from ``src``, coalesced per dtype."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            if len(ts) == 1 and ts[0].is_contiguous():
                # (in place: no copy into a flat tensor and back for one buffer, say a
                # rotary embedding's frequencies, broadcast at every training forward)
                dist.broadcast(ts[0], src, group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.broadcast(flat, src, group=group)
            off = 0
            for t in ts:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n
