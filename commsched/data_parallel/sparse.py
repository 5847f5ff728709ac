"""Row gradients of large embeddings (``Config.sparse_embedding_rows``).

An embedding lookup's gradient touches only the rows of the tokens looked up, and it is
complete only at the very end of backward (the lookup is the forward's first operation),
exactly when the next forward needs the weight first. Reduced densely it is the largest
collective of the iteration boundary (GPT-2's 50,257 x 1,024 floats: 206 MB, against 33.5 MB
for the 8,192 rows of a micro-batch of 8 x 1,024 tokens). Here the lookup runs through
``RowGradLookup``, which gives autograd no gradient for the weight and records the token ids
and output-gradient rows instead; at the end of backward both are all-gathered and
scattered into the weight's gradient slot (``index_add_``), divided by the group size:

  gradient = (sum over ranks of the dense contribution + sum over ranks of the rows) / ranks

the sum DDP computes, added in another order. A weight tied to an output layer keeps that
layer's dense contribution, which backward produces first: it goes in a layer group of its
own, submitted as soon as backward produced it, instead of with the first layers' group at
the end.

Every rank's backward must look up the same number of tokens (the all-gather's size): agreed
at the first synchronised backward, checked at each one after.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["RowGradLookup", "SparseSlot", "find_sparse_embeddings"]


def find_sparse_embeddings(module: torch.nn.Module, min_rows: int
                           ) -> List[Tuple[str, torch.nn.Embedding, bool]]:
    """(name, embedding, tied) for each ``nn.Embedding`` of ``module`` with at least
    ``min_rows`` rows whose dense weight gradient the row form can replace: trainable, not
    sparse, no ``max_norm`` (it renormalises rows in forward) and no
    ``scale_grad_by_freq``; ``tied``: the weight is also registered by another module
    (an output layer sharing it). 0: none."""
    if not min_rows:
        return []
    registrations = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        registrations[id(p)] = registrations.get(id(p), 0) + 1
    found = []
    for name, m in module.named_modules():
        if (type(m) is torch.nn.Embedding and m.weight.requires_grad
                and m.num_embeddings >= min_rows and not m.sparse and m.max_norm is None
                and not m.scale_grad_by_freq
                and all(e.weight is not m.weight for _, e, _ in found)):
            found.append((name, m, registrations[id(m.weight)] > 1))
    return found


class SparseSlot:
    """One embedding weight's row gradients in flight: the records of the backward(s)
    since the last synchronised one, the all-gather buffers (allocated once the token
    count is agreed), and the two requests (token ids, rows) of the current iteration."""

    __slots__ = ("name", "module", "weight", "tied", "anchor", "records", "tokens",
                 "ids_all", "rows_all", "requests")

    def __init__(self, name: str, module: torch.nn.Embedding, tied: bool):
        self.name = name
        self.module = module
        self.weight = module.weight
        self.tied = tied
        # A leaf that requires grad, so that the lookup's output does while the weight
        # enters it detached; it receives no gradient.
        self.anchor = torch.zeros((), device=module.weight.device, requires_grad=True)
        self.records: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.tokens: Optional[int] = None       # per rank and iteration, agreed
        self.ids_all: Optional[torch.Tensor] = None
        self.rows_all: Optional[torch.Tensor] = None
        self.requests: list = []

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding module's forward."""
        m = self.module
        return RowGradLookup.apply(self.anchor, ids, m.weight.detach(), m.padding_idx, self)

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The recorded (ids, rows) since the last call, concatenated; cleared."""
        records, self.records = self.records, []
        if not records:
            width = self.weight.shape[1]
            return (torch.empty(0, dtype=torch.long, device=self.weight.device),
                    self.weight.new_empty((0, width)))
        if len(records) == 1:
            return records[0]
        return (torch.cat([i for i, _ in records]), torch.cat([r for _, r in records]))

    def allocate(self, tokens: int, world_size: int) -> None:
        width = self.weight.shape[1]
        self.tokens = tokens
        self.ids_all = torch.zeros(world_size * tokens, dtype=torch.long,
                                   device=self.weight.device)
        self.rows_all = self.weight.new_zeros(world_size * tokens * width)

    def apply(self, grad: torch.Tensor, world_size: int) -> None:
        """Add the gathered rows, divided by ``world_size``, into ``grad`` (no_grad)."""
        grad.index_add_(0, self.ids_all, self.rows_all.view(-1, grad.shape[1]),
                        alpha=1.0 / world_size)


class RowGradLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward records (ids, output-gradient rows) in
    ``slot`` instead of returning a weight gradient (``weight`` enters detached: autograd
    has no edge to it); rows of ``padding_idx`` tokens are zero, as the dense gradient's
    row is."""

    @staticmethod
    def forward(ctx, anchor, ids, weight, padding_idx, slot):
        ctx.save_for_backward(ids)
        ctx.padding_idx = padding_idx
        ctx.slot = slot
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        flat = ids.reshape(-1)
        rows = grad.reshape(flat.numel(), grad.shape[-1])
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        ctx.slot.records.append((flat, rows))
        return None, None, None, None, None
