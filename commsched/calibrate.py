"""``COMMSCHED_DECOMPOSE=auto``: choose each chunk's decomposition from measured costs.

When a lane first needs its topology for ``auto``, every rank times one all-reduce of each
candidate decomposition (``none``, ``hier``, ``leader``; the topology-aware ones only when
there is more than one node) at a ladder of sizes, on the lane's device and dtype::

    sizes      4 KiB, 16 KiB, ... 16 MiB (x4)
    per size   1 untimed + ``REPEATS`` timed runs of each candidate, device-synchronised

The per-rank times are then all-reduced with MAX (a collective is as slow as its slowest
rank), so every rank holds the same table and makes the same choice for the same chunk
size: invariant 1 holds because the choice depends only on the chunk's size and values
every rank agreed on. A chunk takes the winner of the smallest calibrated size that is at
least its own (the largest size's winner beyond it).

The winner at a size (:func:`winner`): starting from ``none``, ``hier`` and then ``leader``
each take over only where they measured more than ``AUTO_MARGIN`` (20%) faster than the
one chosen so far (under 0.8 x its time). So ``auto`` leaves ``none`` only for a
decomposition more than 20% faster than it, and no candidate beat the one chosen by more
than 20%. Each launch measures anew, and where two candidates came out close the fastest
was a matter of noise: two launches of one job could run different collectives. Within the
margin the earlier candidate costs about the same, so it is kept; ``none``, the plain
collective, comes first.

Calibration runs synchronously, at a point every rank reaches in the same collective
sequence with nothing of the lane in flight: the lane's first request (the scheduler falls
back to the static size rule, :func:`static_choice`, when ``auto`` is first asked for by a
per-request override while chunks are in flight). It is done once per lane.

Example::
    table = calibrate(topology, torch.device("cuda", 0), torch.float32)
    table.choose(1 << 20)        # -> "hier", say
    print(table.describe())      # by chunk size: up to 64 KiB none, above: hier
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from . import notices
from .config import ConfigError
from .observer import AutoChoice

__all__ = ["AutoTable", "announce", "calibrate", "run_decomposition", "static_choice",
           "winner", "CALIBRATION_SIZES", "REPEATS", "AUTO_MARGIN"]

CALIBRATION_SIZES: Tuple[int, ...] = tuple(4096 << (2 * i) for i in range(7))  # 4K .. 16M
REPEATS = 3
CANDIDATES = ("none", "hier", "leader")
# A candidate later in CANDIDATES takes a size over only where it measured faster than the
# one chosen so far by more than this fraction of that one's time (the module docstring).
AUTO_MARGIN = 0.2

# torch >= 2.13 names them ``*_single`` (the old names warn there); older releases (the
# GPU image has 2.11) only have the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The static rule (no measurements): below this chunk size a collective is latency-bound,
# and the leader decomposition runs one inter-node all-reduce among few ranks instead of
# one per local rank.
STATIC_LEADER_BELOW_BYTES = 1 << 20


def static_choice(nodes: int, chunk_bytes: int) -> str:
    """The size rule used before (or instead of) calibration."""
    if nodes == 1:
        return "none"
    return "leader" if chunk_bytes < STATIC_LEADER_BELOW_BYTES else "hier"


def winner(candidates: Sequence[str], times: Sequence[float],
           margin: float = AUTO_MARGIN) -> str:
    """Of ``candidates`` (in order of preference) with their ``times``: starting from the
    first, each next one takes over where its time is under ``(1 - margin)`` x the time
    of the one chosen so far."""
    best = 0
    for i in range(1, len(times)):
        if times[i] < (1.0 - margin) * times[best]:
            best = i
    return candidates[best]


class AutoTable:
    """Measured time per (size, candidate), identical on every rank, and the choice it
    implies per chunk size: at each size the :func:`winner` under ``margin``."""

    def __init__(self, sizes: Sequence[int], candidates: Sequence[str],
                 times_us: Sequence[Sequence[float]], margin: float = AUTO_MARGIN):
        self.sizes = tuple(sizes)
        self.candidates = tuple(candidates)
        self.times_us = tuple(tuple(row) for row in times_us)   # [size][candidate]
        self.margin = margin
        self.winners = tuple(winner(self.candidates, row, margin) for row in self.times_us)

    def choose(self, chunk_bytes: int) -> str:
        i = bisect.bisect_left(self.sizes, chunk_bytes)
        return self.winners[min(i, len(self.winners) - 1)]

    def rows(self) -> List[Dict[str, object]]:
        """One dict per calibrated size: ``bytes``, ``<candidate>_us`` each, ``chosen``."""
        return [{"bytes": size, **{f"{c}_us": t for c, t in zip(self.candidates, row)},
                 "chosen": chosen}
                for size, row, chosen in zip(self.sizes, self.times_us, self.winners)]

    def describe(self) -> str:
        """The choice by chunk size in words, consecutive sizes with one winner merged:
        ``up to 64 KiB none, above: hier``."""
        spans = []
        for size, chosen in zip(self.sizes, self.winners):
            if spans and spans[-1][1] == chosen:
                spans[-1][0] = size
            else:
                spans.append([size, chosen])
        cells = [f"up to {_short(size)} {chosen}" for size, chosen in spans[:-1]]
        cells.append(f"above: {spans[-1][1]}" if cells else f"every size: {spans[-1][1]}")
        return "by chunk size: " + ", ".join(cells)


def _short(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def run_decomposition(tensor: torch.Tensor, decompose: str, topology, group=None) -> None:
    """All-reduce (sum) the flat ``tensor`` in place with ``decompose``, synchronously, on
    ``group`` (default: the world) and ``topology``'s sub-groups. ``hier`` needs the length
    to divide by ``topology.local_size``."""
    if decompose == "none":
        dist.all_reduce(tensor, group=group)
        return
    if decompose == "hier":
        shard = tensor.numel() // topology.local_size
        own = tensor.narrow(0, topology.local_rank * shard, shard)
        _reduce_scatter(own, tensor, group=topology.intra)
        dist.all_reduce(own, group=topology.inter)
        _all_gather(tensor, own, group=topology.intra)
        return
    if decompose == "leader":
        dist.reduce(tensor, dst=topology.leader_rank, group=topology.intra)
        if topology.is_leader:
            dist.all_reduce(tensor, group=topology.leaders)
        dist.broadcast(tensor, src=topology.leader_rank, group=topology.intra)
        return
    raise ConfigError(f"decompose={decompose!r}: calibration knows none, hier, leader")


def calibrate(topology, device: torch.device, dtype: torch.dtype,
              sizes: Sequence[int] = CALIBRATION_SIZES, repeats: int = REPEATS,
              clock: Callable[[], float] = time.perf_counter) -> AutoTable:
    """Time every candidate at every size on this rank, agree on the MAX over ranks, and
    return the table. Collective over the world group; every rank must call it at the same
    point of its collective sequence."""
    candidates = CANDIDATES if topology.nodes > 1 else ("none",)
    element = torch.tensor([], dtype=dtype).element_size()
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    quantum = topology.local_size            # hier's shards: lengths divide by it
    buffer = torch.zeros(max(sizes) // element + quantum, dtype=dtype, device=device)
    local: List[float] = []
    for size in sizes:
        numel = max(quantum, size // element // quantum * quantum)
        view = buffer.narrow(0, 0, numel)
        for candidate in candidates:
            run_decomposition(view, candidate, topology)       # untimed: first-use setup
            sync()
            start = clock()
            for _ in range(repeats):
                run_decomposition(view, candidate, topology)
            sync()
            local.append((clock() - start) * 1e6 / repeats)
    agreed = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    values = agreed.cpu().tolist()
    k = len(candidates)
    return AutoTable(sizes, candidates, [values[i * k:(i + 1) * k] for i in range(len(sizes))])


def announce(table: AutoTable, lane: str, topology, dtype: torch.dtype, extension=None) -> None:
    """Say on rank 0, in one line, what ``auto`` chose for ``lane``, and hand the table to
    the lane's ``extension`` (telemetry: ``commsched report``)."""
    dtype_name = str(dtype).replace("torch.", "")
    notices.say(f"decompose=auto on {topology.nodes} nodes x {topology.local_size} local "
                f"ranks (lane {lane}, {dtype_name}) {table.describe()} (none unless another "
                f"measured over {table.margin:.0%} faster)")
    if extension is not None:
        extension.auto_chosen(AutoChoice(lane, dtype_name, topology.nodes,
                                         topology.local_size, table.margin,
                                         tuple(table.rows())))
