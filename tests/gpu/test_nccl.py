"""NCCL on 2 GPUs: the scheduler, the DDP hook and data-parallel mode against plain NCCL
and stock DDP.

Runs only where 2 GPUs are visible (the GPU machines); on CPU-only CI it is skipped.
With 2 ranks every element of a sum is a + b whatever the chunking, so results must be
bitwise equal to the plain collective and to stock DDP.
"""

import os
import sqlite3
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched
import commsched.hooks
from commsched.observer import Observer
from commsched.telemetry import open_recorder
from commsched.telemetry.store import rank_path
from distributed import free_port

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 GPUs (NCCL); run on the GPU machine")

CONFIGS = [
    commsched.Config(partition_bytes=64 << 10, credit_bytes=256 << 10, profile_iters=1),
    commsched.Config(partition_bytes=100_000, credit_bytes=0, decompose="rs_ag", policy="fifo"),
    commsched.Config(partition_bytes=0, credit_bytes=0),
    commsched.Config(partition_bytes=64 << 10, credit_bytes=0, profile_iters=1),
    commsched.Config(partition_bytes=100_000, credit_bytes=256 << 10, decompose="rs_ag"),
    # Each GPU a node: intra-node steps on one-rank groups, the sum between "nodes".
    commsched.Config(partition_bytes=1 << 20, credit_bytes=4 << 20, decompose="hier",
                     local_size=1),
    commsched.Config(partition_bytes=1 << 20, credit_bytes=4 << 20, decompose="leader",
                     local_size=1),
]


def _init(rank, world, port):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))


def _scheduler_vs_plain(rank, world, port):
    _init(rank, world, port)
    for config in CONFIGS:
        sched = commsched.Scheduler(config, trace_dispatch=True)
        for it in range(4):
            sizes = [1, 4097, 300_001, 1 << 20]
            gen = torch.Generator(device="cuda").manual_seed(10 * it + rank)
            ts = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
            refs = [t.clone() for t in ts]
            # Odd iterations average as DDP does: divide, then sum.
            average = it % 2 == 1
            for r in refs:
                if average:
                    r.div_(world)
                dist.all_reduce(r)
            # Work queued on the default stream before submit must be seen by the chunk.
            for t in ts:
                t.mul_(1.0)
            reqs = [sched.submit(t, key=i, priority=-i, average=average)
                    for i, t in enumerate(ts)]
            sched.end_iteration()
            # One-step decompositions average inside NCCL (2 ranks: a power of two).
            in_kernel = average and config.decompose in ("none", "rs_ag")
            assert all((r.reduce_op == dist.ReduceOp.AVG) == in_kernel for r in reqs), config
            for r, ref in zip(reqs, refs):
                out = r.wait()
                torch.cuda.current_stream().synchronize()
                assert torch.equal(out, ref), (config, (out - ref).abs().max().item())
        sched.drain(timeout=60)
        logs = [None] * world
        dist.all_gather_object(logs, sched.dispatch_log())
        assert logs[0] == logs[1]
        sched.close()
    dist.destroy_process_group()


def _synchronous_requests(rank, world, port):
    """submit(async_op=False): a whole all-reduce issued from submit() runs on the caller's
    stream (NCCL returns no work), after what the caller queued there (a delayed producer)
    and after the lane's asynchronous collectives before it (requests that ask for
    nothing); values equal plain NCCL's."""
    _init(rank, world, port)
    sched = commsched.Scheduler(commsched.Config(policy="fifo"))
    for it in range(4):
        sizes = [4097, 1 << 20, 300_001, 8 << 20, 1]
        gen = torch.Generator(device="cuda").manual_seed(10 * it + rank)
        ts = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
        refs = [t.clone() for t in ts]
        for r in refs:
            dist.all_reduce(r)
        asynchronous = [it % 2 == 1 and i % 2 == 0 for i in range(len(sizes))]
        torch.cuda._sleep(50_000_000)         # the producer is late: ~25 ms
        for t in ts:
            t.mul_(1.0)
        reqs = [sched.submit(t, key=i, async_op=a)
                for i, (t, a) in enumerate(zip(ts, asynchronous))]
        sched.end_iteration()
        for i, req in enumerate(reqs):
            assert (req.done_work is None) == (not asynchronous[i]), (it, i)
        for r, ref in zip(reqs, refs):
            out = r.wait()
            torch.cuda.current_stream().synchronize()
            assert torch.equal(out, ref), (it, r.key, (out - ref).abs().max().item())
    sched.drain(timeout=60)
    sched.close()
    dist.destroy_process_group()


