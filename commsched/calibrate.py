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

Calibration runs synchronously, at a point every rank reaches in the same collective
sequence with nothing of the lane in flight: the lane's first request (the scheduler falls
back to the static size rule, :func:`static_choice`, when ``auto`` is first asked for by a
per-request override while chunks are in flight). It is done once per lane.

Example::
    table = calibrate(topology, torch.device("cuda", 0), torch.float32)
    table.choose(1 << 20)        # -> "hier", say
    print(table.describe())
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import ConfigError

__all__ = ["AutoTable", "calibrate", "run_decomposition", "static_choice",
           "CALIBRATION_SIZES", "REPEATS"]

CALIBRATION_SIZES: Tuple[int, ...] = tuple(4096 << (2 * i) for i in range(7))  # 4K .. 16M
REPEATS = 3
CANDIDATES = ("none", "hier", "leader")

# The static rule (no measurements): below this chunk size a collective is latency-bound,
# and the leader decomposition runs one inter-node all-reduce among few ranks instead of
# one per local rank.
STATIC_LEADER_BELOW_BYTES = 1 << 20


def static_choice(nodes: int, chunk_bytes: int) -> str:
    """The size rule used before (or instead of) calibration."""
    if nodes == 1:
        return "none"
    return "leader" if chunk_bytes < STATIC_LEADER_BELOW_BYTES else "hier"


class AutoTable:
    """Measured time per (size, candidate), identical on every rank, and the choice it
    implies per chunk size."""

    def __init__(self, sizes: Sequence[int], candidates: Sequence[str],
                 times_us: Sequence[Sequence[float]]):
        self.sizes = tuple(sizes)
        self.candidates = tuple(candidates)
        self.times_us = tuple(tuple(row) for row in times_us)   # [size][candidate]
        # Ties go to the earlier candidate (none first: fewest steps).
        self.winners = tuple(self.candidates[min(range(len(row)), key=row.__getitem__)]
                             for row in self.times_us)

    def choose(self, chunk_bytes: int) -> str:
        i = bisect.bisect_left(self.sizes, chunk_bytes)
        return self.winners[min(i, len(self.winners) - 1)]

    def rows(self) -> List[Dict[str, object]]:
        """One dict per calibrated size: ``bytes``, ``<candidate>_us`` each, ``chosen``."""
        return [{"bytes": size, **{f"{c}_us": t for c, t in zip(self.candidates, row)},
                 "chosen": winner}
                for size, row, winner in zip(self.sizes, self.times_us, self.winners)]

    def describe(self) -> str:
        cells = ", ".join(f"{_short(s)}: {w}" for s, w in zip(self.sizes, self.winners))
        return f"auto decomposition by chunk size (measured): {cells}"


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
        dist.reduce_scatter_tensor(own, tensor, group=topology.intra)
        dist.all_reduce(own, group=topology.inter)
        dist.all_gather_into_tensor(tensor, own, group=topology.intra)
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
