"""More than one machine: two torchrun agents on this host act as two nodes of two ranks
each (static rendezvous on localhost) and run an unmodified DDP script under
``-m commsched.run``; its parameters must equal those of the same script with commsched
off: bit for bit where the scheduler runs gloo's own all-reduce or reduce-scatter +
all-gather over the four ranks (none, rs_ag), within float32 rounding where the hierarchy
sums in another order (hier, auto). Under auto, what was chosen is said by rank 0 and in
``commsched report``, and is what ran."""

import bisect
import json
import os
import subprocess
import sys

import pytest
import torch

from commsched.telemetry import report_main

from distributed import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "scripts", "train_ddp_save.py")


def _two_nodes(out_dir, settings):
    """Run the script on 2 "nodes" x 2 ranks; returns the ranks' output lines and the
    agents' stderr."""
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update(settings, OUT_DIR=str(out_dir))
    port = free_port()
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr",
               "127.0.0.1", "--master-port", str(port), "--log-dir",
               str(out_dir / f"node{node}"), "-m", "commsched.run", SCRIPT]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    lines, errs = [], ""
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            assert agent.returncode == 0, err[-3000:]
            lines += [line for line in out.splitlines() if line.startswith("rank=")]
            errs += err
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return sorted(lines), errs


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The script with commsched off: rank 0's final parameters."""
    out_dir = tmp_path_factory.mktemp("multinode") / "plain"
    lines, _ = _two_nodes(out_dir, {"COMMSCHED": "0"})
    assert lines == [f"rank={r} decompose=none" for r in range(4)]
    return torch.load(out_dir / "params.pt")


def _params(out_dir):
    return torch.load(out_dir / "params.pt")


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_two_nodes_flat_decompositions_are_bit_identical_to_commsched_off(plain, tmp_path,
                                                                          decompose):
    lines, _ = _two_nodes(tmp_path / decompose, {"COMMSCHED": "1",
                                                 "COMMSCHED_DECOMPOSE": decompose})
    # (these two build no topology: ":1")
    assert lines == [f"rank={r} decompose={decompose}:1" for r in range(4)]
    got = _params(tmp_path / decompose)
    assert len(got) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_two_nodes_hierarchical_equals_commsched_off_within_rounding(plain, tmp_path):
    lines, _ = _two_nodes(tmp_path / "hier", {"COMMSCHED": "1", "COMMSCHED_DECOMPOSE": "hier"})
    # LOCAL_WORLD_SIZE from each agent: 2 ranks per node, hence 2 nodes.
    assert lines == [f"rank={r} decompose=hier:2" for r in range(4)]
    got = _params(tmp_path / "hier")
    assert len(got) == len(plain)
    assert max((a - b).abs().max().item() for a, b in zip(got, plain)) <= 1e-6


def test_two_nodes_auto_equals_commsched_off_and_reports_its_choice(plain, tmp_path, capsys):
    runs = tmp_path / "runs"
    lines, err = _two_nodes(tmp_path / "auto", {"COMMSCHED": "1", "COMMSCHED_DECOMPOSE": "auto",
                                                "COMMSCHED_TELEMETRY_DIR": str(runs)})
    assert lines == [f"rank={r} decompose=auto:2" for r in range(4)]
    got = _params(tmp_path / "auto")
    assert len(got) == len(plain)
    assert max((a - b).abs().max().item() for a, b in zip(got, plain)) <= 1e-6
    # One line, from rank 0 only.
    said = [line for line in err.splitlines() if "decompose=auto on" in line]
    assert len(said) == 1, err[-3000:]
    assert said[0].startswith("commsched: decompose=auto on 2 nodes x 2 local ranks (lane ")
    assert report_main([str(runs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    topology = report["topology"]
    assert (topology["nodes"], topology["local_ranks"], topology["local_size_from"]) == (
        2, 2, "LOCAL_WORLD_SIZE")
    assert report["decomposition"]["configured"] == "auto"
    (lane, table), = report["decomposition"]["auto"].items()
    assert (table["nodes"], table["local_ranks"], table["margin"]) == (2, 2, 0.2)
    sizes = [row["bytes"] for row in table["sizes"]]
    for row in table["sizes"]:      # the margin rule, recomputed from the reported times
        chosen = "none"
        for candidate in ("hier", "leader"):
            if row[f"{candidate}_us"] < 0.8 * row[f"{chosen}_us"]:
                chosen = candidate
        assert row["chosen"] == chosen, row
    assert said[0].endswith("(none unless another measured over 20% faster)")
    # What ran is what the table says for each bucket's size (partition off: one chunk per
    # bucket), as the report counts it.
    from commsched.telemetry import load_run
    ran = {}
    for op in load_run(str(runs)).rows("comm_ops", 0):
        row = table["sizes"][min(bisect.bisect_left(sizes, op["nbytes"]), len(sizes) - 1)]
        assert op["decompose"] == row["chosen"], (op, row)
        ran.setdefault(op["decompose"], set()).add((op["iteration"], op["request_key"]))
    assert {d: v["requests"] for d, v in report["decomposition"]["in_effect"][lane].items()} \
        == {d: len(keys) for d, keys in ran.items()}
