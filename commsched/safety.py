"""Cross-rank checks that turn a would-be hang or silent corruption into an error.

- ``check_agreement``: before the first collective, every rank compares a digest of the
  settings and layouts that decide its collective sequence; a difference is an error on
  every rank that names the field and the ranks. The digests go through the process
  group's store, not a collective, with a deadline (``agreement_timeout``): a rank that
  never answers (one started without commsched, which meanwhile issues DDP's own
  collectives) is an error naming it on the ranks that did, not a hang, and nothing is
  left half-matched in the group's collective sequence.
- ``step_crc`` / ``verify_sequences``: with ``COMMSCHED_VERIFY=1`` each iteration's
  dispatch sequence is reduced to a CRC, the CRCs are compared across ranks, and on a
  difference the sequences themselves are gathered to name the first divergence.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import zlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import CommschedError, SchedulerError

__all__ = ["AgreementError", "check_agreement", "agreement_timeout", "STARTUP_BOUND_S",
           "VERDICT_GRACE_S", "step_crc", "first_divergence", "wait_bounded",
           "verify_sequences", "all_reduce_max"]

# How long the agreement check waits for the other ranks where COMMSCHED_TIMEOUT_S is 0.
# Ranks reach it at their first bucket, a forward and part of a backward after DDP's
# constructor synchronised them; longer than that is a rank that will not come.
STARTUP_BOUND_S = 300.0


class AgreementError(CommschedError, RuntimeError):
    """Ranks differ in something that must be identical for their collectives to match."""


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def agreement_timeout(timeout_s: float) -> float:
    """Seconds the agreement check waits for the other ranks: ``COMMSCHED_TIMEOUT_S``
    (``timeout_s``) where set, else ``STARTUP_BOUND_S``."""
    return timeout_s if timeout_s and timeout_s > 0 else STARTUP_BOUND_S


def check_agreement(fields: Dict[str, object], group=None, what: str = "",
                    timeout_s: float = STARTUP_BOUND_S) -> List[int]:
    """Exchange a digest of every field over ``group``; raise ``AgreementError`` on every
    rank, naming each differing field and which ranks hold which value, or, on the ranks
    that answered, naming those that did not within ``timeout_s``. Returns the group's
    ranks (all of them agreed)."""
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    local = {name: (_digest(value), _short(value)) for name, value in fields.items()}
    if len(ranks) == 1:
        return ranks
    verdict = _exchange(local, group, ranks, what, timeout_s)
    if verdict:
        raise AgreementError(verdict)
    return ranks


def _verdict(gathered: list, ranks: List[int], what: str) -> str:
    """The error message for the ranks' answers ``gathered`` (in group order), "" where
    they agree."""
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
    if not problems:
        return ""
    where = f" ({what})" if what else ""
    return (f"commsched: ranks disagree before the first collective{where}, which would "
            f"make their collectives mismatch: " + " | ".join(problems))


def _unanswered(missing: List[int], ranks: List[int], what: str, timeout_s: float) -> str:
    answered = [r for r in ranks if r not in missing]
    return (f"commsched: ranks {missing} did not answer the agreement check before the "
            f"first collective ({what}) within {timeout_s:.0f} s, where ranks {answered} did: "
            f"they run without commsched (a rank a framework started without the launcher "
            f"or without COMMSCHED=1, see docs/integrations.md), or are stuck or gone. "
            f"Their collectives would not match these ranks'; set COMMSCHED_TIMEOUT_S to "
            f"wait longer")


# Exchanges so far per group and subject: the n-th exchange of a group is the same one on
# every rank (each rank makes them in the same order, as it issues collectives).
_exchanges: Dict[tuple, int] = {}
# How much longer than the group's first rank the others wait for its verdict, so that
# the verdict naming a missing rank reaches them before their own deadline passes.
VERDICT_GRACE_S = 10.0


def _exchange(local: dict, group, ranks: List[int], what: str, timeout_s: float) -> str:
    """The verdict on every rank's ``local`` (see ``_verdict``; "" where they agree),
    through the default store under keys of this group and exchange: each rank sets its
    answer, the group's first rank reads them all and sets the verdict, the others read
    that alone (store traffic grows with the ranks, not their square). The collective
    ``all_gather_object`` where there is no store of that kind."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        gathered: List[Optional[dict]] = [None] * len(ranks)
        dist.all_gather_object(gathered, local, group=group)
        return _verdict(gathered, ranks, what)
    name = getattr(group, "group_name", None) or ",".join(map(str, ranks))
    subject = (name, what)
    count = _exchanges[subject] = _exchanges.get(subject, -1) + 1
    # (a restarted worker of an elastic job must not read the last attempt's answers)
    prefix = (f"commsched/agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
              f"{_digest(subject)}/{count}/")
    keys = [prefix + str(r) for r in ranks]
    verdict_key = prefix + "verdict"
    me = dist.get_rank()
    store.set(prefix + str(me), json.dumps(local))
    first = me == ranks[0]
    try:
        store.wait(keys if first else [verdict_key],
                   datetime.timedelta(seconds=timeout_s + (0 if first else VERDICT_GRACE_S)))
    except RuntimeError as exc:              # DistStoreError: the deadline passed
        missing = [r for r, key in zip(ranks, keys) if not _has(store, key)]
        if not missing:
            return (f"commsched: the agreement check ({what}) could not read the process "
                    f"group's store: {exc}")
        verdict = _unanswered(missing, ranks, what, timeout_s)
        if first:
            _announce(store, prefix, verdict, [r for r in ranks[1:] if r not in missing])
        return verdict
    if not first:
        return _read_verdict(store, prefix, me, ranks[0], what)
    verdict = _verdict([json.loads(value) for value in store.multi_get(keys)], ranks, what)
    _announce(store, prefix, verdict, ranks[1:])
    return verdict