def _credit_returns_on_device_completion(rank, world, port):
    """A future must not resolve while its collective still runs on the device: queue a
    long kernel before the collective, and check the result is complete when wait()
    returns on a host-synchronised view."""
    _init(rank, world, port)
    sched = commsched.Scheduler(commsched.Config(partition_bytes=1 << 20, credit_bytes=2 << 20))
    a = torch.randn(4096, 4096, device="cuda")
    t = torch.full((8 << 20,), float(rank + 1), device="cuda")
    for _ in range(20):
        a = a @ a / 64            # keeps the default stream busy for a while
    t.add_(0)                      # ordered after the matmuls
    req = sched.submit(t, key="t")
    sched.end_iteration()
    out = req.wait()
    # No stream sync: the data must already be final on the device.
    assert torch.equal(out.cpu(), torch.full((8 << 20,), 3.0))
    sched.drain(timeout=60)
    sched.close()
    dist.destroy_process_group()


class _Records(Observer):
    def __init__(self):
        self.chunks = []

    def on_chunk(self, record):
        self.chunks.append(record)

    def on_iteration(self, record):
        pass


def _lazy_completion(rank, world, port):
    """Unbounded credit on NCCL: nothing waits for a chunk's completion, so an iteration's
    chunks are completed in one batch once it ended (here drain() ends it), by the caller;
    their recorded device times are still when they finished on the device, not when
    they were completed."""
    _init(rank, world, port)
    records = _Records()
    sched = commsched.Scheduler(
        commsched.Config(partition_bytes=256 << 10, credit_bytes=0, policy="fifo"),
        observer=records)
    chunks = 3 * 16                   # below LAZY_ITEMS: nothing rings before drain()
    for it in range(3):
        ts = [torch.full((1 << 20,), float(rank + 1), device="cuda") for _ in range(3)]
        # Both ranks start together: a collective's device time runs from its start on
        # this rank, waiting for a peer still checking the last iteration included.
        dist.barrier()
        torch.cuda.synchronize()
        reqs = [sched.submit(t, key=i) for i, t in enumerate(ts)]
        torch.cuda.synchronize()
        time.sleep(0.2)               # the chunks finished long before anybody asks
        assert sched.stats()["completion_batches"] == it
        t_drain = time.time_ns()
        sched.drain(timeout=60)
        assert sched.stats()["completion_batches"] == it + 1
        for r in reqs:
            assert torch.equal(r.wait().cpu(), torch.full((1 << 20,), 3.0))
        got = records.chunks[-chunks:]
        assert len(records.chunks) == (it + 1) * chunks
        ends = [r.t_end_ns for r in got]
        assert ends == sorted(ends)                       # one stream: issue order
        assert ends[-1] < t_drain - 100_000_000, (ends[-1], t_drain)
        for r in got:
            assert r.t_dispatch_ns - 1_000_000 <= r.t_start_ns <= r.t_end_ns, r
            # (a 256 KiB all-reduce between two GPUs of one node: microseconds)
            assert 0 < r.t_end_ns - r.t_start_ns < 50_000_000, r
    # Telemetry on a lane the caller completes: the group timed its collectives itself.
    assert sched._lanes[dist.group.WORLD].issuer.group_timed
    sched.close()
    dist.destroy_process_group()


