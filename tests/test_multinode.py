"""More than one machine: two torchrun agents on this host act as two nodes of two ranks
each (static rendezvous on localhost) and run an unmodified DDP script under
``-m commsched.run`` with the hierarchical decomposition; its parameters must equal those
of the same script under plain DDP (4 ranks, gloo: within float32 rounding, since the
hierarchy sums in another order)."""

import os
import subprocess
import sys

import torch

from distributed import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "scripts", "train_ddp_save.py")


def _two_nodes(out_dir, settings):
    """Run the script on 2 "nodes" x 2 ranks; returns the ranks' output lines."""
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
    lines = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            assert agent.returncode == 0, err[-3000:]
            lines += [line for line in out.splitlines() if line.startswith("rank=")]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return sorted(lines)


def test_two_nodes_hierarchical_equals_plain_ddp(tmp_path):
    plain_dir, sched_dir = tmp_path / "plain", tmp_path / "commsched"
    plain_dir.mkdir()
    sched_dir.mkdir()
    plain = _two_nodes(plain_dir, {"COMMSCHED": "0"})
    scheduled = _two_nodes(sched_dir, {"COMMSCHED": "1", "COMMSCHED_DECOMPOSE": "hier"})
    assert plain == [f"rank={r} decompose=none" for r in range(4)]
    # LOCAL_WORLD_SIZE from each agent: 2 ranks per node, hence 2 nodes.
    assert scheduled == [f"rank={r} decompose=hier:2" for r in range(4)]
    ref = torch.load(plain_dir / "params.pt")
    got = torch.load(sched_dir / "params.pt")
    assert len(ref) == len(got)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
