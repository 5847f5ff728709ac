"""Partitioning a request's flat tensor into chunks.

Chunks are zero-copy views of the request's tensor. Where a reduce-scatter needs the chunk
length to be a multiple of the group size, every chunk but the last is cut at such a
multiple, and only the last is padded (through a small staging buffer) — see collectives.py.

Shapes, for a group of size W:
  all_reduce      tensor[n]           chunk j = tensor[j*e : (j+1)*e]
  reduce_scatter  tensor[W*S]         chunk j = piece j of every shard: the W views
  all_gather      (shard r = tensor[r*S:(r+1)*S])   tensor[i*S + j*p : i*S + (j+1)*p], i < W
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["Chunk", "partition", "SLIVER"]

# A remainder under 1/SLIVER of the partition size rides with the last chunk (see partition).
SLIVER = 8


class Chunk:
    """One schedulable unit: a contiguous piece of an all-reduce, or the same piece of
    every shard of a reduce-scatter / all-gather. Carries its dispatch-time state.
    ``request`` is None once the lane is done with the chunk (see lane.release)."""

    __slots__ = (
        "request", "index", "offset", "numel", "nbytes",
        "steps_done", "works", "staging", "t_dispatch_ns", "t_start_ns", "start_event",
        "__weakref__",
    )

    def __init__(self, request, index: int, offset: int, numel: int, nbytes: int):
        self.request = request
        self.index = index
        self.offset = offset      # element offset: in the tensor (all_reduce) or in each shard
        self.numel = numel        # elements: of the view (all_reduce) or of each shard piece
        self.nbytes = nbytes      # payload bytes of the whole chunk (all ranks' pieces)
        self.steps_done = 0
        self.works = None
        self.staging = None
        self.t_dispatch_ns = 0
        self.t_start_ns = 0
        self.start_event = None

    def view(self) -> torch.Tensor:
        """The contiguous slice of an all-reduce chunk (the tensor itself when whole)."""
        tensor = self.request.tensor
        if self.offset == 0 and self.numel == tensor.numel():
            return tensor
        return tensor.narrow(0, self.offset, self.numel)

    def shard_pieces(self) -> List[torch.Tensor]:
        """Piece ``index`` of every shard (reduce-scatter / all-gather chunks)."""
        req = self.request
        shard = req.tensor.numel() // req.world_size
        return [req.tensor.narrow(0, i * shard + self.offset, self.numel)
                for i in range(req.world_size)]

    def __repr__(self) -> str:
        key = "released" if self.request is None else repr(self.request.key)
        return (f"Chunk({key}#{self.index}, offset={self.offset}, "
                f"numel={self.numel}, bytes={self.nbytes})")


def partition(request, partition_bytes: int, multiple: int) -> List[Chunk]:
    """Cut ``request`` into chunks of ``partition_bytes`` payload bytes; a remainder of
    less than 1/``SLIVER`` of that is folded into the last chunk (which may then be up to
    that much larger) instead of going as a sliver of its own: a collective costs its host
    and launch overhead whatever its size, and a layer group of exactly the partition size
    plus a few usage flags would otherwise cost two.

    ``multiple``: chunk lengths (all but the last) of an all-reduce are rounded down to a
    multiple of it — the group size when the chunk is decomposed into reduce-scatter +
    all-gather, so that only the last chunk may need padding. ``partition_bytes == 0``
    means one chunk.
    """
    tensor = request.tensor
    itemsize = tensor.element_size()
    world = request.world_size
    if request.op == "all_reduce":
        total = tensor.numel()
        if partition_bytes == 0 or total * itemsize <= partition_bytes:
            return [Chunk(request, 0, 0, total, total * itemsize)]
        per_chunk = total if partition_bytes == 0 else max(1, partition_bytes // itemsize)
        if multiple > 1 and per_chunk < total:
            per_chunk = max(multiple, per_chunk - per_chunk % multiple)
        return [Chunk(request, j, start, numel, numel * itemsize)
                for j, (start, numel) in enumerate(_pieces(total, per_chunk))]
    # reduce_scatter / all_gather: split each shard into pieces of the same offsets.
    shard = tensor.numel() // world
    per_piece = shard if partition_bytes == 0 else max(1, partition_bytes // (itemsize * world))
    return [Chunk(request, j, start, numel, numel * itemsize * world)
            for j, (start, numel) in enumerate(_pieces(shard, per_piece))]


def _pieces(total: int, size: int) -> List[Tuple[int, int]]:
    """(start, length) of consecutive pieces of ``size`` covering ``total`` elements, the
    last one taking a remainder of less than size/SLIVER with it; one empty piece for 0."""
    if total <= size:
        return [(0, total)]
    count, rest = divmod(total, size)
    if rest and rest * SLIVER >= size:
        count += 1
    return [(j * size, size if j < count - 1 else total - j * size) for j in range(count)]