def _polled_completion(rank, world, port):
    """The default lane (no credit window, no telemetry): the caller's end_iteration
    completes what the device finished, the completion thread is never woken while
    iterations keep coming, and what stays in flight once they stop is handed to it by
    the watchdog. Batches tell nothing of the link's busy time: the plan's cost stays
    unmeasured rather than counting the wait for the tensors as link time."""
    _init(rank, world, port)
    sched = commsched.Scheduler(commsched.Config(timeout_s=10))   # watchdog period 1 s
    expected = torch.full((1 << 20,), 3.0)
    iterations = 6
    for it in range(iterations):
        ts = [torch.full((1 << 20,), float(rank + 1), device="cuda") for _ in range(3)]
        if it == iterations - 1:
            torch.cuda._sleep(200_000_000)    # ~100 ms: still running at the end
        reqs = [sched.submit(t, key=i, priority=2 - i) for i, t in enumerate(ts)]
        sched.end_iteration()
        lane = sched._lanes[dist.group.WORLD]
        in_flight = lane.completion.in_flight
        assert len(in_flight) <= 2, (it, len(in_flight))
        assert sched.stats()["thread_batches"] == 0, it
        if it < iterations - 1:
            for r in reqs:
                assert torch.equal(r.wait().cpu(), expected)
            time.sleep(0.1)
    assert sched.stats()["completion_batches"] >= 1
    assert in_flight                          # the last iteration's batch
    # Iterations stopped: the watchdog hands the last batch to the completion thread.
    deadline = time.monotonic() + 10
    while in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not in_flight
    assert sched.stats()["thread_batches"] >= 1
    for r in reqs:
        assert torch.equal(r.wait().cpu(), expected)
    assert lane.order.link_cost.nbytes == 0 and lane.order.link_cost.seconds_per_byte == 0.0
    sched.close()
    dist.destroy_process_group()


def _device_flush(rank, world, port):
    """A GPU-bound end of backward: the host ends each iteration while its device is busy
    for about 100 ms more, and the gradient comes after that. Telemetry stores as the
    iteration's flush when the device got there, so the all-reduce right after it is not
    counted exposed for the host's head start."""
    _init(rank, world, port)
    with tempfile.TemporaryDirectory() as run_dir:
        rec = open_recorder(commsched.Config(telemetry_dir=run_dir), rank=rank,
                            world_size=world, nvml_period_ms=0)
        # (fifo: a priority plan's profile exchange, in iteration 2, waits for the
        # device, on this thread, which would then no longer be ahead)
        sched = commsched.Scheduler(
            commsched.Config(partition_bytes=0, credit_bytes=0, policy="fifo"),
            observer=rec)
        host_flush = []
        for k in range(4):
            t = torch.full((1 << 20,), float(rank + 1), device="cuda")
            if k:
                # (Not in iteration 0: its submit sets the lane up, which waits for
                # the device, and the host would not be ahead any more.)
                torch.cuda._sleep(200_000_000)        # ~100 ms of device time
            req = sched.submit(t, key=0)
            host_flush.append(time.time_ns())
            sched.end_iteration()
            sched.drain(timeout=60)
            assert torch.equal(req.wait().cpu(), torch.full((1 << 20,), 3.0))
        sched.close()
        rec.close()
        with sqlite3.connect(rank_path(run_dir, rank)) as conn:
            rows = conn.execute("SELECT t_flush_ns, exposed_comm_ns FROM iterations "
                                "ORDER BY iteration").fetchall()
        assert len(rows) == 4, rows
        for (t_flush, exposed), t_host in zip(rows[1:], host_flush[1:]):
            assert t_flush - t_host > 50_000_000, t_flush - t_host
            # Against the host's ~100 ms head start: well under it, not zero, as the
            # peer's sleep of as many cycles may end later (its clock runs slower).
            assert exposed < 50_000_000, exposed
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)], nn.Linear(512, 8))

    def forward(self, x):
        return self.layers(x)


