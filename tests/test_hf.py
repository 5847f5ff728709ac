"""Hugging Face ``Trainer`` in its own idiom (examples/integrations/hf_trainer.py: a small
GPT-2 from a config, random tokens), 2 CPU ranks on gloo. With COMMSCHED=1 under torchrun
and under ``accelerate launch``, every rank's Trainer trains its DDP model with
commsched's hook, and each rank's logged losses and final parameters are bitwise those of
the same script under torchrun with commsched off."""

import os
import sys

import pytest

from frameworks import EXAMPLES, env, launch, notices, torchrun

SCRIPT = f"{EXAMPLES}/hf_trainer.py"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each rank's record of the script under torchrun, commsched off."""
    tmp_path = tmp_path_factory.mktemp("off")
    _, results, _ = launch(torchrun(tmp_path, "-m", "commsched.run", SCRIPT), tmp_path, env())
    assert sorted(results) == [0, 1]
    assert all(results[rank]["hooks"] == [] for rank in (0, 1))
    return results


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_the_trainers_ddp_model_gets_the_hook_on_every_rank_and_matches_commsched_off(
        tmp_path, reference, launcher):
    cmd = (torchrun(tmp_path, "-m", "commsched.run", SCRIPT) if launcher == "torchrun"
           else ACCELERATE + ["-m", "commsched.run", SCRIPT])
    # (accelerate writes its default config under HF_HOME when it has none)
    proc, results, _ = launch(cmd, tmp_path, env(COMMSCHED="1", HF_HOME=str(tmp_path / "hf")))
    assert sorted(results) == [0, 1]
    for rank in (0, 1):
        assert results[rank]["hooks"] == ["commsched_hook"], (rank, results[rank])
        assert results[rank]["losses"] == reference[rank]["losses"], rank
        assert results[rank]["checksum"] == reference[rank]["checksum"], rank
    assert len(results[0]["losses"]) == 4
    # (the line docs/integrations.md shows)
    assert notices(proc)[0].endswith(
        "the DDP hook on DistributedDataParallel(GPT2LMHeadModel, 30,592 parameters) on all 2 "
        "ranks; settings: defaults"), proc.stderr[-2000:]
