"""The data-parallel mode's deferred side: each layer group's pending actions (the optimizer
updates and zero_grad() calls recorded since its request was submitted) and the forward
gates that run them.

  step() records the hyper-parameters and returns; the update of a group runs when the
  group's request completed: at step() if the request is already done, in the forward
  pre-hook of the first module that needs it, or in drain(). Updates that can run at the
  same point run as one optimizer step (at step(), zero_grad(), drain(), and the first
  pre-hook of a forward): a step() call costs a fixed amount of Python whatever its size,
  and with many layer groups per-group steps cost more CPU than the whole update of DDP.
  It costs the device a little too: each call adds its own small kernels (a fused or
  foreach optimizer's step counters' increment, a partly filled last launch of each of
  its multi-tensor kernels), which the batching keeps to a few calls per iteration.

A zero_grad() call, the optimizer's or the model's (nn.Module's, which would otherwise set
every ``.grad`` to None at once, and the pending updates would find no gradient), is an
action queued behind the updates in the same way.

State owned here (the engine's, see engine.py): each group's ``request`` and ``actions``,
the forward pre-hooks installed while a group is pending (``_module_hooks``,
``_group_modules``, ``_armed``), ``_fresh`` and ``_in_update``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, NamedTuple, Optional

import torch

from .groups import LayerGroup, plain
from .storage import need_grads, release_comm, release_grads
from .update import StepRecord, step_subset

__all__ = ["DeferredActions", "ModuleHook", "UPDATE", "ZERO", "Zeroing", "zero_action"]

UPDATE, ZERO = "update", "zero"         # the kinds of a pending action


class Zeroing(NamedTuple):
    """What a zero_grad() asks of a layer group: gradients set to None or zeroed, of the
    parameters the optimizer holds (``optimizer.zero_grad()``) or of ``every`` one of the
    group's (the model's ``zero_grad()``, as nn.Module's)."""

    set_to_none: bool
    every: bool


# The four zeroing actions, made once: a zero_grad() per step queues one of them.
_ZERO_ACTIONS = {(s, e): (ZERO, Zeroing(s, e)) for s in (False, True) for e in (False, True)}


def zero_action(set_to_none: bool, every: bool) -> tuple:
    """The pending action of a zero_grad() call (see ``Zeroing``)."""
    return _ZERO_ACTIONS[bool(set_to_none), bool(every)]


class DeferredActions:
    """The deferred side of ``DataParallelEngine`` (a mixin: the engine holds the state)."""

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

    def settle_all(self) -> None:
        self._settle_groups(self.groups)

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
                    if kind == UPDATE:
                        updates.setdefault(id(arg), (arg, []))[1].append(g)
                    else:
                        zeros.setdefault(arg, []).append(g)
            if not updates and not zeros:
                for g in groups:
                    self._disarm(g)
                return
            for record, gs in updates.values():
                self._run_updates(record, gs)
            for zeroing, gs in zeros.items():
                self._run_zeros(gs, zeroing)

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
        with torch.no_grad(), plain():
            grad = g.grads[0]
            if not slot.tied:
                grad.zero_()
            slot.apply(grad, self.world_size)
        g.params[0].grad = g.grad_views[0]
        self.clean[g.first] = False

    @staticmethod
    def _unpack(g: LayerGroup) -> None:
        """The group's all-reduce completed (its request waited for): with a narrower
        communication type, its result cast back into the gradient buffer, which needs no
        memory before that (storage.py), and the copy's memory goes.

        The cast is a multi-tensor copy: its kernel reads and writes contiguous, aligned
        vectors, at the speed of the bytes, where ``Tensor.copy_`` between bfloat16 and
        float32 runs PyTorch's unrolled element-by-element cast."""
        if g.comm is not None:
            need_grads(g)
            with torch.no_grad(), plain():
                torch._foreach_copy_([g.buffer], [g.comm])
            release_comm(g)

    def _run(self, g: LayerGroup, action) -> None:
        kind, arg = action
        if kind == UPDATE:
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

    def _zero(self, g: LayerGroup, zeroing: Zeroing) -> None:
        whole = zeroing.every or g.fully_owned
        if whole and not zeroing.set_to_none and not g.released:
            g.buffer.zero_()
        self._zero_slots(g, zeroing, whole)
        if zeroing.set_to_none:
            release_grads(g, self.views_known, whole)

    def _run_zeros(self, groups: List[LayerGroup], zeroing: Zeroing) -> None:
        every = zeroing.every
        if not zeroing.set_to_none:
            buffers = [g.buffer for g in groups
                       if (every or g.fully_owned) and not g.released]
            if buffers:
                torch._foreach_zero_(buffers)      # one call, not one per group
        for g in groups:
            whole = every or g.fully_owned
            self._zero_slots(g, zeroing, whole)
            if zeroing.set_to_none:
                release_grads(g, self.views_known, whole)

    def _zero_slots(self, g: LayerGroup, zeroing: Zeroing, whole: bool) -> None:
        """zero_grad() of the group's parameters (``zeroing.every``: all of them, else
        those the optimizer owns), its buffer already zeroed where that takes every one
        (``whole``) and the gradients stay tensors. Set to None, a slot
        keeps its old values: the next backward overwrites it (see _grad_pre_hook), or
        zeroes it if its parameter gets no gradient (_prepare_submit). Where no parameter
        of the group keeps a gradient then, the caller gives its memory back
        (storage.py); a released group's slots hold nothing to zero, and stay not known
        to be zero."""
        set_to_none = zeroing.set_to_none
        first = g.first
        for j, p in enumerate(g.params):
            if not (whole or g.owned[j]):
                continue
            grad = p.grad
            if grad is not None and grad is not g.grad_views[j]:
                if set_to_none:
                    p.grad = None
                else:
                    with torch.no_grad(), plain():
                        grad.zero_()
                continue
            if set_to_none:
                p.grad = None
                self.clean[first + j] = False
                continue
            if g.released:
                continue
            if not whole:
                g.grads[j].zero_()
            self.clean[first + j] = True

    @contextlib.contextmanager
    def _update_context(self):
        """Optimizer updates run with GradView dispatch off, outside inference mode (state
        created lazily must be a normal tensor) and outside autocast."""
        device = self.groups[0].device.type
        self._in_update = True
        try:
            with plain(), torch.inference_mode(False), (
                    torch.autocast(device, enabled=False)
                    if torch.is_autocast_enabled(device) else contextlib.nullcontext()):
                yield
        finally:
            self._in_update = False


class ModuleHook:
    """A module's forward pre-hook, installed while at least one of its pending layer
    groups counts on it (DataParallelEngine._arm).

    Registered once; taken out and put back (first, as ``prepend=True`` registers it) under
    the same id as its groups come and go: a registration per iteration would make a
    handle and its weak references each time ([Note: no cycles on the hot path] in
    docs/design.md)."""

    __slots__ = ("module", "hook", "handle", "pending")

    def __init__(self, module: torch.nn.Module, hook) -> None:
        self.module, self.hook = module, hook
        self.handle = None
        self.pending = 0            # the module's armed groups

    def add(self) -> None:
        self.pending += 1
        if self.pending == 1:
            handle = self.handle
            hooks = self.module._forward_pre_hooks
            if handle is None or handle.hooks_dict_ref() is not hooks:
                self.handle = self.module.register_forward_pre_hook(self.hook, prepend=True)
            else:
                hooks[handle.id] = self.hook
                hooks.move_to_end(handle.id, last=False)

    def drop(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.handle is not None:
            self.handle.remove()

    def clear(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle, self.pending = None, 0


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
