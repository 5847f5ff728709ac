"""A torchrun job where one rank runs without commsched (tests/fixtures/scripts/
commsched_on_rank0_only.py: rank 0 under ``commsched.run`` with COMMSCHED=1, rank 1 plain)
does not hang: rank 0 fails with the error naming rank 1 within COMMSCHED_TIMEOUT_S, and
torchrun ends the job."""

import sys

from frameworks import FIXTURES, env, launch, torchrun

SCRIPT = f"{FIXTURES}/train_ddp_exit.py"
MODEL = "DistributedDataParallel(Sequential, 2,177 parameters)"
TIMEOUT_S = 5


def test_a_rank_without_commsched_under_torchrun_ends_the_job_naming_it(tmp_path):
    cmd = torchrun(tmp_path, f"{FIXTURES}/commsched_on_rank0_only.py", SCRIPT)
    proc, _, elapsed = launch(cmd, tmp_path,
                              env(COMMSCHED="1", COMMSCHED_TIMEOUT_S=str(TIMEOUT_S)),
                              check=False, mark=": starting ")
    assert proc.returncode != 0
    assert (f"AgreementError: commsched: ranks [1] did not answer the agreement check before "
            f"the first collective (the launcher's hook on {MODEL}) within {TIMEOUT_S} s, "
            f"where ranks [0] did: they run without commsched") in proc.stderr, \
        proc.stderr[-3000:]
    assert "done" not in proc.stdout
    assert elapsed < TIMEOUT_S + 30, elapsed
