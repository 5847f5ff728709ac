"""The collectives a chunk step runs, and the decompositions of an all-reduce.

A request's op is run on each chunk as a fixed list of steps:

  op              decompose  steps
  all_reduce      none       all_reduce
  all_reduce      rs_ag      reduce_scatter, all_gather  (in place: shard r of the chunk)
  reduce_scatter  -          reduce_scatter               (piece of every shard -> own piece)
  all_gather      -          all_gather                   (own piece -> piece of every shard)
  all_reduce      hier       reduce_scatter:intra, all_reduce:inter (of the own shard),
                             all_gather:intra
  all_reduce      leader     reduce:intra (to the node's leader), all_reduce:leaders
                             (leaders only), broadcast:intra

Steps named ``op:role`` run on a sub-group of the topology (topology.py); consecutive steps
on different groups are ordered by the scheduler (on the device for NCCL, on the host for
gloo), since different groups run on different streams or threads.

In-place reduce-scatter / all-gather use the buffer layout NCCL documents for in-place
operation (the output is the rank's own slice of the input), so no copy is made, except for
an all-reduce chunk whose length is not a multiple of the group size: that one chunk is
padded into a staging buffer and copied back when its last step finished.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

__all__ = ["averages_in_collective", "steps_for", "issue_step", "finish_chunk",
           "all_reduce_options",
           "reduce_scatter_options", "all_gather_options", "OptionsByOp"]

# Single-tensor reduce-scatters and all-gathers go to the process group's own methods, as
# all-reduces go to ``group.allreduce``: the ``dist`` functions add argument checks, a
# coalescing check and logging wrappers that cost more than the rest of a request's
# dispatch. torch >= 2.13 names them ``*_single`` (the old names warn there); older
# releases (the GPU image has 2.11) only have the old ones.
_PG = dist.ProcessGroup
_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG
_pg_reduce_scatter = getattr(_PG, "reduce_scatter_single", None) or _PG._reduce_scatter_base
_pg_all_gather = getattr(_PG, "all_gather_single", None) or _PG._allgather_base


def averages_in_collective(backend: str, cuda: bool, world_size: int,
                           reference_averages: bool = False) -> bool:
    """Whether an average over a group runs inside the collective (``ReduceOp.AVG``): on
    NCCL with CUDA tensors (gloo has no AVG), wherever that gives the numbers of the
    adapter's reference. ``reference_averages``: the reference averages inside the
    collective itself (Megatron-LM's ``average_in_collective``), so AVG is its numbers on
    any group. Otherwise the reference divides (DDP), and AVG (a multiply by 1/n before
    the sum) gives the same numbers only where 1/n is exact: power-of-two groups.
    Elsewhere the adapter scales first and sums. Every adapter asks this one function.

    Example::
        averages_in_collective(str(dist.get_backend(group)), tensor.is_cuda,
                               dist.get_world_size(group))
    """
    if not (cuda and "nccl" in backend.lower() and world_size > 0):
        return False
    return reference_averages or world_size & (world_size - 1) == 0


_STEPS = {
    ("all_reduce", "none"): ("all_reduce",),
    ("all_reduce", "rs_ag"): ("reduce_scatter", "all_gather"),
    ("reduce_scatter", "none"): ("reduce_scatter",),
    ("reduce_scatter", "rs_ag"): ("reduce_scatter",),
    ("all_gather", "none"): ("all_gather",),
    ("all_gather", "rs_ag"): ("all_gather",),
}


_TOPOLOGY_STEPS = {
    "hier": ("reduce_scatter:intra", "all_reduce:inter", "all_gather:intra"),
    "leader": ("reduce:intra", "all_reduce:leaders", "broadcast:intra"),
}


def steps_for(op: str, decompose: str, topology=None) -> Tuple[str, ...]:
    """The collectives run, in order, on each chunk of a request (by this rank: in the
    leader decomposition only the leaders take part in the step between nodes)."""
    if op == "all_reduce" and decompose in _TOPOLOGY_STEPS:
        steps = _TOPOLOGY_STEPS[decompose]
        if decompose == "leader" and not topology.is_leader:
            steps = tuple(s for s in steps if not s.endswith(":leaders"))
        return steps
    return _STEPS[(op, "none" if decompose in _TOPOLOGY_STEPS else decompose)]


def parts_for(op: str, decompose: str, world_size: int, topology=None) -> int:
    """What an all-reduce chunk's length must divide by (only the last chunk is padded)."""
    if op != "all_reduce":
        return 1
    if decompose == "rs_ag":
        return world_size
    if decompose == "hier":
        return topology.local_size
    return 1


def all_reduce_options(reduce_op, async_op: bool = True) -> "dist.AllreduceOptions":
    """Options for ``ProcessGroup.allreduce``, built once per lane and reduction rather than
    per chunk; ``async_op=False``: a synchronous collective (on NCCL: in the caller's
    stream, no work returned)."""
    options = dist.AllreduceOptions()
    options.reduceOp = reduce_op
    options.asyncOp = async_op
    return options


def reduce_scatter_options(reduce_op) -> "dist.ReduceScatterOptions":
    """Options of an asynchronous whole reduce-scatter, built once per lane and reduction."""
    options = dist.ReduceScatterOptions()
    options.reduceOp = reduce_op
    options.asyncOp = True
    return options


def all_gather_options():
    """Options of an asynchronous whole all-gather, built once per lane."""
    options = dist.distributed_c10d.AllgatherOptions()
    options.asyncOp = True
    return options


class OptionsByOp:
    """A collective's options per reduction, each built once (``build(reduce_op)``):
    ``get(reduce_op)``. SUM and AVG are found by identity first, since hashing a ReduceOp
    costs more than the rest of the lookup."""

    __slots__ = ("build", "sum", "avg", "more")

    def __init__(self, build):
        self.build = build
        self.sum = build(_SUM)
        self.avg = build(_AVG)
        self.more: dict = {}

    def get(self, reduce_op):
        if reduce_op is _SUM:
            return self.sum
        if reduce_op is _AVG:
            return self.avg
        options = self.more.get(reduce_op)
        if options is None:
            options = self.more[reduce_op] = self.build(reduce_op)
        return options


def issue_step(chunk, step: int):
    """Issue step ``step`` of ``chunk`` as an async collective; returns the work handle."""
    req = chunk.request
    name = req.steps[step]
    group = req.group
    if ":" in name:
        return _issue_topology_step(chunk, name)
    if req.op == "all_reduce":
        if name == "all_reduce":
            # The process group's own method: dist.all_reduce adds argument checks and a
            # logging wrapper that cost more than the rest of a chunk's dispatch.
            return group.allreduce([chunk.view()], req.reduce_options)
        buf = chunk.staging if chunk.staging is not None else _rs_ag_buffer(chunk)
        shard = buf.numel() // req.world_size
        own = buf.narrow(0, req.rank * shard, shard)
        if name == "reduce_scatter":
            return _pg_reduce_scatter(group, own, buf,
                                      req.lane.issuer.scatter_options(req.reduce_op))
        return _pg_all_gather(group, buf, own, req.lane.issuer.gather_options)
    whole = chunk.numel * req.world_size == req.tensor.numel()
    if req.op == "reduce_scatter":
        if whole:
            own = req.tensor.narrow(0, req.rank * chunk.numel, chunk.numel)
            return _pg_reduce_scatter(group, own, req.tensor,
                                      req.lane.issuer.scatter_options(req.reduce_op))
        pieces = chunk.shard_pieces()
        return dist.reduce_scatter(pieces[req.rank], pieces, op=req.reduce_op, group=group,
                                   async_op=True)
    if whole:
        own = req.tensor.narrow(0, req.rank * chunk.numel, chunk.numel)
        return _pg_all_gather(group, req.tensor, own, req.lane.issuer.gather_options)
    pieces = chunk.shard_pieces()
    return dist.all_gather(pieces, pieces[req.rank], group=group, async_op=True)


def _issue_topology_step(chunk, name: str):
    req = chunk.request
    topo = req.lane.topology
    op, role = name.split(":")
    group = topo.group(role)
    if op == "reduce":
        return dist.reduce(chunk.view(), dst=topo.leader_rank, op=req.reduce_op, group=group,
                           async_op=True)
    if op == "broadcast":
        return dist.broadcast(chunk.view(), src=topo.leader_rank, group=group, async_op=True)
    if role == "leaders":
        return dist.all_reduce(chunk.view(), op=req.reduce_op, group=group, async_op=True)
    buf = chunk.staging if chunk.staging is not None else _rs_ag_buffer(chunk, topo.local_size)
    shard = buf.numel() // topo.local_size
    own = buf.narrow(0, topo.local_rank * shard, shard)
    if op == "reduce_scatter":
        return _pg_reduce_scatter(group, own, buf,
                                  req.lane.issuer.scatter_options(req.reduce_op))
    if op == "all_reduce":
        return dist.all_reduce(own, op=req.reduce_op, group=group, async_op=True)
    return _pg_all_gather(group, buf, own, req.lane.issuer.gather_options)


def _rs_ag_buffer(chunk, parts: int = 0) -> torch.Tensor:
    """The chunk itself when its length divides into ``parts`` (default: the group size),
    else a zero-padded copy."""
    view = chunk.view()
    world = parts or chunk.request.world_size
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
