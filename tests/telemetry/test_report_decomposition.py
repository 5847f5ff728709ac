"""``commsched report``: the topology (nodes x local ranks), the decomposition configured
and the ones the all-reduces ran with, and ``decompose=auto``'s measured table, in the
text and in ``--json``; stores are written through the real recorder."""

import json

import pytest

from commsched import Config
from commsched.observer import AutoChoice
from commsched.telemetry import report_main
from commsched.telemetry.recorder import open_recorder

from .helpers import T0, chunk

MS = 1_000_000
AUTO_ROWS = ({"bytes": 4096, "none_us": 100.0, "hier_us": 300.0, "leader_us": 150.0,
              "chosen": "none"},
             {"bytes": 1 << 20, "none_us": 900.0, "hier_us": 500.0, "leader_us": 700.0,
              "chosen": "hier"})


def _hier_chunk(iteration, key, index, nbytes):
    """The three steps of a hier chunk, as the lane reports them."""
    return [chunk(iteration=iteration, key=key, index=index, num_chunks=2, nbytes=nbytes,
                  step=step, decompose="hier", start=T0 + s * MS, end=T0 + (s + 1) * MS)
            for s, step in enumerate(("reduce_scatter:intra", "all_reduce:inter",
                                      "all_gather:intra"))]


def _write(run_dir, rank, auto=True):
    config = Config(telemetry_dir=str(run_dir), decompose="auto" if auto else "none",
                    local_size=2)
    rec = open_recorder(config, rank=rank, world_size=4, nvml_period_ms=0)
    assert rec.enabled, rec.disabled_reason
    if auto:
        rec.auto_chosen(AutoChoice("g0", "float32", 2, 2, 0.2, AUTO_ROWS))
        records = []
        for it in (0, 1):
            # "big": two hier chunks of 1 MiB; "small": one none chunk of 4 KiB
            for index in (0, 1):
                records += _hier_chunk(it, "big", index, 1 << 20)
            records.append(chunk(iteration=it, key="small", nbytes=4096, decompose="none",
                                 start=T0 + 5 * MS, end=T0 + 6 * MS))
        rec.on_chunks(records)
    rec.close()


@pytest.fixture
def auto_run(tmp_path):
    for rank in range(4):
        _write(tmp_path, rank)
    return str(tmp_path)


def test_json_has_nodes_by_local_ranks_and_where_the_node_size_came_from(auto_run, capsys):
    assert report_main([auto_run, "--json"]) == 0
    topo = json.loads(capsys.readouterr().out)["topology"]
    assert topo == {"world_size": 4, "nodes": 2, "local_ranks": 2,
                    "local_size_from": "Config.local_size",
                    "ranks": {str(r): {"node": r // 2, "local_rank": r % 2} for r in range(4)},
                    "differing_ranks": []}


def test_json_has_the_decomposition_in_effect_and_autos_table(auto_run, capsys):
    assert report_main([auto_run, "--json"]) == 0
    dec = json.loads(capsys.readouterr().out)["decomposition"]
    assert dec["configured"] == "auto"
    # per lane and decomposition: 2 iterations x 1 request, each chunk's bytes once
    assert dec["in_effect"] == {"g0": {
        "hier": {"requests": 2, "chunks": 4, "bytes": 4 << 20},
        "none": {"requests": 2, "chunks": 2, "bytes": 2 * 4096}}}
    assert dec["auto"] == {"g0": {"dtype": "float32", "nodes": 2, "local_ranks": 2,
                                  "margin": 0.2, "sizes": [dict(r) for r in AUTO_ROWS]}}


def test_text_names_the_topology_and_the_choice_per_size(auto_run, capsys):
    assert report_main([auto_run]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "topology: 2 nodes x 2 local ranks (node size from Config.local_size)" in lines
    assert ("decomposition: auto configured; all-reduces ran with g0: hier 2 requests "
            "(4.19 MB), none 2 requests (0.01 MB)") in lines
    at = lines.index("auto on g0 (float32, 2 nodes x 2; none unless another measured over "
                     "20% faster), us per all-reduce:")
    assert lines[at + 1].split() == ["bytes", "none", "hier", "leader", "chosen"]
    assert lines[at + 2].split() == ["4096", "100.0", "300.0", "150.0", "none"]
    assert lines[at + 3].split() == [str(1 << 20), "900.0", "500.0", "700.0", "hier"]


def test_without_auto_the_report_says_what_was_configured_and_no_table(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")      # ignored: Config.local_size is set
    for rank in range(4):
        _write(tmp_path, rank, auto=False)
    assert report_main([str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decomposition"] == {"configured": "none", "in_effect": {}, "auto": {}}
    assert (data["topology"]["nodes"], data["topology"]["local_ranks"]) == (2, 2)


def test_node_size_from_local_world_size_or_one_node(monkeypatch):
    from commsched.topology import node_layout
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_layout(0, 8, 5) == {"nodes": 2, "local_size": 4, "node": 1,
                                    "local_rank": 1, "local_size_from": "LOCAL_WORLD_SIZE"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert node_layout(0, 8, 5)["nodes"] is None        # 8 ranks are no nodes of 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert node_layout(0, 8, 5) == {"nodes": 1, "local_size": 8, "node": 0,
                                    "local_rank": 5,
                                    "local_size_from": "one node (LOCAL_WORLD_SIZE unset)"}


def test_ranks_that_see_another_layout_are_named(tmp_path, capsys, monkeypatch):
    for rank in range(4):
        # rank 3 was started with another LOCAL_WORLD_SIZE than the others
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4" if rank == 3 else "2")
        rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=rank, world_size=4,
                            nvml_period_ms=0)
        rec.close()
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("topology: 2 nodes x 2 local ranks (node size from LOCAL_WORLD_SIZE); ranks [3] "
            "see another layout") in out
