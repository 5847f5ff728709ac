"""When a layer group's gradient storage exists: from the backward that writes it to the
update that reads it, as plain training's gradients do.

Plain training frees its gradients at ``zero_grad()`` (``set_to_none=True``, the default)
and autograd allocates them again in backward, as the forward's activations are freed; the
forward runs without them. A layer group's flat buffer (and its copy in the communication
type) would otherwise hold a gradient's worth of memory through the forward. So, as FSDP
frees and restores its unsharded parameters, the storage under the buffer is given back to
PyTorch's caching allocator (``untyped_storage().resize_(0)``), and restored later
(``resize_(nbytes)``): the tensor objects, their per-parameter views (``.grad``) and every
reference the engine holds stay as they are; only the memory under them comes and goes.

  step k:  backward: restore at the group's first write ─ copy in ─ all-reduce ─►
           update (step() or the next forward's pre-hook) ─ zero_grad(set_to_none) ─ release
  comm type (bfloat16): its copy lives from the copy in to the cast back, the fp32 buffer
           from the cast back to the release

Rules:
- Released only where nothing can read it: every parameter of the group holds no
  ``.grad`` (zero_grad with ``set_to_none=True`` ran for the whole group: the model's
  ``zero_grad()``, or the optimizer's where it owns all of the group's parameters), no
  request is pending, and nothing outside the engine
  holds one of the ``.grad`` objects (a gradient the loop kept) or, with whole layer
  groups all-reduced, any other view of the storage. With partitioned chunks and in
  rs_ag the lane keeps views of it into the next iteration, so only the ``.grad``
  objects are checked there: a view the loop made of a ``.grad`` and kept past
  ``zero_grad()`` reads nothing until the next backward's gradient. Otherwise it stays,
  as before: ``zero_grad(set_to_none=False)``, accumulation under ``no_sync()``, a
  gradient kept between steps.
- Restored when first written, not earlier: autograd hands each gradient over as a
  tensor of its own, and the group's copy-in (``_adopt``, one multi-tensor copy when the
  group is complete) is the buffer's first write; under ``no_sync()`` the first
  accumulation into a slot, in bfloat16 the cast back (the copy-in writes the copy). Its
  contents are undefined then and nothing reads them: every slot and usage flag is
  written by the copy-in (or zeroed for a parameter without a gradient) before the
  collective, so no memset of the whole buffer is needed.
- Embedding weights sending rows (``sparse.py``) keep their storage.

The release is ordered on the current stream after the update that read the buffer (and,
for the communication copy, after the cast back, itself after the wait for the
collective): the caching allocator hands the block out again only to work queued after
it on that stream.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["storage_uses", "release", "restore", "is_released", "count_owned", "release_grads",
           "need_grads", "release_comm", "need_comm"]


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors share the storage under ``t`` (its use count)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def is_released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def release(t: torch.Tensor) -> None:
    """Give the memory under ``t`` back to the allocator; ``t`` and its views stay."""
    t.untyped_storage().resize_(0)


def restore(t: torch.Tensor) -> None:
    """Memory under ``t`` again (contents undefined), at the same views."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def count_owned(groups) -> None:
    """Record how many tensors of the engine's own (the buffer, its slots, ``.grad`` views,
    flags, rs_ag's shard gradients) share each group's storages: one more at a release is
    a view held elsewhere."""
    for g in groups:
        g.uses = storage_uses(g.buffer)
        g.view_refs = _view_refs(g)


def release_grads(g, views_known: bool = True, whole: bool = False) -> None:
    """zero_grad(set_to_none=True) ran for ``g``: give its buffer's memory back where
    nothing can read it any more (module docstring). ``views_known``: no view of the
    buffer but the engine's own outlives a request, so one more is somebody else's
    (whole layer groups all-reduced); where the lane keeps views of it into the next
    iteration (partitioned chunks, rs_ag's shards), only the ``.grad`` objects are
    checked. ``whole``: that zero_grad() took every parameter of the group (the model's
    zero_grad(), or the optimizer's where it owns them all), so that no slot is left
    known to be zero: a released slot holds nothing."""
    if (g.released or not (whole or g.fully_owned) or g.sparse is not None
            or g.request is not None):
        return
    for p in g.params:
        if p.grad is not None:
            return
    if (not views_known or storage_uses(g.buffer) == g.uses) and _view_refs(g) == g.view_refs:
        release(g.buffer)
        g.released = True


def _view_refs(g) -> int:
    # A ``.grad`` the loop kept is one of the group's own view objects (``p.grad`` hands
    # out the object set there): it adds a Python reference, not a tensor on the storage.
    return sum(map(sys.getrefcount, g.grad_views))


def need_grads(g) -> None:
    """``g``'s buffer is about to be written: its memory back, where it was released."""
    if g.released:
        restore(g.buffer)
        g.released = False


def release_comm(g) -> None:
    """``g``'s copy in the communication type was cast back: its memory goes until the next
    backward's copy in. Nothing but the engine and the lane (whose collectives on it
    were waited for) ever holds a view of it."""
    if not g.comm_released and g.sparse is None:
        release(g.comm)
        g.comm_released = True


def need_comm(g) -> None:
    """``g``'s copy in the communication type is about to be written."""
    if g.comm_released:
        restore(g.comm)
        g.comm_released = False
