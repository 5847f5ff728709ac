"""The collectives a chunk step runs, and the decompositions of an all-reduce.

A request's op is run on each chunk as a fixed list of steps:

  op              decompose  steps
  all_reduce      none       all_reduce
  all_reduce      rs_ag      reduce_scatter, all_gather  (in place: shard r of the chunk)
  reduce_scatter  -          reduce_scatter               (piece of every shard -> own piece)
  all_gather      -          all_gather                   (own piece -> piece of every shard)

In-place reduce-scatter / all-gather use the buffer layout NCCL documents for in-place
operation (the output is the rank's own slice of the input), so no copy is made, except for
an all-reduce chunk whose length is not a multiple of the group size: that one chunk is
padded into a staging buffer and copied back when its last step finished.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

__all__ = ["steps_for", "issue_step", "finish_chunk"]

# torch >= 2.13 renamed the single-tensor forms and deprecates the old names (with a
# warning on every call); older releases (the GPU image has 2.11) only have the old ones.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_STEPS = {
    ("all_reduce", "none"): ("all_reduce",),
    ("all_reduce", "rs_ag"): ("reduce_scatter", "all_gather"),
    ("reduce_scatter", "none"): ("reduce_scatter",),
    ("reduce_scatter", "rs_ag"): ("reduce_scatter",),
    ("all_gather", "none"): ("all_gather",),
    ("all_gather", "rs_ag"): ("all_gather",),
}


def steps_for(op: str, decompose: str) -> Tuple[str, ...]:
    """The collectives run, in order, on each chunk of a request."""
    return _STEPS[(op, decompose)]


def all_reduce_options(reduce_op) -> "dist.AllreduceOptions":
    """Options for ``ProcessGroup.allreduce``, built once per request rather than per chunk."""
    options = dist.AllreduceOptions()
    options.reduceOp = reduce_op
    return options


def issue_step(chunk, step: int):
    """Issue step ``step`` of ``chunk`` as an async collective; returns the work handle."""
    req = chunk.request
    name = req.steps[step]
    group = req.group
    if req.op == "all_reduce":
        if name == "all_reduce":
            # The process group's own method: dist.all_reduce adds argument checks and a
            # logging wrapper that cost more than the rest of a chunk's dispatch.
            return group.allreduce([chunk.view()], req.reduce_options)
        buf = chunk.staging if chunk.staging is not None else _rs_ag_buffer(chunk)
        shard = buf.numel() // req.world_size
        own = buf.narrow(0, req.rank * shard, shard)
        if name == "reduce_scatter":
            return _reduce_scatter_single(own, buf, op=req.reduce_op, group=group, async_op=True)
        return _all_gather_single(buf, own, group=group, async_op=True)
    whole = chunk.numel * req.world_size == req.tensor.numel()
    if req.op == "reduce_scatter":
        if whole:
            own = req.tensor.narrow(0, req.rank * chunk.numel, chunk.numel)
            return _reduce_scatter_single(own, req.tensor, op=req.reduce_op, group=group,
                                          async_op=True)
        pieces = chunk.shard_pieces()
        return dist.reduce_scatter(pieces[req.rank], pieces, op=req.reduce_op, group=group,
                                   async_op=True)
    if whole:
        own = req.tensor.narrow(0, req.rank * chunk.numel, chunk.numel)
        return _all_gather_single(req.tensor, own, group=group, async_op=True)
    pieces = chunk.shard_pieces()
    return dist.all_gather(pieces, pieces[req.rank], group=group, async_op=True)


def _rs_ag_buffer(chunk) -> torch.Tensor:
    """The chunk itself when its length divides by the group size, else a padded copy."""
    view = chunk.view()
    world = chunk.request.world_size
    if view.numel() % world == 0:
        return view
    padded = view.new_zeros((view.numel() + world - 1) // world * world)
    padded.narrow(0, 0, view.numel()).copy_(view)
    chunk.staging = padded
    return padded


def finish_chunk(chunk) -> None:
    """Copy a padded chunk's result back into the request's tensor, after its last step.
    The staging buffer stays referenced until the chunk completed on the device."""
    if chunk.staging is not None:
        chunk.view().copy_(chunk.staging.narrow(0, 0, chunk.numel))
