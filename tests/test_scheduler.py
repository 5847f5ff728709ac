"""The scheduler against plain collectives, on 2 and 4 gloo processes.

References are computed without the code under test: each rank's input is a known function
of (rank, iteration, request), so the reduced value is a local sum over ranks. With 2 ranks
a sum of two values does not depend on the reduction order, so results must be bitwise
equal; with 4 ranks gloo's ring order depends on the tensor size, so chunked reductions
may differ in the last bits and are compared within the dtype's rounding.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist

from commsched import Config, Scheduler, SchedulerError
from distributed import run_workers

SIZES = (1, 7, 1000, 4099)          # not divisible by the group size or the chunk size
CONFIGS = [
    dict(policy=p, decompose=d, partition_bytes=1024, credit_bytes=c, profile_iters=1)
    for p in ("priority", "fifo") for d in ("none", "rs_ag") for c in (0, 3000)
] + [dict(partition_bytes=0, credit_bytes=0)]


def rank_input(rank, iteration, request, numel, dtype):
    gen = torch.Generator().manual_seed(1000 * iteration + 10 * request + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def expected_sum(world, iteration, request, numel, dtype):
    parts = [rank_input(r, iteration, request, numel, dtype).double() for r in range(world)]
    return sum(parts).to(dtype)


def assert_reduced(out, ref, world):
    if world == 2:
        assert torch.equal(out, ref), (out - ref).abs().max()
    else:
        tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(out.dtype, 2e-2)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _all_reduce_matches_reference(rank, world, configs, dtypes, iterations):
    for kw in configs:
        sched = Scheduler(Config(**kw), trace_dispatch=True)
        for dtype in dtypes:
            for it in range(iterations):
                tensors = [rank_input(rank, it, i, n, dtype) for i, n in enumerate(SIZES)]
                reqs = [sched.submit(t, key=(str(dtype), i), priority=len(SIZES) - i)
                        for i, t in enumerate(tensors)]
                sched.end_iteration()
                for i, req in enumerate(reqs):
                    ref = expected_sum(world, it, i, SIZES[i], dtype)
                    # 2 ranks: the sum in the input dtype is exact-order; compare to the
                    # same two-term sum in that dtype.
                    if world == 2:
                        ref = (rank_input(0, it, i, SIZES[i], dtype)
                               + rank_input(1, it, i, SIZES[i], dtype))
                    assert_reduced(req.wait(), ref, world)
        sched.drain(timeout=30)
        logs = [None] * world
        dist.all_gather_object(logs, sched.dispatch_log())
        assert all(log == logs[0] for log in logs), f"dispatch order differs for {kw}"
        if kw.get("policy", "priority") == "priority" and kw.get("partition_bytes"):
            assert any(entry[0] == "plan" for entry in logs[0]), "no plan was built"
        sched.close()


def test_all_reduce_equals_plain_sum_2_ranks():
    run_workers(_all_reduce_matches_reference, 2, CONFIGS,
                (torch.float32, torch.float64, torch.bfloat16, torch.float16), 3, timeout=240)


def test_all_reduce_equals_plain_sum_4_ranks():
    configs = [CONFIGS[1], CONFIGS[3], CONFIGS[6], CONFIGS[-1]]
    # (3 iterations: the lane's first is not profiled, the second is, the third planned)
    run_workers(_all_reduce_matches_reference, 4, configs, (torch.float32,), 3, timeout=240)


def _average_matches_ddp_semantics(rank, world):
    sched = Scheduler(Config(partition_bytes=64, credit_bytes=128))
    t = rank_input(rank, 0, 0, 999, torch.float32)
    out = sched.submit(t, key="g", average=True).wait()
    # DDP's default: each rank divides by the world size, then the sum.
    ref = sum(rank_input(r, 0, 0, 999, torch.float32) / world for r in range(world))
    assert torch.equal(out, ref)
    sched.close()


def test_average_divides_before_the_sum_like_ddp():
    run_workers(_average_matches_ddp_semantics, 2, timeout=60)


def _join_waits_for_every_step(rank, world):
    """On gloo a decomposed chunk's all-gather is issued only once its reduce-scatter
    completed: join() must wait for that later step too, not only for what was in flight
    when it was called."""
    sched = Scheduler(Config(decompose="rs_ag", partition_bytes=1024, policy="fifo"))
    for it in range(3):
        tensors = [rank_input(rank, it, i, n, torch.float32) for i, n in enumerate(SIZES)]
        reqs = [sched.submit(t, key=i) for i, t in enumerate(tensors)]
        sched.end_iteration()
        sched.join()
        assert all(req.done() for req in reqs)
        for i, req in enumerate(reqs):
            ref = (rank_input(0, it, i, SIZES[i], torch.float32)
                   + rank_input(1, it, i, SIZES[i], torch.float32))
            assert_reduced(req.tensor, ref, world)
    sched.close()


def test_join_waits_for_the_later_steps_of_a_decomposed_chunk():
    run_workers(_join_waits_for_every_step, 2, timeout=60)


def _reduce_scatter_and_all_gather(rank, world, partition_bytes):
    sched = Scheduler(Config(partition_bytes=partition_bytes, credit_bytes=256))
    shard = 37
    full = [rank_input(r, 1, 0, world * shard, torch.float32) for r in range(world)]
    t = full[rank].clone()
    sched.submit(t, key="rs", op="reduce_scatter").wait()
    ref = sum(full)
    own = slice(rank * shard, (rank + 1) * shard)
    assert_reduced(t[own], ref[own], world)

    g = torch.zeros(world * shard)
    g[own] = torch.arange(shard, dtype=torch.float32) + 100 * rank
    sched.submit(g, key="ag", op="all_gather").wait()
    expected = torch.cat([torch.arange(shard, dtype=torch.float32) + 100 * r
                          for r in range(world)])
    assert torch.equal(g, expected)
    sched.close()


@pytest.mark.parametrize("partition_bytes", [0, 40])
def test_reduce_scatter_and_all_gather_2_ranks(partition_bytes):
    run_workers(_reduce_scatter_and_all_gather, 2, partition_bytes, timeout=60)


def test_reduce_scatter_and_all_gather_4_ranks():
    run_workers(_reduce_scatter_and_all_gather, 4, 160, timeout=90)


def _credit_bounds_bytes_in_flight(rank, world):
    results = {}
    for credit in (1024, 0):
        sched = Scheduler(Config(partition_bytes=256, credit_bytes=credit, policy="fifo"))
        reqs = [sched.submit(torch.ones(4096), key=i) for i in range(4)]
        sched.end_iteration()
        for r in reqs:
            r.wait()
        results[credit] = sched.stats()["peak_in_flight_bytes"]
        sched.close()
    assert 256 <= results[1024] <= 1024
    # Unbounded: everything submitted before the first completion may be in flight.
    assert results[0] >= results[1024]


def test_credit_window_bounds_bytes_in_flight():
    run_workers(_credit_bounds_bytes_in_flight, 2, timeout=60)


def _adversarial_timing(rank, world, iterations, kw):
    """Every rank sleeps random, different amounts between readiness events (with
    COMMSCHED_VERIFY's per-iteration cross-check in the first case)."""
    rng = random.Random(rank * 7919 + 1)
    sched = Scheduler(Config(**kw), trace_dispatch=True)
    sizes = (300, 5, 1200, 64)
    for it in range(iterations):
        reqs = []
        for i, n in enumerate(sizes):
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.004)
            t = rank_input(rank, it, i, n, torch.float32)
            reqs.append(sched.submit(t, key=i, priority=len(sizes) - i))
        sched.end_iteration()
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.004)
        for i, r in enumerate(reqs):
            ref = sum(rank_input(q, it, i, sizes[i], torch.float32) for q in range(world))
            assert_reduced(r.wait(), ref, world)
    sched.drain(timeout=30)
    logs = [None] * world
    dist.all_gather_object(logs, sched.dispatch_log())
    assert all(log == logs[0] for log in logs)
    assert sched.stats()["iterations"] == iterations
    sched.close()


