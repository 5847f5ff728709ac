"""Where in the training loop each collective is submitted: the same parts of the loop on
every rank (down to the module whose forward pre-hook submitted it), whatever the timing,
and never step() or zero_grad().

Collectives in flight when step() returns must be ones every rank issues without further
calls from the training loop. Otherwise a device synchronisation or a barrier between
step() and the next forward (a timing loop, a checkpoint) waits on one rank for a
collective the other rank issues only in its next forward: a deadlock. On 2x H200, rs_ag
hung that way when step() submitted the all-gathers whose reduce-scatters were done. Within
the forward likewise: an all-gather submitted at module 0's pre-hook on one rank and at
module 2's on the other deadlocks against a device synchronisation and a host-blocking
collective in between.
"""

import json
import os
import time

import pytest

from distributed import run_workers

STEPS = 6


def _log_submissions(rank, world_size, out_dir, decompose):
    """Train a few steps, one rank pausing after backward (its collectives complete before
    step(), the other's not; the ranks take turns); log each submission with the part of
    the training loop it came from."""
    import torch
    import torch.nn as nn

    import commsched
    from commsched.data_parallel import drain, wrap
    from commsched.scheduler import Scheduler

    phase = ["wrap"]
    log = []

    class Recording(Scheduler):
        def submit(self, tensor, **kwargs):
            log.append([phase[0], repr(kwargs["key"])])
            return super().submit(tensor, **kwargs)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                        nn.Linear(16, 4))
    config = commsched.Config(decompose=decompose)
    model, opt = wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), config,
                      group_bytes=0, scheduler=Recording(config))
    # Name the module whose pre-hooks run next (registered last with prepend: first).
    for k, layer in enumerate(net[::2]):
        layer.register_forward_pre_hook(lambda *_, k=k: phase.__setitem__(0, f"forward:{k}"),
                                        prepend=True)
    try:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 * step + rank))
            phase[0] = "forward:-"
            loss = model(x).square().mean()
            phase[0] = "backward"
            loss.backward()
            if (step + rank) % 2:
                time.sleep(0.05)
            phase[0] = "step"
            opt.step()
            phase[0] = "zero_grad"
            opt.zero_grad()
        phase[0] = "drain"
        drain(model)
    finally:
        model.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


@pytest.mark.parametrize("decompose", ["none", "rs_ag"])
def test_submissions_come_from_the_same_parts_of_the_loop_on_every_rank(tmp_path, decompose):
    run_workers(_log_submissions, 2, str(tmp_path), decompose, timeout=90)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for log in logs:
        assert not [e for e in log if e[0] in ("step", "zero_grad")], log
        # 3 layer groups (a group per Linear)
        if decompose == "none":
            # per step one all-reduce per group, in backward, nothing else
            assert [e[0] for e in log] == ["backward"] * (STEPS * 3), log
        else:
            # per step 3 reduce-scatters + the usage flags in backward; the 3 all-gathers
            # of the last step's update at the next forward's first pre-hook (in drain()
            # after the last)
            assert [e[0] for e in log].count("backward") == STEPS * 4, log
            assert [e for e in log if e[0] not in ("backward",)] == (
                [["forward:0", repr(("ag", g))] for _ in range(STEPS - 1) for g in range(3)]
                + [["drain", repr(("ag", g))] for g in range(3)]), log
    assert logs[0] == logs[1]
