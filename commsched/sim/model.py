"""Cost models: how long one collective step on one chunk takes.

Every model answers ``cost_s(step, decompose, nbytes, world_size)``: seconds for the
collective ``step`` (all_reduce | reduce_scatter | all_gather) on a chunk of ``nbytes``
payload bytes (the full, unsplit chunk, as telemetry's ``comm_ops.nbytes`` counts it) over
``world_size`` ranks, when it has the link to itself.

* :class:`FittedCostModel` — ``alpha + nbytes * beta`` per (step, decompose, group size),
  fitted by least squares from a run's ``comm_ops`` rows (:func:`fit_cost_model`).
* :class:`TopologyCostModel` — textbook formulas for a ring, a tree or a two-level
  (hierarchical) network, for clusters that were never measured.

Why busy periods and not per-chunk durations. A chunk's recorded interval
``[t_start, t_end]`` starts when the launch stream reached it, which under a credit window
is often while earlier chunks still occupy the link: its duration includes queueing. On a
serial link a maximal run of overlapping intervals (a *busy period*) lasts exactly the sum
of the service times of the steps in it, so each busy period gives one equation::

    period length = sum over steps in it of (alpha[key] + nbytes * beta[key])

and the least-squares solution over all busy periods is the fit. A chunk that ran alone is
a busy period of one step, i.e. the plain per-chunk regression.

Busy periods are taken over collectives, not over one rank's rows (:func:`join_ranks`): a
collective starts when the last rank joins it, and the rank that got there first records
the wait as part of its step; per-rank busy periods make the fit degenerate ([Note:
recorded host timings] in docs/design.md).

A fitted model also carries two host-side costs of the scheduler (:func:`fit_host_costs`),
which matter when chunks are short (on NVLink, as short as the host's own costs): the time to
issue one collective step, and the turnaround from a chunk's (link) end to the start of
the chunk its returned credit admits. Neither is part of a busy period. Both are means
over their samples, as they add up along the critical path.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CommschedError

__all__ = ["SimError", "AlphaBeta", "FittedCostModel", "TopologyCostModel", "fit_alpha_beta",
           "fit_cost_model", "fit_host_costs", "busy_periods", "join_ranks", "TOPOLOGIES"]

STEPS = ("all_reduce", "reduce_scatter", "all_gather")
TOPOLOGIES = ("ring", "tree", "hier")


class SimError(CommschedError, ValueError):
    """Bad simulator input (profile, configuration, cost model, run directory); the message
    says what and why. The CLIs print it without a traceback and exit with status 2."""


@dataclass(frozen=True)
class AlphaBeta:
    """``seconds = alpha + nbytes * beta`` with the fit's provenance."""

    alpha: float                  # seconds per step
    beta: float                   # seconds per byte
    samples: int = 0              # busy periods that contained this key
    note: str = ""                # how the parameters were obtained, when not plainly fitted

    def cost_s(self, nbytes: int) -> float:
        return self.alpha + nbytes * self.beta

    @property
    def gbps(self) -> Optional[float]:
        """Algorithm bandwidth (bytes / second / 1e9) of the byte term."""
        return None if self.beta <= 0 else 1e-9 / self.beta


