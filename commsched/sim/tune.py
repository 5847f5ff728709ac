"""Search of scheduler settings on the simulator: a pure function, inputs -> ranked list.

The tuning space is data (:func:`default_candidates`): partition sizes x credit windows (as
multiples of the partition, plus unbounded) x decompositions. Each candidate is replayed by
:func:`commsched.sim.engine.simulate`; the ranking is by predicted iteration time (median
over the given profiles), ties kept in candidate order.
"""

from __future__ import annotations

import statistics
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .engine import IterationProfile, SimConfig, simulate
from .model import SimError

__all__ = ["PARTITIONS", "CREDIT_MULTIPLES", "DECOMPOSITIONS", "default_candidates", "tune"]

MIB = 1 << 20
PARTITIONS = (0, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB)
CREDIT_MULTIPLES = (1, 2, 4, 8)        # of the partition size; plus 0 = unbounded
DECOMPOSITIONS = ("none", "rs_ag")


def default_candidates(profile: Union[IterationProfile, Sequence[IterationProfile]],
                       *, policy: str = "priority", world_size: int = 2,
                       decompositions: Sequence[str] = DECOMPOSITIONS) -> List[SimConfig]:
    """partition in {0 (off), 1, 2, 4, ..., 64 MiB} x credit in {1x, 2x, 4x, 8x the
    partition, unbounded} x decompose in ``decompositions``.

    With partitioning off a chunk is a whole request, so the credit multiples are of the
    largest request instead. Duplicates (same partition and credit) are dropped.
    """
    profiles = _profiles(profile)
    largest = max(r.nbytes for p in profiles for r in p.requests)
    out: List[SimConfig] = []
    seen = set()
    for decompose in decompositions:
        for part in PARTITIONS:
            unit = part if part else largest
            for credit in [m * unit for m in CREDIT_MULTIPLES] + [0]:
                key = (part, credit, decompose)
                if key in seen:
                    continue
                seen.add(key)
                out.append(SimConfig(part, credit, policy, decompose, world_size))
    return out


def tune(profile: Union[IterationProfile, Sequence[IterationProfile]], cost_model,
         candidates: Optional[Iterable[SimConfig]] = None, *, policy: str = "priority",
         world_size: int = 2, mode: str = "ddp") -> List[Tuple[SimConfig, float]]:
    """Predicted iteration time (ms) of every candidate configuration, fastest first.

    ``profile``: one iteration profile or several (the median prediction over them is
    ranked). ``candidates`` default to :func:`default_candidates` with ``policy`` and
    ``world_size``; given candidates carry their own.

    Example::
        best, ms = tune(run.representative(), fitted_model, world_size=2)[0]
        print(best.label(), ms)
    """
    profiles = _profiles(profile)
    if candidates is None:
        candidates = default_candidates(profiles, policy=policy, world_size=world_size)
    ranked = []
    for n, config in enumerate(candidates):
        if not isinstance(config, SimConfig):
            raise SimError(f"candidate {n}: expected a SimConfig, got {type(config).__name__}")
        times = [simulate(p, cost_model, config, mode).iteration_s for p in profiles]
        ranked.append((statistics.median(times) * 1e3, n, config))
    ranked.sort(key=lambda x: (x[0], x[1]))
    return [(config, ms) for ms, _, config in ranked]


def _profiles(profile) -> List[IterationProfile]:
    profiles = [profile] if isinstance(profile, IterationProfile) else list(profile)
    if not profiles or not all(isinstance(p, IterationProfile) for p in profiles):
        raise SimError("tune: expected an IterationProfile or a non-empty list of them")
    return profiles