def _steps(model, opt, rank, steps):
    """The training loop of every comparison here: rank-seeded inputs, a squared loss."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(32, 512, device=device, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _train(config, kwargs, rank, steps=6, net=None):
    torch.manual_seed(0)
    ddp = DDP((net or Net)().cuda(), device_ids=[rank], **kwargs)
    if config is not None:
        commsched.hooks.register(ddp, config)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _steps(ddp, opt, rank, steps)
    return [p.detach().clone() for p in ddp.parameters()]


def _hook_vs_stock_ddp(rank, world, port):
    _init(rank, world, port)
    for kwargs in (dict(bucket_cap_mb=1), dict(bucket_cap_mb=1, gradient_as_bucket_view=True),
                   dict(bucket_cap_mb=25, static_graph=True)):
        ref = _train(None, kwargs, rank)
        for config in CONFIGS:
            got = _train(config, kwargs, rank)
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (kwargs, config, (a - b).abs().max().item())
    dist.destroy_process_group()


def _train_wrapped(config, group_bytes, rank, steps=6):
    """The same training as ``_train`` in commsched's data-parallel mode."""
    torch.manual_seed(0)
    model = Net().cuda()
    model, opt = commsched.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config,
                                group_bytes=group_bytes)
    _steps(model, opt, rank, steps)
    commsched.drain(model)
    params = [p.detach().clone() for p in model.parameters()]
    model.close()
    return params


def _wrap_vs_stock_ddp(rank, world, port):
    _init(rank, world, port)
    ref = _train(None, dict(bucket_cap_mb=1), rank)
    cases = [(commsched.Config(), None),                        # default group size
             (commsched.Config(), 0),                           # a group per layer
             (commsched.Config(partition_bytes=64 << 10, credit_bytes=256 << 10), 0),
             (commsched.Config(decompose="rs_ag"), 0)]          # ZeRO-1 shards
    for config, group_bytes in cases:
        got = _train_wrapped(config, group_bytes, rank)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (config, group_bytes, (a - b).abs().max().item())
    dist.destroy_process_group()


class _DelayGrad(torch.autograd.Function):
    """Identity whose backward first keeps the stream busy (~5 ms): the gradients of the
    layers before it are produced on the device long after autograd's thread ran their
    hooks, which is when the commsched hook issues their collectives."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(10_000_000)
        return grad


class SlowBackward(Net):
    def forward(self, x):
        for layer in self.layers:
            x = layer(_DelayGrad.apply(x))
        return x


def _delayed_producers_vs_stock_ddp(rank, world, port):
    """The stream-order race the hot path must not have: the hook issues a bucket's
    collective as soon as autograd's thread hands it over, while the device is still
    behind, asleep before each layer's gradient kernels. A collective not ordered after
    them (or a DDP that read the buckets before the collectives ended) would reduce or
    apply stale values. Issued at submission (default), held back by a plan and a credit
    window (the launch stream, after the ready event)."""
    _init(rank, world, port)
    ref = _train(None, dict(bucket_cap_mb=1), rank, steps=4, net=SlowBackward)
    for config in (commsched.Config(),
                   commsched.Config(partition_bytes=64 << 10, credit_bytes=256 << 10,
                                    profile_iters=1)):
        got = _train(config, dict(bucket_cap_mb=1), rank, steps=4, net=SlowBackward)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (config, (a - b).abs().max().item())
    dist.destroy_process_group()


class _DelayAt(torch.autograd.Function):
    """Identity whose backward keeps the stream busy for ``cycles`` first (read when the
    backward runs): where in backward the device lags the host."""

    @staticmethod
    def forward(ctx, x, delays, index):
        ctx.delays, ctx.index = delays, index
        return x

    @staticmethod
    def backward(ctx, grad):
        cycles = ctx.delays[ctx.index]
        if cycles:
            torch.cuda._sleep(cycles)
        return grad, None, None


class ShiftingDelays(Net):
    """Each layer's gradients are produced after a device sleep whose length per layer the
    test changes between steps (``delays``, cycles per layer)."""

    def __init__(self):
        super().__init__()
        self.delays = [0] * len(self.layers)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(_DelayAt.apply(x, self.delays, i))
        return x


def _train_shifting(rank, wrapped: bool, steps=10):
    """Profiled with the device lagging at the last layers (steps 0-1, the plan's profile),
    trained on with it lagging at the first layers: the plan's order (from the device times
    of the first pattern) meets producers ready in another order."""
    torch.manual_seed(0)
    net = ShiftingDelays().cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model = DDP(net, device_ids=[rank], bucket_cap_mb=1) if not wrapped else None
    if wrapped:
        model, opt = commsched.wrap(net, opt, commsched.Config(), group_bytes=0)
    n = len(net.layers)
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(rank)
    for step in range(steps):
        late = range(n - 3, n) if step < 4 else range(3)
        net.delays[:] = [4_000_000 if i in late else 0 for i in range(n)]
        loss = model(torch.randn(32, 512, device=device, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if wrapped:
        commsched.drain(model)
        engine = model._engine
        lane = engine.scheduler._lanes[engine.reduce_group]
        assert lane.order.cuda and lane.order.plan is not None     # planned from the device
    params = [p.detach().clone() for p in net.parameters()]
    if wrapped:
        model.close()
    return params


def _device_plan_vs_stock_ddp(rank, world, port):
    """The data-parallel mode's default plan, built from device times, when producers are
    ready on the device in another order than it was profiled with: results equal stock
    DDP's (each collective waits in the stream for its own producers)."""
    _init(rank, world, port)
    ref = _train_shifting(rank, wrapped=False)
    got = _train_shifting(rank, wrapped=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max().item()
    dist.destroy_process_group()


def _dropped_model_frees_its_memory(rank, world, port):
    """What wrap() returned, dropped after training: the GPU memory allocated returns to
    its level before the model was built (weights, gradient buffers, optimizer state).
    Measured on a second model: the first one leaves what is allocated once per process
    (library workspaces), which is no model's."""
    import gc
    _init(rank, world, port)
    for decompose in ("none", "rs_ag"):
        for measured in (False, True):
            torch.cuda.synchronize()
            gc.collect()
            before = torch.cuda.memory_allocated()
            net = Net().cuda()
            model, opt = commsched.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3),
                                        commsched.Config(decompose=decompose))
            _steps(model, opt, rank, 4)
            commsched.drain(model)
            assert torch.cuda.memory_allocated() > before
            del model, opt, net
            gc.collect()
            torch.cuda.synchronize()
            if measured:
                assert torch.cuda.memory_allocated() == before, (
                    decompose, before, torch.cuda.memory_allocated())
    dist.destroy_process_group()


