"""Node topology of a process group, and the sub-groups the topology-aware
decompositions run on.

Ranks are grouped into nodes of ``local_size`` consecutive ranks (torchrun numbers ranks
node by node; ``LOCAL_WORLD_SIZE`` says how many share a node, ``Config.local_size``
overrides it, e.g. so that 4 CPU processes act as 2 nodes of 2). For world 8, local 4:

  intra groups  [0 1 2 3] [4 5 6 7]        fast links inside a node
  inter groups  [0 4] [1 5] [2 6] [3 7]    one rank per node, same local index
  leaders       [0 4]                      local rank 0 of every node

Every rank creates every sub-group, in the same order (``new_group`` is collective over
the default group), once per lane.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch.distributed as dist

from .config import ConfigError

__all__ = ["Topology", "local_size_from_env", "node_layout"]


def local_size_from_env(configured: int, world: int) -> int:
    """``configured`` if set, else the launcher's LOCAL_WORLD_SIZE, else one node."""
    return _local_size(configured, world)[0]


def _local_size(configured: int, world: int) -> Tuple[int, str]:
    """The node size and where it came from (``node_layout``'s ``local_size_from``)."""
    if configured:
        return configured, "Config.local_size"
    text = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        found = int(text) if text is not None else 0
    except ValueError:
        found = 0
    if found:
        return found, "LOCAL_WORLD_SIZE"
    if text is None:
        return world, "one node (LOCAL_WORLD_SIZE unset)"
    return world, f"one node (LOCAL_WORLD_SIZE={text!r} is not a count)"


def node_layout(configured: int, world: int, rank: int) -> dict:
    """Where ``rank`` of a ``world``-rank group sits, as ``Topology`` would place it,
    without creating a group: ``nodes``, ``local_size``, ``node``, ``local_rank`` (None
    each where the ranks do not divide into nodes of ``local_size``) and
    ``local_size_from`` (where the node size came from)."""
    local, source = _local_size(configured, world)
    if local < 1 or world % local:
        return {"nodes": None, "local_size": local, "node": None, "local_rank": None,
                "local_size_from": source}
    node, local_rank = divmod(rank, local)
    return {"nodes": world // local, "local_size": local, "node": node,
            "local_rank": local_rank, "local_size_from": source}


class Topology:
    """Sub-groups of ``group`` for hierarchical and leader-based decompositions."""

    def __init__(self, group, local_size: int):
        if group is not dist.group.WORLD and group != dist.group.WORLD:
            raise ConfigError("decompose hier/leader/auto: supported on the default process "
                              "group only (sub-groups are created over it)")
        ranks = dist.get_process_group_ranks(group)
        world = len(ranks)
        if local_size < 1 or world % local_size:
            raise ConfigError(f"local_size={local_size} (LOCAL_WORLD_SIZE): the {world} ranks "
                              f"do not divide into nodes of {local_size}")
        me = dist.get_rank()
        self.local_size = local_size
        self.nodes = world // local_size
        position = ranks.index(me)
        self.node, self.local_rank = divmod(position, local_size)
        self.intra = self.inter = self.leaders = None
        # Global ranks of this rank's sub-group per role (telemetry records them per step).
        self.members = {}
        for n in range(self.nodes):
            members = ranks[n * local_size:(n + 1) * local_size]
            created = dist.new_group(members)
            if n == self.node:
                self.intra, self.members["intra"] = created, tuple(members)
        for i in range(local_size):
            members = [ranks[n * local_size + i] for n in range(self.nodes)]
            created = dist.new_group(members)
            if i == self.local_rank:
                self.inter, self.members["inter"] = created, tuple(members)
        self.members["leaders"] = tuple(ranks[n * local_size] for n in range(self.nodes))
        created = dist.new_group(list(self.members["leaders"]))
        self.is_leader = self.local_rank == 0
        self.leaders: Optional[object] = created if self.is_leader else None
        self.leader_rank = ranks[self.node * local_size]     # global rank of my node's leader
        self.auto_table = None   # decompose=auto: measured choices (calibrate.py), if any

    def group(self, role: str):
        return {"intra": self.intra, "inter": self.inter, "leaders": self.leaders}[role]

    def __repr__(self) -> str:
        return (f"Topology(nodes={self.nodes}, local_size={self.local_size}, "
                f"node={self.node}, local_rank={self.local_rank})")