@pytest.mark.parametrize("kw", [
    dict(policy="priority", partition_bytes=1024, credit_bytes=2048, profile_iters=1,
         verify=True),
    dict(policy="priority", decompose="rs_ag", partition_bytes=2048, credit_bytes=4096,
         profile_iters=2),
])
def test_adversarial_timing_no_hang_same_results(kw):
    run_workers(_adversarial_timing, 2, 200, kw, timeout=240)


def _layout_change_mid_run(rank, world):
    """A request that appears, disappears or changes size after the plan was built keeps
    every rank in step (plan entries skipped, unknown requests appended)."""
    sched = Scheduler(Config(partition_bytes=128, credit_bytes=256, profile_iters=1),
                      trace_dispatch=True)
    layouts = [(100, 50, 30), (100, 50, 30), (100, 60, 30), (100, 30), (7, 100, 30, 5)]
    for it, sizes in enumerate(layouts * 2):
        reqs = [sched.submit(torch.full((n,), float(rank + 1)), key=i, priority=-i)
                for i, n in enumerate(sizes)]
        sched.end_iteration()
        for r, n in zip(reqs, sizes):
            assert torch.equal(r.wait(), torch.full((n,), float(sum(range(1, world + 1)))))
    logs = [None] * world
    dist.all_gather_object(logs, sched.dispatch_log())
    assert all(log == logs[0] for log in logs)
    sched.close()


