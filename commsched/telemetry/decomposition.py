"""What ``commsched report`` says of the job's shape and how its all-reduces ran: nodes x
ranks per node (the ``topology`` table), the decomposition configured and the ones the
collectives ran with per lane (``comm_ops``), and, where ``decompose=auto`` measured, its
table per lane: each candidate's time per calibrated size and the one chosen
(``auto_choices``).

Every rank runs the same decompositions in the same order ([Note: every rank in step] in
docs/design.md) and holds the same auto table (the MAX over ranks), so both are read from
the lowest rank in the selection; ranks whose node layout differs from the lowest rank's
are listed.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional

from .store import RunData

__all__ = ["decomposition_section", "format_decomposition"]

_CANDIDATES = ("none", "hier", "leader")


def decomposition_section(run: RunData, ranks=None) -> Dict[str, object]:
    """``{"topology": ..., "decomposition": ...}`` for the report (see docs/telemetry.md);
    ``ranks``: the ranks selected (None: all)."""
    chosen = sorted(r for r in run.ranks if ranks is None or r in ranks)
    lowest = chosen[0] if chosen else None
    return {"topology": _topology(run, chosen),
            "decomposition": {
                "configured": _configured(run, lowest),
                "in_effect": _in_effect(run, lowest),
                "auto": _auto(run, lowest)}}


def _topology(run: RunData, ranks: List[int]) -> Optional[dict]:
    rows = {r["rank"]: r for r in run.rows("topology") if r["rank"] in ranks}
    if not rows:
        return None                 # a store written before the table existed
    first = rows[min(rows)]
    shape = ("world_size", "nodes", "local_size", "local_size_from")
    return {"world_size": first["world_size"], "nodes": first["nodes"],
            "local_ranks": first["local_size"], "local_size_from": first["local_size_from"],
            "ranks": {str(r): {"node": row["node"], "local_rank": row["local_rank"]}
                      for r, row in sorted(rows.items())},
            "differing_ranks": sorted(r for r, row in rows.items()
                                      if any(row[k] != first[k] for k in shape))}


def _configured(run: RunData, rank: Optional[int]) -> Optional[str]:
    for row in run.runs:
        if row["rank"] == rank:
            try:
                return json.loads(row.get("config_json") or "{}").get("decompose")
            except (ValueError, AttributeError):
                return None
    return None


def _in_effect(run: RunData, rank: Optional[int]) -> Dict[str, Dict[str, dict]]:
    """Per lane and decomposition: the requests and chunks that ran with it, and their
    bytes (each chunk once, however many steps it took)."""
    requests: Dict[tuple, set] = {}
    chunks: Dict[tuple, Dict[tuple, int]] = {}
    for op in run.rows("comm_ops", rank):
        if op["op"] != "all_reduce":
            continue
        key = (op["lane"], op["decompose"])
        requests.setdefault(key, set()).add((op["iteration"], op["request_key"]))
        chunks.setdefault(key, {})[(op["iteration"], op["request_key"],
                                    op["chunk_index"])] = op["nbytes"]
    out: Dict[str, Dict[str, dict]] = {}
    for (lane, decompose) in sorted(requests):
        seen = chunks[(lane, decompose)]
        out.setdefault(lane, {})[decompose] = {
            "requests": len(requests[(lane, decompose)]), "chunks": len(seen),
            "bytes": sum(seen.values())}
    return out


def _auto(run: RunData, rank: Optional[int]) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for row in run.rows("auto_choices", rank):
        lane = out.setdefault(row["lane"], {
            "dtype": row["dtype"], "nodes": row["nodes"], "local_ranks": row["local_size"],
            "margin": row["margin"], "sizes": []})
        lane["sizes"].append({"bytes": row["bytes"],
                              **{f"{c}_us": row[f"{c}_us"] for c in _CANDIDATES},
                              "chosen": row["chosen"]})
    return out


def format_decomposition(section: Dict[str, object]) -> List[str]:
    """The report's text lines for ``section`` (``decomposition_section``)."""
    lines: List[str] = []
    topo = section["topology"]
    if topo is not None:
        shape = (f"{topo['nodes']} nodes x {topo['local_ranks']} local ranks"
                 if topo["nodes"] is not None else
                 f"{topo['world_size']} ranks, not a whole number of nodes of "
                 f"{topo['local_ranks']}")
        lines.append(f"topology: {shape} (node size from {topo['local_size_from']})"
                     + (f"; ranks {topo['differing_ranks']} see another layout"
                        if topo["differing_ranks"] else ""))
    dec = section["decomposition"]
    ran = "; ".join(
        f"{lane}: " + ", ".join(f"{d} {v['requests']} requests ({v['bytes'] / 1e6:.2f} MB)"
                                for d, v in by.items())
        for lane, by in dec["in_effect"].items())
    lines.append(f"decomposition: {dec['configured'] or '-'} configured; all-reduces ran "
                 f"with {ran or 'nothing recorded'}")
    for lane, auto in dec["auto"].items():
        lines.append(f"auto on {lane} ({auto['dtype']}, {auto['nodes']} nodes x "
                     f"{auto['local_ranks']}; none unless another measured over "
                     f"{auto['margin']:.0%} faster), us per all-reduce:")
        lines.append(f"  {'bytes':>10} " + " ".join(f"{c:>9}" for c in _CANDIDATES)
                     + "  chosen")
        for size in auto["sizes"]:
            lines.append(f"  {size['bytes']:>10} "
                         + " ".join(_us(size[f'{c}_us']) for c in _CANDIDATES)
                         + f"  {size['chosen']}")
    return lines


def _us(value: Optional[float]) -> str:
    return "-".rjust(9) if value is None else f"{value:9.1f}"
