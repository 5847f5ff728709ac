"""The data-parallel mode's gradient side: autograd hooks, and the submission of layer
groups to the scheduler in an order every rank shares.

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

State owned here (the engine's, see engine.py): ``_bw``, ``_bw_iter``, ``_next`` (the
backward in progress and the next group to submit), ``used`` and each group's ``ready``
count, ``submitted_iter``.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch

from commsched.errors import DataParallelError

from .actions import UPDATE
from .groups import LayerGroup, copy_flags, plain, sent
from .storage import need_comm, need_grads

__all__ = ["GradientSubmission"]


class GradientSubmission:
    """The autograd side of ``DataParallelEngine`` (a mixin: the engine holds the state)."""

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
            raise DataParallelError(
                f"commsched data-parallel: parameter {self.names[i]!r} received a gradient after "
                "its layer group was handed to communication in this backward (reentrant "
                "checkpointing, or a parameter reached twice through separate graphs?). "
                "Use torch.utils.checkpoint with use_reentrant=False, and no_sync() for "
                "gradient accumulation.")
        if g.request is not None or g.actions:
            if any(a[0] == UPDATE for a in g.actions):
                raise DataParallelError(
                    f"commsched data-parallel: parameter {self.names[i]!r} was used in forward "
                    "before the pending optimizer update of its layer group was applied: it "
                    "is used outside the forward of the module that owns it. Call "
                    "commsched.drain(model) before such a forward, or use "
                    "DistributedDataParallel for this model.")
            self._settle(g)
        if g.released and (not self.sync or grad.is_sparse):
            need_grads(g)       # accumulated into the slot from the first (storage.py)
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
        raise DataParallelError(
            f"commsched data-parallel: embedding weight {self.names[i]!r} received a dense "
            "gradient from outside its module's lookup (an output layer sharing it "
            "through a functional call?), but sends its gradient as rows "
            "(Config.sparse_embedding_rows): tie it by registering the same "
            "Parameter in the output module, or set sparse_embedding_rows=0")

    def _before_accumulate(self, g: LayerGroup, i: int) -> None:
        """Checks of the rs_ag variant."""

    def _grad_post_hook(self, i: int, param) -> None:
        g, j = self.slot[i]
        if not self.sync:
            # Under no_sync() the next micro-batches accumulate into the slot.
            grad = param.grad
            if grad is not g.grad_views[j]:
                with torch.no_grad(), plain():
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
        self.used[:] = self._unused         # (in place: no list per backward)
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

    def _finish_backward(self) -> None:
        # Normally the end-of-backward callback did this; it did not if backward raised.
        if self._bw:
            self._flush()
            self._bw = False

    def _submit_ready(self) -> None:
        while self._next >= 0:
            g = self.groups[self._next]
            if g.ready != len(g.params):
                return
            self._submit(g)
            self._next -= 1
        if not self.sparse_groups:
            self._end_iteration()

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
        exactly this rank's contribution: .grad if defined, else 0; and its usage flags
        all 1 where every parameter got a gradient (else _submit sets them)."""
        g.all_used = g.ready == len(g.params)
        self._adopt(g, zero_missing=True, into=None if g.comm is None else g.comm_grads,
                    flags=g.all_used)

    def _adopt(self, g: LayerGroup, zero_missing: bool = False,
               into: Optional[List[torch.Tensor]] = None, flags: bool = False) -> None:
        """Copy into their slots the group's gradients that are not slot views (handed
        over by autograd, or set by the caller), in one multi-tensor copy, and make .grad
        the slot; ``zero_missing``: zero the slots of parameters without a gradient;
        ``flags``: set the group's usage flags to 1 in the same copy.

        ``into`` (the per-parameter views of the group's copy in the communication type):
        copy every gradient there instead, from its slot or from where it was handed
        over, cast in the same copy, and zero there every missing one. The slots are
        then written once, by the cast back (_unpack), not once more before it."""
        first = g.first
        if into is None:
            need_grads(g)
        else:
            need_comm(g)
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
        if flags and g.flags is not None:
            dst.append(g.flags if into is None else g.comm_flags)
            src.append(self._ones[g.index])
        if dst or zero:
            with torch.no_grad(), plain():
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
        if not g.all_used:
            copy_flags(g.flags if g.comm is None else g.comm_flags,
                       self.used[g.first:g.first + len(g.params)])
        request = self.scheduler.submit(sent(g), key=g.index, priority=g.priority,
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
                raise DataParallelError(
                    f"commsched data-parallel: embedding {slot.name!r} looked up {tokens} tokens "
                    f"in this backward, {slot.tokens} in the first: with "
                    "sparse_embedding_rows every backward must look up as many "
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
            raise DataParallelError(
                f"commsched data-parallel: embedding {g.sparse.name!r} looked up {counts} tokens "
                "on ranks 0.. in the first backward: with sparse_embedding_rows "
                "every rank must look up as many (pad the batch, or set it to 0)")
        g.sparse.allocate(tokens, self.world_size)
        rows = g.sparse.weight.shape[0]
        if self.world_size * tokens >= rows:
            # A ring all-reduce sends about twice the weight per rank, the all-gather the
            # rows of every rank: at as many rows as the weight has, the dense one is
            # cheaper or about even.
            self._warn_once(
                "rows",
                f"commsched data-parallel: embedding {g.sparse.name!r} sends "
                f"{self.world_size} x {tokens} gradient rows per backward, at least its "
                f"{rows} rows: the dense all-reduce would send about as much or less; "
                "raise sparse_embedding_rows above its rows or set it to 0")

    def _end_iteration(self) -> None:
        self.scheduler.end_iteration(self.reduce_group)
        self._iter += 1
