"""commsched.wrap checks, before its first collective (the parameters' broadcast), that
every rank wraps the same model in the same layer groups: a rank that differs, or never
wraps, is an AgreementError on the ranks that did, naming it, not a hang or a broadcast
into other tensors. 2 ranks, gloo."""

import os
import time

import pytest
import torch

from commsched import Config
from commsched.data_parallel import wrap
from commsched.safety import AgreementError
from distributed import run_workers
from tiny_nets import tiny_mlp


def _refused(rank, net, config=None, **kwargs):
    """wrap() of ``net`` fails with the AgreementError; nothing of the model changed."""
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(AgreementError) as err:
        wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), config, **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())
    return str(err.value)


def _other_model(rank, world):
    net = tiny_mlp(8 if rank == 0 else 9)
    message = _refused(rank, net)
    assert message.startswith("commsched: ranks disagree before the first collective "
                              "(commsched.wrap)"), message
    assert "'model' differs (ranks [0]: 'Sequential, 58 parameters in 4 tensors" in message
    assert "; ranks [1]: 'Sequential, 65 parameters in 4 tensors" in message
    assert "'layer groups (elements)' differs" in message


def test_ranks_wrapping_different_models_are_refused_before_any_collective():
    run_workers(_other_model, 2, timeout=90)


def _other_groups(rank, world):
    # (one group of 58 elements; one per Linear: 4 x 8 + 8, 8 x 2 + 2)
    message = _refused(rank, tiny_mlp(), group_bytes=None if rank == 0 else 0)
    assert "'layer groups (elements)' differs (ranks [0]: [58]; ranks [1]: [40, 18])" \
        in message, message
    assert "'model' differs" not in message


def test_ranks_cutting_the_model_into_other_groups_are_refused():
    run_workers(_other_groups, 2, timeout=90)


def _other_reduction(rank, world):
    config = Config(grad_reduce_dtype="bfloat16") if rank == 1 else None
    message = _refused(rank, tiny_mlp(), config)
    assert "'grad_reduce_dtype' differs (ranks [0]: None; ranks [1]: 'bfloat16')" \
        in message, message


def test_ranks_reducing_in_other_dtypes_are_refused():
    run_workers(_other_reduction, 2, timeout=90)


def _one_rank_never_wraps(rank, world, out_dir):
    done = os.path.join(out_dir, "rank0.txt")
    if rank == 1:
        while not os.path.exists(done):
            time.sleep(0.05)
        return
    start = time.monotonic()
    message = _refused(rank, tiny_mlp(), Config(timeout_s=3))
    with open(done, "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{message}")


def test_a_rank_that_never_wraps_is_named_within_the_timeout(tmp_path):
    run_workers(_one_rank_never_wraps, 2, str(tmp_path), timeout=90)
    elapsed, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert 3 <= float(elapsed) < 3 + 6, elapsed
    assert message.startswith("commsched: ranks [1] did not answer the agreement check before "
                              "the first collective (commsched.wrap) within 3 s, where ranks "
                              "[0] did"), message


def _same_everywhere(rank, world):
    net = tiny_mlp()
    model, opt = wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    finally:
        model.close()


def test_ranks_that_agree_wrap_and_train():
    run_workers(_same_everywhere, 2, timeout=90)