def _announce(store, prefix: str, verdict: str, readers: List[int]) -> None:
    """Set ``verdict`` for the group's other ranks. An error verdict is waited on until
    ``readers`` have read it (at most ``VERDICT_GRACE_S``): the first rank raises next, and
    where it hosts the store its exit would take the verdict with it."""
    store.set(prefix + "verdict", json.dumps(verdict))
    if not verdict or not readers:
        return
    try:
        store.wait([f"{prefix}read/{r}" for r in readers],
                   datetime.timedelta(seconds=VERDICT_GRACE_S))
    except RuntimeError:
        pass                 # a reader gone meanwhile reads nothing: raise all the same


def _read_verdict(store, prefix: str, me: int, first: int, what: str) -> str:
    """The verdict the group's first rank set (``wait`` saw it), acknowledged as read."""
    try:
        verdict = json.loads(store.get(prefix + "verdict"))
    except RuntimeError as exc:
        return (f"commsched: the agreement check ({what}) could not read the verdict of the "
                f"group's first rank (rank {first}) from the process group's store: {exc}")
    if verdict:
        try:
            store.set(f"{prefix}read/{me}", "1")
        except RuntimeError:
            pass             # the first rank stopped waiting: the verdict is read all the same
    return verdict


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except RuntimeError:
        return False


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


def wait_bounded(work, timeout_s: float, what: str) -> None:
    """Wait for ``work``, a collective commsched issued itself outside a lane's watchdog,
    at most ``timeout_s`` seconds (``COMMSCHED_TIMEOUT_S``; 0: the process group's own
    timeout); past that a ``SchedulerError`` naming ``what``. (NCCL's wait with a timeout
    blocks the host until the collective ends: for exchanges whose result the host reads
    anyway.)"""
    try:
        if timeout_s and timeout_s > 0:
            work.wait(datetime.timedelta(seconds=timeout_s))
        else:
            work.wait()
    except RuntimeError as exc:
        bound = (f"{timeout_s:.0f} s (COMMSCHED_TIMEOUT_S)" if timeout_s
                 else "the process group's timeout")
        raise SchedulerError(f"commsched: {what} did not complete within {bound}: a peer may "
                             f"have died or issued other collectives ({exc})") from None


def verify_sequences(checked: Sequence[tuple], group, device, world_size: int,
                     ranks: Sequence[int], lane_name: str,
                     timeout_s: float = 0.0) -> Optional[SchedulerError]:
    """Compare the digests of ``checked`` iterations, (index, crc, sequence) each, across
    the group (a collective: call it at the same place of every rank's sequence; bounded
    by ``timeout_s``, see ``wait_bounded``); on a difference gather the sequences and
    return the error naming the first divergence."""
    local = torch.tensor([v for index, crc, _ in checked for v in (index, crc)],
                         dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    wait_bounded(dist.all_gather(gathered, local, group=group, async_op=True), timeout_s,
                 f"the dispatch-sequence check of lane {lane_name} (ranks {list(ranks)})")
    if all(torch.equal(g.cpu(), local.cpu()) for g in gathered):
        return None
    sequences: List[Optional[list]] = [None] * world_size
    dist.all_gather_object(sequences, [e for _, _, seq in checked for e in seq], group=group)
    return SchedulerError(
        f"commsched: dispatch sequences of lane {lane_name} differ across ranks "
        f"(iterations {checked[0][0]}..{checked[-1][0]}): "
        f"{first_divergence(sequences, ranks)}")


def all_reduce_max(values: Sequence, dtype, group, device, stream, timeout_s: float = 0.0,
                   what: str = "an exchange of the plan or the tuner") -> list:
    """``values`` reduced with MAX over ``group`` (a collective: call it at the same place
    of every rank's sequence; bounded by ``timeout_s``, see ``wait_bounded``), as a list;
    on CUDA issued from ``stream``."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        with torch.cuda.stream(stream):
            tensor = tensor.to(device)
            wait_bounded(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group,
                                         async_op=True), timeout_s, what)
            tensor = tensor.cpu()
    else:
        wait_bounded(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group,
                                     async_op=True), timeout_s, what)
    return tensor.tolist()
