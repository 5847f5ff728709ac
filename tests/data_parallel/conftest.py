"""Fixtures: every multi-rank scenario of a world size runs in one ``run_workers`` call
(spawning a rank costs seconds on CI machines), and the tests read its results."""

from __future__ import annotations

import json
import os
import time

import pytest

from distributed import run_workers

from .scenarios import CASES_2, CASES_4, run_scenarios

_DIFFS = ("loss", "seen", "final", "eval", "state_dict", "opt_state", "init")


def _run(world_size: int, cases, tmp_path_factory, timeout: float) -> dict:
    out = tmp_path_factory.mktemp(f"data_parallel{world_size}")
    try:
        run_workers(run_scenarios, world_size, cases, str(out), time.time() + timeout - 10,
                    timeout=timeout)
    except BaseException as exc:
        started = []
        path = os.path.join(out, "rank0.jsonl")
        if os.path.exists(path):
            started = [json.loads(line)["name"] for line in open(path) if '"started"' in line]
        stacks = ""
        for rank in range(world_size):
            p = os.path.join(out, f"stacks{rank}.txt")
            if os.path.exists(p) and os.path.getsize(p):
                stacks += f"\n--- rank {rank} ---\n" + open(p).read()
        raise RuntimeError(f"{world_size}-rank data-parallel scenarios failed; last started: "
                           f"{started[-1] if started else None}{stacks}") from exc
    per_rank = []
    for rank in range(world_size):
        with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
            per_rank.append({r["name"]: r for r in map(json.loads, f) if "started" not in r})
    merged = {}
    for name in cases:
        rows = [pr[name] for pr in per_rank]
        m = {"ranks": rows}
        for key in _DIFFS:
            if key in rows[0]:
                m[key] = max(r[key] for r in rows)
        for key in ("in_flight", "warnings"):
            m[key] = sum(r[key] for r in rows)
        m["seen_count"] = min(r["seen_count"] for r in rows)
        merged[name] = m
    return merged


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """Results of every CASES_2 scenario on 2 gloo ranks."""
    return _run(2, CASES_2, tmp_path_factory, timeout=300)


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """Results of every CASES_4 scenario on 4 gloo ranks."""
    return _run(4, CASES_4, tmp_path_factory, timeout=360)

