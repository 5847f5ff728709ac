"""An Accelerate training loop in Accelerate's own idiom (examples/integrations/
accelerate_loop.py: ``Accelerator.prepare``, ``accelerator.backward``), 2 CPU ranks on
gloo under ``accelerate launch``: with COMMSCHED=1 the prepared DDP model has commsched's
hook on every rank, and each rank's losses and final parameters are bitwise those of the
same launch with commsched off."""

from frameworks import EXAMPLES, env, launch, notices
from test_hf import ACCELERATE

SCRIPT = f"{EXAMPLES}/accelerate_loop.py"


def test_the_prepared_model_gets_the_hook_on_every_rank_and_matches_commsched_off(tmp_path):
    runs = {}
    for setting in ("0", "1"):
        where = tmp_path / f"commsched{setting}"
        where.mkdir()
        # (accelerate writes its default config under HF_HOME when it has none)
        runs[setting] = launch(ACCELERATE + ["-m", "commsched.run", SCRIPT], where,
                               env(COMMSCHED=setting, HF_HOME=str(tmp_path / "hf")))
    (_, off, _), (proc, on, _) = runs["0"], runs["1"]
    assert sorted(off) == sorted(on) == [0, 1]
    for rank in (0, 1):
        assert off[rank]["hooks"] == [], (rank, off[rank])
        assert on[rank]["hooks"] == ["commsched_hook"], (rank, on[rank])
        assert on[rank]["world"] == 2
        assert len(on[rank]["losses"]) == 6
        assert on[rank]["losses"] == off[rank]["losses"], rank
        assert on[rank]["checksum"] == off[rank]["checksum"], rank
    assert notices(proc)[0].endswith(
        "the DDP hook on DistributedDataParallel(Sequential, 1,153 parameters) on all 2 "
        "ranks; settings: defaults"), proc.stderr[-2000:]
