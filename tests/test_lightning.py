"""PyTorch Lightning in its own idiom (examples/integrations/lightning_train.py: a
LightningModule and a Trainer), 2 CPU ranks on gloo. With COMMSCHED=1 under Lightning's own
launcher (which starts rank 1 as ``python train.py``), with ``ddp_spawn`` and under
torchrun, every rank trains with commsched's hook, and each rank's losses and final
parameters are bitwise those of the same script with commsched off (2 ranks: the same
sums). A rank that the launcher starts without commsched ends the job, named."""

import sys

import pytest

from frameworks import EXAMPLES, FIXTURES, env, launch, notices, torchrun

SCRIPT = f"{EXAMPLES}/lightning_train.py"
MODEL = "DistributedDataParallel(Regressor, 5,313 parameters)"
TIMEOUT_S = 5


def _commands(tmp_path):
    under_launcher = [sys.executable, "-m", "commsched.run", SCRIPT, "--devices", "2"]
    return {"lightning": under_launcher,
            "ddp_spawn": under_launcher + ["--strategy", "ddp_spawn"],
            "torchrun": torchrun(tmp_path, "-m", "commsched.run", SCRIPT, "--devices", "2")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each rank's record of the script under Lightning's launcher, commsched off."""
    tmp_path = tmp_path_factory.mktemp("off")
    _, results, _ = launch(_commands(tmp_path)["lightning"], tmp_path, env())
    assert sorted(results) == [0, 1]
    assert all(results[rank]["hooks"] == [] for rank in (0, 1))
    return results


@pytest.mark.parametrize("launcher", ["lightning", "ddp_spawn", "torchrun"])
def test_every_rank_trains_with_the_hook_and_matches_commsched_off(tmp_path, reference,
                                                                    launcher):
    proc, results, _ = launch(_commands(tmp_path)[launcher], tmp_path, env(COMMSCHED="1"))
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        assert results[rank]["hooks"] == ["commsched_hook"], (rank, results[rank])
        assert results[rank]["losses"] == reference[rank]["losses"], rank
        assert results[rank]["checksum"] == reference[rank]["checksum"], rank
    assert results[0]["pid"] != results[1]["pid"]
    assert notices(proc)[0].endswith(f"the DDP hook on {MODEL} on all 2 ranks; settings: "
                                     f"defaults"), proc.stderr[-2000:]


def test_a_rank_lightning_starts_without_commsched_ends_the_job_naming_it(tmp_path):
    """Rank 1 started with COMMSCHED=0 in its environment: stock DDP there, commsched's
    hook on rank 0. Rank 0 fails naming rank 1 within COMMSCHED_TIMEOUT_S; its exit ends
    rank 1's collectives (the connection closes) and the job. Timed from Lightning's line
    that every rank joined (the start-up before it is the machine's)."""
    cmd = [sys.executable, "-m", "commsched.run", f"{FIXTURES}/children_without_commsched.py",
           SCRIPT, "--devices", "2"]
    proc, results, elapsed = launch(cmd, tmp_path,
                                    env(COMMSCHED="1", COMMSCHED_TIMEOUT_S=str(TIMEOUT_S)),
                                    check=False, mark="All distributed processes registered")
    assert proc.returncode != 0
    assert results == {}
    assert (f"AgreementError: commsched: ranks [1] did not answer the agreement check before "
            f"the first collective (the launcher's hook on {MODEL}) within {TIMEOUT_S} s, "
            f"where ranks [0] did: they run without commsched") in proc.stderr, \
        proc.stderr[-3000:]
    assert elapsed < TIMEOUT_S + 30, elapsed