def test_layout_change_keeps_ranks_in_step():
    run_workers(_layout_change_mid_run, 2, timeout=90)


def test_submit_rejects_bad_requests():
    sched = Scheduler(Config())
    with pytest.raises(ValueError, match="flat contiguous"):
        sched.submit(torch.zeros(2, 2), key="x")
    with pytest.raises(ValueError, match="op="):
        sched.submit(torch.zeros(4), key="x", op="broadcast")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="partition_bytes="):
            sched.submit(torch.zeros(4), key="x", partition_bytes=bad)
    sched.close()


def test_partition_bytes_of_one_request_overrides_the_lane(world1):
    """submit(partition_bytes=...): 0 makes one chunk, a size cuts at that size; the
    lane's own size applies to the other requests."""
    sched = Scheduler(Config(partition_bytes=256, credit_bytes=0, policy="fifo"))
    values = [torch.arange(1000, dtype=torch.float32) + k for k in range(3)]
    reqs = [sched.submit(values[0].clone(), key="lane"),
            sched.submit(values[1].clone(), key="whole", partition_bytes=0),
            sched.submit(values[2].clone(), key="1000", partition_bytes=1000)]
    sched.end_iteration()
    assert [len(r.chunks) for r in reqs] == [16, 1, 4]     # 15 x 64 floats + 40
    for req, expected in zip(reqs, values):
        assert torch.equal(req.wait(), expected)        # one rank: the sum is the value
    sched.close()


def test_a_key_submitted_twice_in_one_iteration_is_rejected(world1):
    sched = Scheduler(Config(partition_bytes=256, policy="fifo"))
    sched.submit(torch.ones(10), key="w")
    with pytest.raises(SchedulerError, match="'w' submitted twice"):
        sched.submit(torch.ones(10), key="w")
    sched.end_iteration()
    sched.submit(torch.ones(10), key="w").wait()      # a new iteration takes it again
    sched.end_iteration()
    sched.close()


@pytest.mark.parametrize("partition_bytes", [0, 256])
def test_an_average_over_one_rank_is_the_sum_and_touches_the_tensor_once(
        world1, partition_bytes):
    """Dividing by a group of one changes no value, and NCCL runs ReduceOp.AVG over one
    rank as a kernel of its own: the request sums (no division, no AVG), and the values
    are the input's, bitwise."""
    sched = Scheduler(Config(partition_bytes=partition_bytes, credit_bytes=0, policy="fifo"))
    value = torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 3
    tensor = value.clone()
    version = tensor._version           # an in-place division would count a write
    req = sched.submit(tensor, key="g", average=True)
    assert req.reduce_op == dist.ReduceOp.SUM
    assert tensor._version == version
    sched.end_iteration()
    assert torch.equal(req.wait(), value)
    sched.close()