class PartlyUsed(Net):
    """A layer that only rank 0 uses: every iteration, rank 1 reduces usage flags that are
    not all set (copied from host memory to the device, in both variants of the mode)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(512, 512)

    def forward(self, x):
        if dist.get_rank() == 0:
            x = self.extra(x)
        return self.layers(x)


def _train_partly_used(rank, decompose=None, steps=6):
    torch.manual_seed(0)
    model = PartlyUsed().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if decompose is None:
        model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    else:
        model, opt = commsched.wrap(model, opt, commsched.Config(decompose=decompose),
                                    group_bytes=0)
    _steps(model, opt, rank, steps)
    if decompose is not None:
        commsched.drain(model)
    params = [p.detach().clone() for p in model.parameters()]
    if decompose is not None:
        model.close()
    return params


def _unused_vs_stock_ddp(rank, world, port):
    _init(rank, world, port)
    ref = _train_partly_used(rank)
    for decompose in ("none", "rs_ag"):
        got = _train_partly_used(rank, decompose)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (decompose, (a - b).abs().max().item())
    dist.destroy_process_group()


class _TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(4096, 64, padding_idx=0)
        self.blocks = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 4096, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def _train_lm(tied, rank, config=None, steps=5):
    torch.manual_seed(0)
    net = _TinyLM(tied).cuda()
    if config is None:
        model = DDP(net, device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    else:
        model, opt = commsched.wrap(net, torch.optim.SGD(net.parameters(), lr=0.5,
                                                         momentum=0.9), config)
    gen = torch.Generator(device="cuda").manual_seed(10 + rank)
    for _ in range(steps):
        ids = torch.randint(0, 4096, (4, 256), device="cuda", generator=gen)
        ids[:, 0] = 0                           # padding tokens
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    if config is not None:
        commsched.drain(model)
        rows = len(model._engine.sparse_groups)
        model.close()
    else:
        rows = None
    return [p.detach().clone() for p in net.parameters()], rows


def _rows_vs_stock_ddp(rank, world, port):
    """Embedding gradients as rows (all-gathers, index_add_ on the device) against stock
    DDP: the same sums in another order (CUDA's index_add_ adds rows atomically), so
    within float32 rounding."""
    _init(rank, world, port)
    for tied in (False, True):
        ref, _ = _train_lm(tied, rank)
        got, rows = _train_lm(tied, rank, commsched.Config(sparse_embedding_rows=4096,
                                                           group_bytes=0))
        assert rows == 1, rows
        for a, b in zip(got, ref):
            err = ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
            assert err <= 1e-5, (tied, err)
    dist.destroy_process_group()


def _bf16_vs_ddp_bf16_hook(rank, world, port):
    """bfloat16 all-reduces (COMMSCHED_GRAD_REDUCE_DTYPE) against DDP under PyTorch's
    bf16_compress_hook: on 2 ranks each element is one rounding of a / 2 + b / 2 either way
    (NCCL's average of two values rounds its sum once; halving is exact), so the trained
    parameters are equal. With the producers delayed (SlowBackward) the cast must still
    follow them in the stream."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    _init(rank, world, port)
    for net in (Net, SlowBackward):
        torch.manual_seed(0)
        ddp = DDP(net().cuda(), device_ids=[rank], bucket_cap_mb=1)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        _steps(ddp, opt, rank, 6)
        ref = [p.detach().clone() for p in ddp.parameters()]
        plain = _train(None, dict(bucket_cap_mb=1), rank, net=net)
        for group_bytes in (None, 0):
            torch.manual_seed(0)
            model = net().cuda()
            model, opt = commsched.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                        commsched.Config(grad_reduce_dtype="bfloat16"),
                                        group_bytes=group_bytes)
            _steps(model, opt, rank, 6)
            commsched.drain(model)
            got = [p.detach().clone() for p in model.parameters()]
            model.close()
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (net.__name__, group_bytes,
                                           (a - b).abs().max().item())
            assert any(not torch.equal(a, b) for a, b in zip(got, plain)), net.__name__
    dist.destroy_process_group()


def _spawn(fn, timeout=300):
    ctx = mp.start_processes(fn, args=(2, free_port()), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(fn.__name__)


def test_scheduler_equals_plain_nccl_all_reduce():
    _spawn(_scheduler_vs_plain)


def test_synchronous_requests_equal_plain_nccl_all_reduce():
    _spawn(_synchronous_requests)


def test_future_resolves_after_device_completion():
    _spawn(_credit_returns_on_device_completion)


def test_lazy_completion_batches_and_device_times():
    _spawn(_lazy_completion)


def test_caller_completes_batches_and_the_watchdog_hands_over_the_rest():
    _spawn(_polled_completion)


def test_telemetry_flush_is_where_the_device_ended_backward():
    _spawn(_device_flush)


def test_hook_equals_stock_ddp_nccl():
    _spawn(_hook_vs_stock_ddp)


def test_hook_with_delayed_gradient_producers_equals_stock_ddp_nccl():
    _spawn(_delayed_producers_vs_stock_ddp)


def test_data_parallel_mode_equals_stock_ddp_nccl():
    _spawn(_wrap_vs_stock_ddp)


def test_a_plan_from_device_times_with_producers_ready_in_another_order_equals_stock_ddp():
    _spawn(_device_plan_vs_stock_ddp)


def test_a_dropped_data_parallel_model_frees_its_gpu_memory():
    _spawn(_dropped_model_frees_its_memory)


def test_data_parallel_mode_with_a_parameter_unused_on_one_rank_equals_stock_ddp_nccl():
    _spawn(_unused_vs_stock_ddp)


def test_embedding_rows_equal_stock_ddp_nccl_within_rounding():
    _spawn(_rows_vs_stock_ddp)


def test_bf16_all_reduces_equal_ddp_with_its_bf16_hook_nccl():
    _spawn(_bf16_vs_ddp_bf16_hook)
