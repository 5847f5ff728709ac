"""Cross-rank checks that turn a would-be hang or silent corruption into an error.

- ``check_agreement``: before the first collective, every rank compares a digest of the
  settings and layouts that decide its collective sequence; a difference is an error on
  every rank that names the field and the ranks.
- ``step_crc`` / ``verify_sequences``: with ``COMMSCHED_VERIFY=1`` each iteration's
  dispatch sequence is reduced to a CRC, the CRCs are compared across ranks, and on a
  difference the sequences themselves are gathered to name the first divergence.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import CommschedError, SchedulerError

__all__ = ["AgreementError", "check_agreement", "step_crc", "first_divergence",
           "verify_sequences", "all_reduce_max"]


class AgreementError(CommschedError, RuntimeError):
    """Ranks differ in something that must be identical for their collectives to match."""


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_agreement(fields: Dict[str, object], group=None, what: str = "") -> None:
    """All-gather a digest of every field over ``group``; raise ``AgreementError`` on
    every rank, naming each differing field and which ranks hold which value."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    local = {name: (_digest(value), _short(value)) for name, value in fields.items()}
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    ranks = dist.get_process_group_ranks(group)
    problems = []
    for name in sorted(set().union(*(g.keys() for g in gathered))):
        holders: Dict[str, List[int]] = {}
        shown: Dict[str, str] = {}
        for rank, fields_of_rank in zip(ranks, gathered):
            digest, text = fields_of_rank.get(name, ("<missing>", "<missing>"))
            holders.setdefault(digest, []).append(rank)
            shown[digest] = text
        if len(holders) > 1:
            parts = "; ".join(f"ranks {r}: {shown[d]}" for d, r in holders.items())
            problems.append(f"{name!r} differs ({parts})")
    if problems:
        where = f" ({what})" if what else ""
        raise AgreementError(
            f"commsched: ranks disagree before the first collective{where}, which would "
            f"make their collectives mismatch: " + " | ".join(problems))


def step_crc(crc: int, key, chunk_index: int, step: int) -> int:
    """Fold one dispatched step into an iteration's running CRC (rank-stable: built from
    repr(), not hash(), whose string hashing differs per process)."""
    return zlib.crc32(f"{key!r}/{chunk_index}/{step};".encode(), crc)


def first_divergence(sequences: Sequence[Sequence[tuple]], ranks: Sequence[int]) -> str:
    """Describe the first position where the ranks' dispatch sequences differ."""
    longest = max(len(s) for s in sequences)
    for position in range(longest):
        entries = [s[position] if position < len(s) else "<end>" for s in sequences]
        if any(e != entries[0] for e in entries):
            detail = ", ".join(f"rank {r}: {e}" for r, e in zip(ranks, entries))
            return f"first divergence at collective #{position}: {detail}"
    return "sequences differ only in their digests"


def verify_sequences(checked: Sequence[tuple], group, device, world_size: int,
                     ranks: Sequence[int], lane_name: str) -> Optional[SchedulerError]:
    """Compare the digests of ``checked`` iterations, (index, crc, sequence) each, across
    the group (a collective: call it at the same place of every rank's sequence); on a
    difference gather the sequences and return the error naming the first divergence."""
    local = torch.tensor([v for index, crc, _ in checked for v in (index, crc)],
                         dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    if all(torch.equal(g.cpu(), local.cpu()) for g in gathered):
        return None
    sequences: List[Optional[list]] = [None] * world_size
    dist.all_gather_object(sequences, [e for _, _, seq in checked for e in seq], group=group)
    return SchedulerError(
        f"commsched: dispatch sequences of lane {lane_name} differ across ranks "
        f"(iterations {checked[0][0]}..{checked[-1][0]}): "
        f"{first_divergence(sequences, ranks)}")


def all_reduce_max(values: Sequence, dtype, group, device, stream) -> list:
    """``values`` reduced with MAX over ``group`` (a collective: call it at the same place
    of every rank's sequence), as a list; on CUDA issued from ``stream``."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        with torch.cuda.stream(stream):
            tensor = tensor.to(device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            tensor = tensor.cpu()
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