def bus_factor(step: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: 2(n-1)/n for all_reduce, (n-1)/n for RS / AG."""
    n = max(int(n), 1)
    return 2.0 * (n - 1) / n if step == "all_reduce" else (n - 1) / n


# --- fitted model ------------------------------------------------------------------------------

@dataclass
class FittedCostModel:
    """Per (step, decompose, group size) alpha-beta parameters fitted from telemetry.

    ``cost_s`` for a key that was not measured falls back, in order, to: the same step under
    the other decomposition; for reduce_scatter / all_gather, half of the all_reduce fit of
    the same group (ring: RS + AG = AR); else :class:`SimError`. Fallbacks are named in
    :meth:`describe`.
    """

    params: Dict[Tuple[str, str, int], AlphaBeta] = field(default_factory=dict)
    source: str = ""
    issue_s: float = 0.0              # host: spacing of consecutive step issues
    credit_return_s: float = 0.0      # host: chunk end -> the chunk its credit admits starts
    host_samples: Tuple[int, int] = (0, 0)

    def lookup(self, step: str, decompose: str, world_size: int) -> AlphaBeta:
        exact = self.params.get((step, decompose, world_size))
        if exact is not None:
            return exact
        other = "rs_ag" if decompose == "none" else "none"
        p = self.params.get((step, other, world_size))
        if p is not None:
            return AlphaBeta(p.alpha, p.beta, p.samples, f"from {step}/{other}")
        if step in ("reduce_scatter", "all_gather"):
            ar = self.params.get(("all_reduce", "none", world_size)) or self.params.get(
                ("all_reduce", "rs_ag", world_size))
            if ar is not None:
                return AlphaBeta(ar.alpha / 2, ar.beta / 2, ar.samples,
                                 "half of the all_reduce fit (ring: RS + AG = AR)")
        if step == "all_reduce":
            rs = self.lookup_or_none("reduce_scatter", world_size)
            ag = self.lookup_or_none("all_gather", world_size)
            if rs is not None and ag is not None:
                return AlphaBeta(rs.alpha + ag.alpha, rs.beta + ag.beta,
                                 min(rs.samples, ag.samples), "reduce_scatter + all_gather fits")
        known = ", ".join(f"{s}/{d} on {n} ranks" for s, d, n in sorted(self.params)) or "none"
        raise SimError(f"no fitted cost for {step} ({decompose}) on {world_size} ranks "
                       f"(fitted: {known}); a what-if for another cluster needs a topology "
                       f"model")

    def lookup_or_none(self, step: str, world_size: int) -> Optional[AlphaBeta]:
        for d in ("rs_ag", "none"):
            p = self.params.get((step, d, world_size))
            if p is not None:
                return p
        return None

    def cost_s(self, step: str, decompose: str, nbytes: int, world_size: int) -> float:
        return self.lookup(step, decompose, world_size).cost_s(nbytes)

    def describe(self) -> List[str]:
        lines = []
        for (step, dec, n), p in sorted(self.params.items()):
            bw = "" if p.beta <= 0 else (f", busbw {bus_factor(step, n) / p.beta / 1e9:.1f} "
                                         f"GB/s")
            note = f" [{p.note}]" if p.note else ""
            lines.append(f"{step} ({dec}, {n} ranks): alpha {p.alpha * 1e6:.1f} us, "
                         f"beta {p.beta * 1e12:.3f} ps/B{bw}; {p.samples} busy periods{note}")
        lines.append(f"host: {self.issue_s * 1e6:.1f} us per step issue "
                     f"({self.host_samples[0]} samples), credit return "
                     f"{self.credit_return_s * 1e6:.1f} us ({self.host_samples[1]} samples)")
        return lines


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares ``seconds = alpha + nbytes * beta`` over isolated samples.

    Example::
        fit_alpha_beta([1e6, 2e6], [30e-6, 50e-6])      # alpha 10 us, beta 20 ps/B
    """
    if len(nbytes) != len(seconds) or not nbytes:
        raise SimError("fit_alpha_beta: need as many durations as sizes, at least one")
    # A sample is a busy period of one step.
    rows = [({("x",): (1, b)}, t) for b, t in zip(nbytes, seconds)]
    params, _ = _solve(rows, {("x",): len(set(nbytes))})
    p = params[("x",)]
    return AlphaBeta(p.alpha, p.beta, len(nbytes), p.note)


def busy_periods(rows: Iterable[dict]) -> List[Tuple[Dict[tuple, Tuple[int, int]], float]]:
    """Split ``comm_ops`` rows into busy periods per (run, rank, lane).

    Returns ``[(composition, seconds)]`` where composition maps a parameter key to
    (number of steps, bytes) in the period. Failed steps and empty intervals are skipped.
    """
    by_link: Dict[tuple, List[dict]] = {}
    for r in rows:
        if not r.get("ok", 1) or r["t_end_ns"] is None or r["t_start_ns"] is None:
            continue
        if r["t_end_ns"] < r["t_start_ns"]:
            continue
        by_link.setdefault((r.get("run"), r.get("rank", 0), r.get("lane", "")), []).append(r)
    out = []
    for link_rows in by_link.values():
        link_rows.sort(key=lambda r: (r["t_start_ns"], r["t_end_ns"]))
        start = end = None
        comp: Dict[tuple, List[int]] = {}
        for r in link_rows:
            if end is not None and r["t_start_ns"] > end:
                out.append(({k: (v[0], v[1]) for k, v in comp.items()}, (end - start) * 1e-9))
                start = end = None
                comp = {}
            if start is None:
                start, end = r["t_start_ns"], r["t_end_ns"]
            end = max(end, r["t_end_ns"])
            acc = comp.setdefault(_param_key(r), [0, 0])
            acc[0] += 1
            acc[1] += int(r["nbytes"])
        if start is not None:
            out.append(({k: (v[0], v[1]) for k, v in comp.items()}, (end - start) * 1e-9))
    return out


def _param_key(r: dict) -> tuple:
    """The fitted parameters a step uses. The reduce-scatter and all-gather halves of an
    rs_ag all-reduce always come in pairs, so their costs cannot be told apart: they share
    one (alpha, beta), as a ring's two halves do."""
    n = int(r.get("group_size") or 0) or _group_size(r)
    decompose = r.get("decompose") or "none"
    if decompose == "rs_ag" and r.get("op") == "all_reduce":
        return ("rs|ag", "rs_ag", n)
    return (r["step"], decompose, n)


def _group_size(r: dict) -> int:
    ranks = r.get("group_ranks")
    if isinstance(ranks, str):
        return max(1, ranks.count(",") + 1) if ranks.strip("[] ") else 1
    return len(ranks) if ranks else 1


_IDENTITY = ("lane", "iteration", "request_key", "chunk_index", "step")


def join_ranks(rows: Iterable[dict]) -> List[dict]:
    """One row per collective step, from the rows every rank recorded of it.

    A collective runs once on the shared link, but each rank records its own interval: a
    rank that got there first records the wait for the others as part of its step ([Note:
    recorded host timings] in docs/design.md). So the step is taken to start when the last rank started it (``t_start``,
    ``t_dispatch``, ``t_submit``: the maximum over ranks) and to end when the last rank
    saw it end (``t_end``: the maximum), as the replay takes readiness (maximum over
    ranks). Steps missing on a rank of their group, and rows without the identity fields
    (lane, iteration, request_key, chunk_index, step), are kept as they are; joined rows
    carry ``rank = -1``. Rows with different ``run`` values (pooled runs) never join, nor
    do the rows of one step recorded on different ``host`` values: their clocks differ.
    """
    groups: Dict[tuple, List[dict]] = {}
    out: List[dict] = []
    for r in rows:
        if not r.get("ok", 1):
            continue
        if any(r.get(k) is None for k in _IDENTITY):
            out.append(r)
            continue
        groups.setdefault((r.get("run"),) + tuple(r[k] for k in _IDENTITY), []).append(r)
    for same in groups.values():
        ranks = {r.get("rank", 0) for r in same}
        size = int(same[0].get("group_size") or 0) or _group_size(same[0])
        if (len(ranks) < 2 or len(ranks) != len(same) or len(ranks) < size
                or len({r.get("host") for r in same}) > 1):
            out.extend(same)
            continue
        joined = dict(same[0], rank=-1)
        for k in ("t_submit_ns", "t_dispatch_ns", "t_start_ns", "t_end_ns"):
            values = [r.get(k) for r in same]
            joined[k] = None if any(v is None for v in values) else max(values)
        out.append(joined)
    return out


def fit_cost_model(rows: Iterable[dict], *, source: str = "") -> FittedCostModel:
    """Fit alpha-beta parameters per (step, decompose, group size) from ``comm_ops`` rows
    (dicts as :func:`commsched.telemetry.load_run` returns them).

    Rows of one collective from several ranks are first joined into one (:func:`join_ranks`).
    Least squares over busy periods (see the module docstring); then periods whose residual
    is more than 5 MADs (at least 5% of the median period) off are dropped once and the fit
    repeated, so that the first collectives of a run (communicator set-up) do not skew it.
    A key whose chunks all had one size has no identifiable alpha: it is fitted as pure
    bandwidth (alpha 0). A negative alpha or beta is pinned at 0 and the rest refitted.
    The host costs (:func:`fit_host_costs`) are measured on the joined rows, credit
    turnarounds from link ends replayed with the fitted costs.
    """
    rows = join_ranks(rows)          # one row per collective step (see join_ranks)
    periods = busy_periods(rows)
    if not periods:
        raise SimError("no completed collective steps to fit a cost model on")
    sizes: Dict[tuple, set] = {}
    for r in rows:
        if r.get("ok", 1):
            sizes.setdefault(_param_key(r), set()).add(int(r["nbytes"]))
    distinct = {k: len(v) for k, v in sizes.items()}
    params, residuals = _solve(periods, distinct)
    lengths = [t for _, t in periods]
    mad = statistics.median(abs(x) for x in residuals)
    limit = max(5 * mad, 0.05 * statistics.median(lengths))
    kept = [p for p, res in zip(periods, residuals) if abs(res) <= limit]
    if len(kept) < len(periods) and kept:
        params, _ = _solve(kept, distinct)
    issue, credit_return, counts = fit_host_costs(
        rows, lambda r: params[_param_key(r)].cost_s(int(r["nbytes"])))
    model = FittedCostModel(source=source, issue_s=issue, credit_return_s=credit_return,
                            host_samples=counts)
    for key, p in params.items():
        if key[0] == "rs|ag":
            for step in ("reduce_scatter", "all_gather"):
                model.params[(step, "rs_ag", key[2])] = p
        else:
            model.params[key] = p
    return model


PROMPT_NS = 100_000            # dispatched within 100 us of submission: not held back
GATE_WINDOW_NS = 2_000_000    # a dispatch this soon after a chunk end was admitted by it
# Longest single host delay taken as one (issue or credit turnaround): longer samples span
# a whole backward pass, waits the classification let through, not a host cost ([Note:
# recorded host timings] in docs/design.md).
MAX_HOST_DELAY_S = 0.05


def fit_host_costs(rows: Iterable[dict], cost_s: Optional[Callable[[dict], float]] = None
                   ) -> Tuple[float, float, Tuple[int, int]]:
    """Host-side costs of the scheduler from ``comm_ops`` rows, per (run, rank, lane):

    issue          chunk m+1 already submitted when chunk m was dispatched, and no step
                   finished in between: nothing but issuing m's steps separated them, so
                   ``(dispatch[m+1] - dispatch[m]) / steps(m)`` samples the issue time.
    credit return  chunk m+1 held back (dispatched > 100 us after its submission) and
                   dispatched within 2 ms after a chunk finished, with no request submitted
                   in between: that chunk's credit admitted it, so ``start[m+1] - that end``
                   samples the turnaround.

    With ``cost_s`` (seconds of one step row on the link, e.g. the fitted alpha-beta), the
    turnaround is measured from the gating chunk's *link* end, reconstructed as the engine
    computes it: each step starts at max(its recorded start, the previous step's link end) and
    takes ``cost_s``. Recorded ends lag the link: the end event is recorded on the done stream
    once the host got to it, and on a busy host several chunks' ends come out at one
    instant. The engine returns credit
    ``credit_return_s`` after its own (link) end, so the lag belongs in the turnaround.

    Returns (issue seconds, credit-return seconds, (samples, samples)), each the mean of
    its samples (:func:`_sum_estimate`); 0 where there is no sample.
    """
    by_link: Dict[tuple, Dict[tuple, dict]] = {}
    needed = ("t_dispatch_ns", "t_submit_ns", "request_key", "chunk_index", "iteration")
    for r in rows:
        if not r.get("ok", 1) or any(r.get(k) is None for k in needed):
            continue
        chunks = by_link.setdefault((r.get("run"), r.get("rank", 0), r.get("lane", "")), {})
        c = chunks.setdefault((r["iteration"], r["request_key"], r["chunk_index"]), {
            "dispatch": r["t_dispatch_ns"], "submit": r["t_submit_ns"],
            "start": r["t_start_ns"], "end": r["t_end_ns"], "steps": 0, "step_ends": []})
        c["step_ends"].append(r["t_end_ns"])
        c["steps"] += 1
        c["start"] = min(c["start"], r["t_start_ns"])
        c["end"] = max(c["end"], r["t_end_ns"])
        c.setdefault("rows", []).append(r)
    issue: List[float] = []
    turnaround: List[float] = []
    for chunks in by_link.values():
        if cost_s is not None:
            _link_ends(chunks.values(), cost_s)
        seq = sorted(chunks.values(), key=lambda c: c["dispatch"])
        by_end = sorted(seq, key=lambda c: c["end"])
        ends = [c["end"] for c in by_end]
        step_ends = sorted(t for c in seq for t in c["step_ends"])
        submits = sorted({c["submit"] for c in seq})
        for prev, cur in zip(seq, seq[1:]):
            j = bisect.bisect_right(ends, cur["dispatch"]) - 1
            last_end = ends[j] if j >= 0 else None
            # Ends recorded at one instant (a batch, see above) returned their credits in
            # dispatch order: the first of them admitted this chunk.
            link_end = None
            while j >= 0 and ends[j] == last_end:
                e = by_end[j].get("link_end", last_end)
                link_end = e if link_end is None else min(link_end, e)
                j -= 1
            gated = last_end is not None and last_end > prev["dispatch"]
            # Any step finishing in between may have been what let the dispatch go on
            # (gloo issues a chunk's all-gather only once its reduce-scatter finished).
            waited = _any_between(step_ends, prev["dispatch"], cur["dispatch"])
            if not waited and cur["submit"] <= prev["dispatch"]:
                issue.append((cur["dispatch"] - prev["dispatch"]) / prev["steps"] * 1e-9)
            elif (gated and cur["dispatch"] - cur["submit"] > PROMPT_NS
                  and cur["dispatch"] - last_end <= GATE_WINDOW_NS
                  and not _any_between(submits, last_end, cur["dispatch"])):
                # (a submission in between may be what released it: plan head of line)
                turnaround.append(max(0, cur["start"] - link_end) * 1e-9)
    return (_sum_estimate(issue), _sum_estimate(turnaround), (len(issue), len(turnaround)))


def _sum_estimate(samples: List[float]) -> float:
    """The per-event delay to charge when many such delays add up on the critical path:
    their mean, not their median. The samples are skewed right (stalls now and then), so a
    median-based replay runs short ([Note: recorded host timings] in docs/design.md).
    Samples over
    :data:`MAX_HOST_DELAY_S` are left out: they are not one host delay. 0 without samples."""
    kept = [x for x in samples if x <= MAX_HOST_DELAY_S]
    return sum(kept) / len(kept) if kept else 0.0


def _link_ends(chunks, cost_s: Callable[[dict], float]) -> None:
    """Set each chunk's ``link_end``: its steps replayed on a serial link from their
    recorded starts with ``cost_s`` seconds each (the engine's timeline, on recorded
    starts); ``link_end`` defaults to the recorded end."""
    steps = sorted(((r["t_start_ns"], r["t_end_ns"], id(c), r) for c in chunks
                    for r in c["rows"]), key=lambda s: s[:3])
    owner = {id(c): c for c in chunks}
    free = None
    for start, _, cid, r in steps:
        begin = start if free is None else max(start, free)
        free = begin + int(round(cost_s(r) * 1e9))
        c = owner[cid]
        c["link_end"] = max(c.get("link_end", free), free)


def _any_between(sorted_times: List[int], lo: int, hi: int) -> bool:
    """Is there a time t with lo < t <= hi?"""
    i = bisect.bisect_right(sorted_times, lo)
    return i < len(sorted_times) and sorted_times[i] <= hi


def _solve(periods, distinct: Dict[tuple, int]):
    """Least squares with per-key (alpha, beta) columns; returns (params, residuals)."""
    keys = sorted({k for comp, _ in periods for k in comp})
    pinned = {(k, "alpha") for k in keys if distinct.get(k, 2) < 2}
    notes = {k: "one chunk size: alpha not identifiable, fitted as pure bandwidth"
             for k in keys if distinct.get(k, 2) < 2}
    y = np.array([t for _, t in periods], dtype=np.float64)
    for _ in range(2 * len(keys) + 1):
        cols = [(k, term) for k in keys for term in ("alpha", "beta") if (k, term) not in pinned]
        if not cols:
            break
        a = np.zeros((len(periods), len(cols)))
        for i, (comp, _) in enumerate(periods):
            for j, (k, term) in enumerate(cols):
                if k in comp:
                    a[i, j] = comp[k][0] if term == "alpha" else comp[k][1]
        # Scale columns (bytes are ~1e6, counts ~1) so the solver's rank decision is fair.
        scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0)
        x, *_ = np.linalg.lstsq(a / scale, y, rcond=None)
        x = x / scale
        negative = [c for c, v in zip(cols, x) if v < 0]
        if not negative:
            break
        worst = min(negative, key=lambda c: x[cols.index(c)])
        pinned.add(worst)
        notes[worst[0]] = f"{worst[1]} < 0 in the fit, pinned at 0"
    values = dict(zip(cols, x)) if cols else {}
    params = {}
    for k in keys:
        alpha = float(values.get((k, "alpha"), 0.0))
        beta = float(values.get((k, "beta"), 0.0))
        count = sum(1 for comp, _ in periods if k in comp)
        params[k] = AlphaBeta(alpha, beta, count, notes.get(k, ""))
    predicted = np.array([sum(params[k].alpha * c + params[k].beta * b
                              for k, (c, b) in comp.items()) for comp, _ in periods])
    return params, list(y - predicted)


