"""One rule for averaging inside the collective (ReduceOp.AVG), asked by every adapter:
NCCL with CUDA tensors, where it gives the reference's numbers: any group where the
reference itself averages in the collective (Megatron-LM), power-of-two groups where the
reference divides (DDP; 1/n is exact there)."""

import pytest
import torch
import torch.distributed as dist

from commsched.collectives import averages_in_collective
from commsched.megatron_patches import bucket_group

GROUPS = [(backend, cuda, size) for backend, cuda in (("nccl", True), ("gloo", False),
                                                      ("gloo", True), ("nccl", False))
          for size in (2, 3, 4)]


def _expected(backend, cuda, size, reference_averages=False):
    # written out rather than computed: NCCL on the device; groups of 2 and 4 only where
    # the reference divides
    return (backend, cuda) == ("nccl", True) and (reference_averages or size in (2, 4))


@pytest.mark.parametrize("backend,cuda,size", GROUPS)
def test_average_runs_in_the_collective_on_nccl_power_of_two_groups_only(backend, cuda, size):
    assert averages_in_collective(backend, cuda, size) is _expected(backend, cuda, size)


@pytest.mark.parametrize("backend,cuda,size", GROUPS)
def test_a_reference_that_averages_in_the_collective_gets_avg_on_any_nccl_group(
        backend, cuda, size):
    assert (averages_in_collective(backend, cuda, size, reference_averages=True)
            is _expected(backend, cuda, size, reference_averages=True))


@pytest.mark.parametrize("size", (2, 3, 4))
def test_in_collective_average_is_taken_only_where_it_equals_dividing_first(size):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(size))
    same = torch.equal(x * (1.0 / size), x / size)
    assert same is averages_in_collective("nccl", True, size)


@pytest.mark.parametrize("backend,cuda,size", GROUPS)
def test_megatron_patches_follow_the_rule(monkeypatch, backend, cuda, size):
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group: size)

    class Tensor:
        is_cuda = cuda

    reduce_op, scale = bucket_group._reduction(True, object(), Tensor())
    # stock megatron-core averages in the collective on NCCL whatever the group's size
    if _expected(backend, cuda, size, reference_averages=True):
        assert (reduce_op, scale) == (dist.ReduceOp.AVG, None)
    else:
        assert (reduce_op, scale) == (dist.ReduceOp.SUM, 1.0 / size)
    assert bucket_group._reduction(False, object(), Tensor()) == (dist.ReduceOp.SUM, None)