# --- topology models ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TopologyCostModel:
    """Analytic collective costs for a cluster of ``world_size`` ranks (the ``n`` below).

    ``bandwidth_gbps`` is the per-rank bus bandwidth (GB/s = 1e9 B/s) of the bottleneck
    network, as nccl-tests reports busbw; ``latency_s`` (alpha) is the cost per algorithm
    step. B is the chunk's payload bytes.

    ring   all_reduce      2(n-1) alpha + 2(n-1)/n B / bw
           RS, AG          (n-1) alpha + (n-1)/n B / bw
    tree   all_reduce      2 ceil(log2 n) (alpha + B / bw)   (binary tree, reduce then
                           broadcast, not pipelined: pessimistic for large B)
           RS, AG          as ring (NCCL runs them as rings)
    hier   n = nodes * g ranks, g per node; intra-node ring with (intra alpha, intra bw),
           inter-node ring between the g-th ranks of each node with (alpha, bw), all g
           inter-node rings running at once (one NIC per GPU):
           all_reduce      RS_intra(g, B) + AR_inter(nodes, B/g) + AG_intra(g, B)
           RS              RS_intra(g, B) + RS_inter(nodes, B/g)
           AG              AG_inter(nodes, B/g) + AG_intra(g, B)
    """

    topology: str
    bandwidth_gbps: float
    latency_s: float = 5e-6
    nodes: int = 1
    intra_bandwidth_gbps: Optional[float] = None
    intra_latency_s: Optional[float] = None
    issue_s: float = 0.0              # host costs, as in FittedCostModel (software, not
    credit_return_s: float = 0.0      # network: a what-if carries them over from the run)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise SimError(f"topology {self.topology!r}: expected ring, tree or hier:NODES")
        if not self.bandwidth_gbps > 0 or math.isinf(self.bandwidth_gbps):
            raise SimError(f"bandwidth {self.bandwidth_gbps!r} GB/s: expected a positive number")
        if self.latency_s < 0:
            raise SimError(f"latency {self.latency_s!r} s: expected >= 0")
        if self.topology == "hier":
            if self.nodes < 1:
                raise SimError(f"hier:{self.nodes}: expected at least 1 node")
            if not self.intra_bandwidth_gbps or self.intra_bandwidth_gbps <= 0:
                raise SimError("hier topology needs a positive intra-node bandwidth")
            if self.intra_latency_s is None or self.intra_latency_s < 0:
                raise SimError("hier topology needs an intra-node latency >= 0")

    def check_world(self, world_size: int) -> None:
        if world_size < 1:
            raise SimError(f"world size {world_size}: expected >= 1")
        if self.topology == "hier" and world_size % self.nodes:
            raise SimError(f"world size {world_size} does not split into {self.nodes} nodes "
                           f"of equal size (hier:{self.nodes})")

    def cost_s(self, step: str, decompose: str, nbytes: int, world_size: int) -> float:
        self.check_world(world_size)
        n, b = world_size, float(nbytes)
        alpha, bw = self.latency_s, self.bandwidth_gbps * 1e9
        if self.topology == "ring":
            return _ring(step, n, b, alpha, bw)
        if self.topology == "tree":
            if step == "all_reduce":
                return 0.0 if n == 1 else 2 * math.ceil(math.log2(n)) * (alpha + b / bw)
            return _ring(step, n, b, alpha, bw)
        g = n // self.nodes
        ia, ibw = self.intra_latency_s, self.intra_bandwidth_gbps * 1e9
        if step == "all_reduce":
            return (_ring("reduce_scatter", g, b, ia, ibw)
                    + _ring("all_reduce", self.nodes, b / g, alpha, bw)
                    + _ring("all_gather", g, b, ia, ibw))
        return _ring(step, g, b, ia, ibw) + _ring(step, self.nodes, b / g, alpha, bw)

    def describe(self) -> List[str]:
        bw, a = self.bandwidth_gbps, self.latency_s * 1e6
        if self.topology == "ring":
            return [f"ring: all_reduce = 2(n-1)*{a:g}us + 2(n-1)/n*B/({bw:g} GB/s); "
                    f"RS/AG = (n-1)*{a:g}us + (n-1)/n*B/({bw:g} GB/s)"]
        if self.topology == "tree":
            return [f"tree: all_reduce = 2*ceil(log2 n)*({a:g}us + B/({bw:g} GB/s)) "
                    f"(unpipelined binary tree); RS/AG as ring"]
        return [f"hier:{self.nodes}: g = n/{self.nodes} ranks per node; all_reduce = "
                f"RS_intra(g, B) + AR_inter({self.nodes}, B/g) + AG_intra(g, B)",
                f"  intra-node ring: {self.intra_latency_s * 1e6:g}us per step, "
                f"{self.intra_bandwidth_gbps:g} GB/s busbw; inter-node ring: {a:g}us per "
                f"step, {bw:g} GB/s busbw per GPU (all g rings at once)"]


def _ring(step: str, n: int, b: float, alpha: float, bw: float) -> float:
    if n <= 1:
        return 0.0
    if step == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / bw
    return (n - 1) * alpha + (n - 1) / n * b / bw
