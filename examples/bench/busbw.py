"""Bus bandwidth of one all-reduce per message size, plain and through commsched's
decompositions, printed in the nccl-tests (``all_reduce_perf``) format.

    python examples/bench/busbw.py --world-size 2 --regime nvlink --out busbw_nvlink.json
    python examples/bench/busbw.py --world-size 8 --local-size 4 --max-bytes 1G \\
        --variants nccl,hier,leader --telemetry-root runs/busbw --out busbw_w8.json
    python examples/bench/busbw.py --world-size 4 --local-size 2 --max-bytes 64K --cpu
    python -m commsched report runs/busbw/nvlink_hier_w8      # telemetry of one variant

The script spawns ``--world-size`` workers itself (NCCL, one GPU each, when CUDA has a GPU
for every worker; else gloo on CPU, which is only a smoke test), sets the regime's NCCL
environment before the process group starts (as harness.py does; ``NCCL_NVLS_ENABLE=0``
always), and runs each variant over every message size from ``--min-bytes`` to
``--max-bytes``, multiplying by ``--factor``:

  nccl     plain ``dist.all_reduce``: the reference (named after nccl-tests; on CPU it is
           gloo's all-reduce)
  nccl_async  plain ``dist.all_reduce(async_op=True)``, the ``--iters`` operations issued
           back to back, then each waited for: what DDP's default hook issues. An
           asynchronous collective runs on the process group's stream, which waits for the
           caller's; a synchronous one (``nccl``) may skip that. The commsched variants are
           asynchronous: this is the reference with their stream semantics.
  pg       the process group's own ``allreduce`` method (what commsched calls;
           ``dist.all_reduce`` adds argument checks and wrappers around it), issued back to
           back, each work waited for after the window
  pg_sync  the same with ``AllreduceOptions.asyncOp = False``: synchronous, on NCCL run on
           the caller's stream with no work returned (the cheapest issue there is)
  pg_sync_deep  ``pg_sync`` issued ``DEEP_FRAMES`` Python frames further down the stack,
           as deep as commsched's synchronous path calls the process group: what the
           stack's depth costs a collective (NCCL's flight recorder captures the Python
           stack of every collective it records)
  none     commsched ``Scheduler``, one all_reduce per message
  none_sync  the same, each submitted with ``async_op=False`` (the caller waits at once):
           issued from ``submit``, on NCCL it runs on the caller's stream, as ``nccl``
           does; the first of each window, which begins the lane's iteration, goes
           asynchronously
  rs_ag    commsched: reduce_scatter + all_gather
  hier     commsched: intra-node reduce_scatter, inter-node all_reduce, intra-node all_gather
  leader   commsched: reduce to the node leader, all_reduce among leaders, broadcast
  auto     commsched: per size none, unless hier or leader timed more than 20% faster,
           once when the lane starts (commsched/calibrate.py); the summary names the
           one it ran

A commsched variant runs ``Config.from_env()`` with ``enabled=True, decompose=<variant>,
partition_bytes=0`` (one chunk per message), ``credit_bytes=0``, ``policy="fifo"`` (one
request per iteration has nothing to plan, and a plan would add its exchange to the
collective sequence), ``autotune=False`` and ``local_size=--local-size`` when given: the
environment only contributes the knobs that observe (timeout, verify, NVTX, telemetry
sampling). The ``--iters`` timed messages of a size are one scheduler iteration: that many
``submit`` calls back to back, ``end_iteration``, then ``join`` (the caller's stream
waits once for all of them, as the DDP hook does at the end of backward; so, as in
nccl-tests, operations queue behind each other instead of each waiting for the last).

Per size: each variant's ``--warmup`` untimed operations, then ``--repeats`` windows
(default 1) of each variant, every window ``--iters`` operations back to back between
device synchronizations, in place on a float32 buffer of zeros (the contents do not
change a collective's speed, and zeros summed in place cannot overflow). The variants'
windows are interleaved, their order reversed every other window: the host's speed on
these machines moves by tens of percent from one second to the next, and a variant timed
in one stretch would be timed in whatever state the machine was in then. With
``--telemetry-root`` each variant instead runs its sweep alone (its telemetry's NVLink
samples must be its own traffic). Time per operation is the median window's total over
``--iters``, averaged over ranks as nccl-tests does. With ``--rounds R`` the sweep runs R
times, the variants' order reversed every other round, and per size the median over rounds
counts. Compare variants with ``--repeats`` >= 9 or ``--rounds`` >= 3. Columns as nccl-tests:
algbw = size / time, busbw = algbw * 2(n-1)/n (printed with 2 decimals, and 3 significant
digits below 1 GB/s; the JSON has every digit). Then ``#wrong``: one more operation on an
input of small rank-dependent integers (exact sums in float32) is compared element by
element with a plain ``dist.all_reduce`` of the same input (for ``nccl``: with the sum
computed locally); mismatches summed over ranks. On GPUs with NVML, each rank also reads
its NVLink DATA TX counter (summed over links) just before and after each timed window: the
JSON's ``nvlink_tx_bytes_per_op`` (mean over ranks) and ``nvlink_tx_per_payload``, and a
table of the latter (the counter counts KiB: read it for sizes well above that).

With ``--telemetry-root DIR`` each commsched variant records to
``DIR/<regime>_<variant>_w<N>``, the recorder open only while that variant runs. Per size
there are three lane iterations and telemetry steps (each marked once its ops finished on
the device): warm-up, timed, check; the JSON row's ``lane_iterations`` [a, b) is the timed
one (``commsched report DIR/... --iterations a:b``), whose NVLink bytes divided by
``--iters`` are one operation's. Telemetry costs time of its own: time variants without it,
count NVLink bytes with it.

Output: a progress line per variant, then markdown last on stdout: one table per variant
in the nccl-tests columns and a summary of busbw per size, variants side by side. JSON
(``--out``) with every number, the system, the environment, world and local size, regime.
The exit status is 1 when a worker crashed or hung (``--timeout`` bounds the command) or a
result was wrong, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import benchlib  # first: puts the checkout on sys.path
from benchlib import close_quietly
from commsched.config import parse_bytes

import torch
import torch.distributed as dist

# The regimes are harness.py's, so that the two scripts measure the same environments.
from harness import REGIMES, apply_regime_env

DTYPE = torch.float32
ELEMENT_BYTES = 4

# name -> label (table headings); run order is the order given by --variants.
VARIANTS: Dict[str, str] = {
    "nccl": "plain dist.all_reduce (reference)",
    "nccl_async": "plain dist.all_reduce(async_op=True), waited after the window",
    "pg": "the process group's allreduce method, waited after the window",
    "pg_sync": "the process group's allreduce method, asyncOp=False",
    "pg_sync_deep": "pg_sync from a deeper Python stack (commsched's depth)",
    "none": "commsched Scheduler, all_reduce",
    "none_sync": "commsched Scheduler, all_reduce with async_op=False",
    "rs_ag": "commsched, reduce_scatter + all_gather",
    "hier": "commsched, reduce_scatter:intra + all_reduce:inter + all_gather:intra",
    "leader": "commsched, reduce:intra + all_reduce:leaders + broadcast:intra",
    "auto": "commsched, per size the fastest of none/hier/leader as measured at start",
}
DEFAULT_VARIANTS = "nccl,none,rs_ag,hier,leader,auto"
REFERENCE = "nccl"
PLAIN = ("nccl", "nccl_async", "pg", "pg_sync", "pg_sync_deep")  # without commsched
# Python frames between Scheduler.submit and the process group's call on commsched's
# synchronous path, less the one between the loop and the call in pg_sync
DEEP_FRAMES = 4
SYNC_OF = {"none_sync": "none"}             # async_op=False variants: their decomposition


# ---------------------------------------------------------------------------------------
# Sizes: commsched's byte counts (K, M, G are powers of 1024, as nccl-tests' -b/-e read)
# ---------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"128"``, ``"64K"``, ``"32M"``, ``"1G"`` (or KiB/MiB/GiB) in bytes, at least 1."""
    try:
        size = parse_bytes(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a message size of at least 1 byte")
    return size


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    """``min_bytes``, then times ``factor`` while at most ``max_bytes``."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------
# The operations measured (inside each worker)
# ---------------------------------------------------------------------------------------

class PlainAllReduce:
    """``dist.all_reduce`` in place, the reference (nccl-tests' all_reduce_perf in place)."""

    __slots__ = ()

    def __call__(self, tensor: torch.Tensor, count: int = 1) -> None:
        for _ in range(count):
            dist.all_reduce(tensor)

    def iterations(self) -> Optional[int]:
        return None

    def close(self) -> None:
        pass


class QueuedAllReduce(PlainAllReduce):
    """``count`` all-reduces in place, each issued by ``issue(tensor)`` back to back, then
    each returned work waited for (the caller's stream waits for it on the device, as
    ``CommschedAllReduce`` waits for its requests); ``issue`` may return no work (a
    synchronous call)."""

    __slots__ = ("issue", "works")

    def __init__(self, issue: Callable[[torch.Tensor], Any]) -> None:
        self.issue = issue
        self.works: List[Any] = []

    def __call__(self, tensor: torch.Tensor, count: int = 1) -> None:
        issue, works = self.issue, self.works
        for _ in range(count):
            work = issue(tensor)
            if work is not None:
                works.append(work)
        for work in works:
            work.wait()
        works.clear()


def group_all_reduce(synchronous: bool = False, depth: int = 0) -> QueuedAllReduce:
    """The process group's own ``allreduce`` method; ``synchronous``: with ``asyncOp =
    False`` (NCCL then runs the collective on the caller's stream and returns no work);
    ``depth``: called that many Python frames further down the stack."""
    options = dist.AllreduceOptions()
    if synchronous:
        options.asyncOp = False
    issue = lambda tensor: dist.group.WORLD.allreduce([tensor], options)  # noqa: E731
    for _ in range(depth):
        issue = _one_frame_above(issue)
    return QueuedAllReduce(issue)


def _one_frame_above(issue: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``issue``, called from one more Python frame."""
    def call(tensor: torch.Tensor):
        return issue(tensor)
    return call


PLAIN_OPS: Dict[str, Callable[[], Any]] = {
    "nccl": PlainAllReduce,
    "nccl_async": lambda: QueuedAllReduce(lambda t: dist.all_reduce(t, async_op=True)),
    "pg": group_all_reduce, "pg_sync": lambda: group_all_reduce(synchronous=True),
    "pg_sync_deep": lambda: group_all_reduce(synchronous=True, depth=DEEP_FRAMES)}


class CommschedAllReduce:
    """``count`` all-reduces of ``tensor`` as one commsched scheduler iteration: ``count``
    requests submitted back to back (the scheduler issues them in order on its stream, as
    nccl-tests issues its operations), the iteration ended, and the caller ordered after
    all of them at once (``Scheduler.join``).
    ``recorder`` is the variant's telemetry (None without it); with it, each call also
    waits for the device and marks a telemetry step. ``async_op``: passed to every
    ``submit``.

    Example::
        op = CommschedAllReduce(Config(enabled=True, decompose="rs_ag", partition_bytes=0),
                                torch.device("cpu"))
        op(tensor, 20); op.close()
    """

    __slots__ = ("scheduler", "recorder", "requests", "ran", "async_op")

    def __init__(self, config, device: torch.device, async_op: bool = True):
        benchlib.import_commsched()
        from commsched.adapter import build_scheduler

        self.scheduler, self.recorder = build_scheduler(config, device)
        self.requests: List[Any] = []
        self.ran: Optional[str] = None      # the decomposition the last call ran
        self.async_op = async_op

    def __call__(self, tensor: torch.Tensor, count: int = 1) -> None:
        requests = self.requests
        submit, async_op = self.scheduler.submit, self.async_op
        for k in range(count):
            requests.append(submit(tensor, key=k, async_op=async_op))
        self.scheduler.end_iteration()
        # (one wait for all of them, as the DDP hook at the end of backward: NCCL runs a
        # group's collectives in issue order)
        self.scheduler.join()
        self.ran = requests[-1].decompose
        requests.clear()
        if self.recorder is not None:
            # A telemetry step per call, placed once its ops finished on the device (on
            # CUDA wait() only orders streams): report's iteration k is call k, and the
            # NVLink samples requested at the steps split the link bytes at call boundaries.
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
            self.recorder.step()

    def iterations(self) -> int:
        """Lane iterations so far (each call is one)."""
        return self.scheduler.stats()["iterations"]

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Wait for outstanding chunks, stop the scheduler, then close the recorder."""
        from commsched.adapter import close
        close(self.scheduler, self.recorder, timeout)


def variant_config(spec: "LaunchSpec", name: str):
    """The commsched Config of variant ``name`` (None for a plain variant)."""
    if name in PLAIN:
        return None
    changes = dict(enabled=True, decompose=SYNC_OF.get(name, name), partition_bytes=0,
                   credit_bytes=0, policy="fifo", autotune=False,
                   telemetry_dir=telemetry_dir(spec, name))
    if spec.local_size is not None:
        changes["local_size"] = spec.local_size
    return spec.base_config.replace(**changes)


def telemetry_dir(spec: "LaunchSpec", name: str) -> Optional[str]:
    if spec.telemetry_root is None or name in PLAIN:
        return None
    return str(Path(spec.telemetry_root) / f"{spec.regime}_{name}_w{spec.world_size}")


def check_input(rank: int, count: int, device: torch.device) -> torch.Tensor:
    """Small rank-dependent integers in [-8, 8]: every sum over ranks is exact in float32."""
    i = torch.arange(count, device=device)
    return ((i * 7 + (rank + 1) * 13) % 17 - 8).to(DTYPE)


def expected_sum(world_size: int, count: int, device: torch.device) -> torch.Tensor:
    """The all-reduced check input, computed locally."""
    total = torch.zeros(count, dtype=DTYPE, device=device)
    for rank in range(world_size):
        total += check_input(rank, count, device)
    return total


class LinkCounter:
    """This rank's GPU's NVLink DATA TX counter (NVML field 138, summed over links, KiB),
    read just before and just after a timed window, outside it: the link bytes the rank
    sent for the window's operations. ``None`` readings where NVML or NVLink is absent."""

    def __init__(self, device: torch.device):
        self.backend = self.gpu = None
        self.status = "cpu"
        if device.type != "cuda":
            return
        from commsched.telemetry.nvml import (GpuSelector, NvmlUnavailable, PynvmlBackend,
                                              resolve_gpu)
        try:
            backend = PynvmlBackend()
            backend.init()
            uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
            self.gpu = resolve_gpu(backend, GpuSelector(device.index, uuid or None))
            self.backend, self.status = backend, "ok"
        except NvmlUnavailable as exc:
            self.status = exc.status

    def read(self) -> Optional[int]:
        """Bytes sent over all NVLinks so far, or None."""
        if self.backend is None:
            return None
        from commsched.telemetry.nvml import FIELD, SCOPE_ALL_LINKS
        [kib] = self.backend.read_fields(self.gpu.index, [(FIELD["data_tx"], SCOPE_ALL_LINKS)])
        return None if kib is None else kib * 1024

    def close(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None


@dataclass(frozen=True)
class LaunchSpec:
    """What the parent tells the workers (picklable)."""

    world_size: int
    local_size: Optional[int]
    regime: str
    backend: str
    sizes: Tuple[int, ...]
    warmup: int
    iters: int
    repeats: int
    rounds: int
    variants: Tuple[str, ...]
    telemetry_root: Optional[str]
    base_config: Any                 # commsched.Config, parsed once in the parent
    port: int
    collective_timeout_s: float
    result_path: str


class Worker:
    """Per-worker context: rank, device, backend, and the timing loop."""

    def __init__(self, rank: int, spec: LaunchSpec):
        self.rank = rank
        self.spec = spec
        self.cuda = spec.backend == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.links = LinkCounter(self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def fence(self) -> None:
        """Every rank's device idle, then every rank here."""
        self.sync()
        benchlib.barrier(self.spec.backend)
        self.sync()

    def measure(self, ops: Dict[str, Any], nbytes: int) -> Dict[str, Dict[str, Any]]:
        """One row per variant in ``ops`` (name -> operation) at ``nbytes``: each warmed
        up, then ``repeats`` timed windows of each, the variants' windows interleaved
        (their order reversed every other window), so that they share whatever state the
        machine is in while this size runs."""
        spec = self.spec
        count = nbytes // ELEMENT_BYTES
        buffer = torch.zeros(count, dtype=DTYPE, device=self.device)
        names = list(ops)
        for op in ops.values():
            if spec.warmup:
                op(buffer, spec.warmup)
        self.fence()
        first = {name: op.iterations() for name, op in ops.items()}
        windows: Dict[str, List[float]] = {name: [] for name in names}
        sent: Dict[str, Optional[int]] = dict.fromkeys(names, 0)
        for window in range(spec.repeats):
            for name in names if window % 2 == 0 else reversed(names):
                tx_before = self.links.read()
                start = time.perf_counter()
                ops[name](buffer, spec.iters)
                self.sync()
                windows[name].append((time.perf_counter() - start) / spec.iters)
                tx_after = self.links.read()
                if tx_before is None or tx_after is None or sent[name] is None:
                    sent[name] = None
                else:
                    sent[name] += tx_after - tx_before
                self.fence()
        last = {name: op.iterations() for name, op in ops.items()}
        del buffer
        return {name: self.row(name, ops[name], nbytes, windows[name], sent[name],
                               first[name], last[name]) for name in names}

    def row(self, name: str, op: Callable[[torch.Tensor], None], nbytes: int,
            windows: List[float], sent: Optional[int], first: Optional[int],
            last: Optional[int]) -> Dict[str, Any]:
        """The row of variant ``name`` from its timed windows (seconds per operation) and
        NVLink bytes sent in them (None: not counted); checks one more operation."""
        spec, world = self.spec, self.spec.world_size
        count = nbytes // ELEMENT_BYTES
        # (the median window: one slow window, a hiccup of the machine, does not move it)
        seconds = statistics.median(windows)
        data = check_input(self.rank, count, self.device)
        reference = data.clone()
        dist.all_reduce(reference)
        if name == REFERENCE:
            wrong = (reference != expected_sum(world, count, self.device)).sum()
        else:
            op(data)
            wrong = (data != reference).sum()
        total = torch.tensor([seconds, float(wrong.item())], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(total)
        # NVLink bytes per operation, mean over ranks (-1: not measured on some rank).
        per_op = -1.0 if sent is None else sent / (spec.iters * spec.repeats)
        links = torch.tensor([per_op, per_op], dtype=torch.float64, device=self.device)
        dist.all_reduce(links)
        measured = torch.tensor([float(per_op < 0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        nvlink_tx = None if measured.item() else links[0].item() / world
        slowest = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds_mean = total[0].item() / world
        algbw = nbytes / seconds_mean / 1e9
        return {
            "variant": name, "size": nbytes, "count": count, "type": "float",
            "redop": "sum", "time_us": seconds_mean * 1e6,
            "time_us_windows_rank0": [t * 1e6 for t in windows] if self.rank == 0 else None,
            "time_us_max_rank": slowest[0].item() * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(world),
            "wrong": int(total[1].item()),
            "lane_iterations": None if first is None else [first, last],
            "ran": getattr(op, "ran", None),      # the decomposition run (auto: its choice)
            "nvlink_tx_bytes_per_op": nvlink_tx,  # mean over ranks; None without NVML
            "nvlink_tx_per_payload": None if nvlink_tx is None else nvlink_tx / nbytes,
        }


def gbps(value: Optional[float]) -> Optional[str]:
    """GB/s as nccl-tests prints it (2 decimals), with 3 significant digits below 1 GB/s so
    that small messages (and CPU runs) do not all read 0.00."""
    if value is None:
        return None
    if value >= 1 or value <= 0:
        return f"{value:.2f}"
    decimals = min(9, 2 - math.floor(math.log10(value)))     # 0.00610, 0.0000207
    return f"{value:.{decimals}f}"


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor, 2(n-1)/n."""
    return 2.0 * (world_size - 1) / world_size


def run_variants(worker: Worker, names: Tuple[str, ...]) -> Dict[str, Dict[str, Any]]:
    """Every message size through the variants ``names``, their windows interleaved per
    size (``Worker.measure``); telemetry (if any) is open only for the duration of this
    call. Each result's ``wall_s`` is the whole call's."""
    configs = {name: variant_config(worker.spec, name) for name in names}
    ops: Dict[str, Any] = {}
    started = time.monotonic()
    try:
        for name, config in configs.items():
            ops[name] = (CommschedAllReduce(config, worker.device, name not in SYNC_OF)
                         if config is not None
                         else PLAIN_OPS[name]())
        rows: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
        for nbytes in worker.spec.sizes:
            for name, row in worker.measure(ops, nbytes).items():
                rows[name].append(row)
    finally:
        for op in ops.values():
            close_quietly(op)
    wall_s = round(time.monotonic() - started, 2)
    return {name: {"name": name, "label": VARIANTS[name], "status": "ok", "error": None,
                   "config": None if config is None else dataclasses.asdict(config),
                   "telemetry_dir": None if config is None else config.telemetry_dir,
                   "wall_s": wall_s, "rows": rows[name]}
            for name, config in configs.items()}


def merge_round(merged: Optional[Dict[str, Any]], result: Dict[str, Any]) -> Dict[str, Any]:
    """``result``, one sweep of a variant over the sizes, added to the rounds before it:
    per size the time per operation (and the bandwidths from it) becomes the median over
    rounds, ``time_us_rounds`` lists each round's, ``wrong`` adds up; the rest (windows,
    NVLink bytes, lane iterations) stays the first round's."""
    if merged is None:
        for row in result["rows"]:
            row["time_us_rounds"] = [row["time_us"]]
            row["time_us_max_rank_rounds"] = [row["time_us_max_rank"]]
        result["rounds"] = 1
        return result
    for row, new in zip(merged["rows"], result["rows"]):
        row["time_us_rounds"].append(new["time_us"])
        row["time_us_max_rank_rounds"].append(new["time_us_max_rank"])
        row["time_us"] = statistics.median(row["time_us_rounds"])
        row["time_us_max_rank"] = statistics.median(row["time_us_max_rank_rounds"])
        factor = row["busbw_gbps"] / row["algbw_gbps"]      # 2(n-1)/n
        row["algbw_gbps"] = row["size"] / (row["time_us"] * 1e-6) / 1e9
        row["busbw_gbps"] = row["algbw_gbps"] * factor
        row["wrong"] += new["wrong"]
    merged["rounds"] += 1
    merged["wall_s"] = round(merged["wall_s"] + result["wall_s"], 2)
    return merged


def progress_line(spec: LaunchSpec, result: Dict[str, Any]) -> str:
    rows = result["rows"]
    largest = rows[-1]
    wrong = sum(r["wrong"] for r in rows)
    rounds = f" (round {result['rounds']}/{spec.rounds})" if spec.rounds > 1 else ""
    return (f"[busbw] {spec.regime} w{spec.world_size} {result['name']}{rounds}: "
            f"{len(rows)} sizes "
            f"{human_bytes(rows[0]['size'])}..{human_bytes(largest['size'])} in "
            f"{result['wall_s']:.1f} s; busbw {gbps(largest['busbw_gbps'])} GB/s at "
            f"{human_bytes(largest['size'])}; #wrong {wrong}"
            + ("" if result["telemetry_dir"] is None
               else f"; telemetry {result['telemetry_dir']}"))


def worker_main(rank: int, spec: LaunchSpec) -> None:
    """Entry point of each spawned worker: one process group, every variant in turn."""
    apply_regime_env(spec.regime)
    if spec.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    benchlib.init_process_group(rank, spec.world_size, spec.port, spec.backend,
                                spec.collective_timeout_s)
    worker = Worker(rank, spec)
    doc: Dict[str, Any] = {"env": benchlib.relevant_env(),
                           "system": benchlib.system_info() if rank == 0 else {},
                           "variants": {}}
    try:
        results: Dict[str, Dict[str, Any]] = {}
        for round_ in range(spec.rounds):
            order = spec.variants if round_ % 2 == 0 else spec.variants[::-1]
            # Interleaved, except where each commsched variant records telemetry: its
            # NVLink samples between two of its steps must be its own traffic.
            groups = [order] if spec.telemetry_root is None else [(name,) for name in order]
            for group in groups:
                for name, result in run_variants(worker, group).items():
                    result = results[name] = merge_round(results.get(name), result)
                    if rank == 0:
                        doc["variants"][name] = result
                        print(progress_line(spec, result), flush=True)
                if rank == 0:
                    benchlib.write_json(Path(spec.result_path), doc)
    finally:
        worker.links.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Parent: arguments, launch, tables
# ---------------------------------------------------------------------------------------

def variant_table(result: Dict[str, Any]) -> str:
    """One variant's rows in the nccl-tests columns."""
    headers = ["size (B)", "count (elements)", "type", "redop", "time (us)", "algbw (GB/s)",
               "busbw (GB/s)", "#wrong"]
    rows = [[r["size"], r["count"], r["type"], r["redop"], f"{r['time_us']:.2f}",
             gbps(r["algbw_gbps"]), gbps(r["busbw_gbps"]), r["wrong"]]
            for r in result["rows"]]
    return benchlib.markdown_table(headers, rows)


def summary_table(document: Dict[str, Any]) -> str:
    """busbw (GB/s) per size, one column per variant; last row the mean over sizes
    (nccl-tests' "Avg bus bandwidth")."""
    names = [n for n in document["settings"]["variants"]]
    by_variant = {n: {r["size"]: r for r in document["variants"][n]["rows"]} for n in names}
    headers = ["size (B)"] + [f"{n} busbw (GB/s)" for n in names]
    rows = []
    for size in document["settings"]["sizes"]:
        rows.append([size] + [_cell(by_variant[n].get(size), n) for n in names])
    averages = []
    for n in names:
        values = [r["busbw_gbps"] for r in by_variant[n].values()]
        averages.append(gbps(sum(values) / len(values)) if values else None)
    rows.append(["avg"] + averages)
    return benchlib.markdown_table(headers, rows)


def _cell(row: Optional[Dict[str, Any]], name: str) -> Optional[str]:
    if row is None:
        return None
    text = gbps(row["busbw_gbps"])
    return f"{text} ({row['ran']})" if name == "auto" and row.get("ran") else text


def nvlink_table(document: Dict[str, Any]) -> Optional[str]:
    """NVLink bytes each rank sent per operation, over the payload (None without NVML).
    A ring all-reduce sends 2(n-1)/n of the payload."""
    names = [n for n in document["settings"]["variants"]]
    by_variant = {n: {r["size"]: r for r in document["variants"][n]["rows"]} for n in names}
    if not any(r.get("nvlink_tx_per_payload") is not None
               for rows in by_variant.values() for r in rows.values()):
        return None
    headers = ["size (B)"] + [f"{n} TX/payload" for n in names]
    rows = [[size] + [None if by_variant[n].get(size, {}).get("nvlink_tx_per_payload") is None
                      else f"{by_variant[n][size]['nvlink_tx_per_payload']:.3f}"
                      for n in names]
            for size in document["settings"]["sizes"]]
    return benchlib.markdown_table(headers, rows)


def headline(document: Dict[str, Any]) -> str:
    s, system = document["settings"], document.get("system") or {}
    if s["backend"] == "nccl":
        where = (f"NCCL on {s['world_size']}x {system.get('gpu_name')}, driver "
                 f"{system.get('driver')}, CUDA {system.get('cuda')}, NCCL {system.get('nccl')}")
    else:
        where = (f"gloo on CPU ({system.get('cpu_count')} cores) - smoke run, not a "
                 f"benchmark")
    return (f"commsched busbw: {s['world_size']} ranks ({s['nodes']} node(s) of "
            f"{s['local_size_effective']}), regime {s['regime']}, {where}, torch "
            f"{system.get('torch')}; in-place float32 sum, warmup {s['warmup']}, "
            f"{s['iters']} timed ops per size")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, required=True,
                        help="workers to spawn (one GPU each under NCCL)")
    parser.add_argument("--regime", default="nvlink", choices=list(REGIMES),
                        help="NCCL environment, as in harness.py (default nvlink)")
    parser.add_argument("--local-size", type=int, default=None,
                        help="ranks per node for hier/leader (consecutive ranks); default: "
                             "LOCAL_WORLD_SIZE, else one node")
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("128"),
                        help="smallest message (default 128; K/M/G = 1024^n)")
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("32M"),
                        help="largest message (default 32M)")
    parser.add_argument("--factor", type=int, default=4,
                        help="size multiplier between messages (default 4)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed ops per size (5)")
    parser.add_argument("--iters", type=int, default=20, help="timed ops per size (20)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed windows of --iters ops per size; the median window "
                             "counts (default 1; 5 or more for numbers to compare)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="sweeps over every variant, alternating their order; per size "
                             "the median over rounds counts (default 1; 3 or more for "
                             "ratios, so that a drift of the machine during the launch "
                             "does not count against whichever variant ran then)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated subset of {','.join(VARIANTS)} or all "
                             f"(default {DEFAULT_VARIANTS})")
    parser.add_argument("--telemetry-root", default=None,
                        help="record each commsched variant's telemetry under "
                             "DIR/<regime>_<variant>_w<N>")
    parser.add_argument("--out", default="busbw.json", help="JSON output (busbw.json)")
    parser.add_argument("--cpu", action="store_true", help="force gloo on CPU")
    parser.add_argument("--timeout", type=float, default=540.0,
                        help="seconds for the whole command; hung workers are terminated "
                             "(default 540)")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="process-group timeout in seconds (default 120)")
    args = parser.parse_args(argv)

    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    if args.local_size is not None and (args.local_size < 1
                                        or args.world_size % args.local_size):
        parser.error(f"--local-size {args.local_size}: must be >= 1 and divide --world-size "
                     f"{args.world_size} (nodes are groups of --local-size consecutive ranks)")
    for flag, value in (("--min-bytes", args.min_bytes), ("--max-bytes", args.max_bytes)):
        if value < ELEMENT_BYTES or value % ELEMENT_BYTES:
            parser.error(f"{flag} {value}: must be a positive multiple of {ELEMENT_BYTES} "
                         f"bytes (float32 elements)")
    if args.max_bytes < args.min_bytes:
        parser.error(f"--max-bytes {args.max_bytes} is smaller than --min-bytes "
                     f"{args.min_bytes}")
    if args.factor < 2:
        parser.error(f"--factor {args.factor}: must be >= 2")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: must be >= 1")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if args.rounds > 1 and args.telemetry_root:
        parser.error("--rounds > 1 with --telemetry-root: each round would reopen the "
                     "variant's telemetry store; record telemetry in a launch of one round")
    if args.timeout <= 0 or args.collective_timeout <= 0:
        parser.error("--timeout and --collective-timeout must be > 0")
    names = list(VARIANTS) if args.variants.strip() == "all" else [
        v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        parser.error(f"--variants {args.variants!r}: unknown {unknown}; choose from "
                     f"{', '.join(VARIANTS)}, all")
    args.variants = tuple(dict.fromkeys(names))
    args.sizes = tuple(message_sizes(args.min_bytes, args.max_bytes, args.factor))

    # commsched's Config is parsed once, here; a bad COMMSCHED_* variable is an argument
    # error, not a crash in every worker.
    args.base_config = None
    if any(v not in PLAIN for v in args.variants):
        try:
            commsched = benchlib.import_commsched()
            from commsched.topology import local_size_from_env
            args.base_config = commsched.Config.from_env()
        except Exception as exc:  # noqa: BLE001 - ModeUnavailable or ConfigError
            parser.error(f"--variants {','.join(args.variants)} need commsched: {exc}")
        configured = args.local_size or args.base_config.local_size
        args.local_size_effective = local_size_from_env(configured, args.world_size)
        if args.world_size % args.local_size_effective:
            parser.error(f"local size {args.local_size_effective} (from LOCAL_WORLD_SIZE) "
                         f"does not divide --world-size "
                         f"{args.world_size}; pass --local-size")
    else:
        args.local_size_effective = args.local_size or args.world_size
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.timeout
    backend = benchlib.choose_backend(args.cpu, args.world_size)
    if backend == "gloo":
        print(f"[busbw] fewer than {args.world_size} GPUs (or --cpu): gloo on CPU; numbers "
              f"are not a benchmark", flush=True)
    document: Dict[str, Any] = {
        "schema": "commsched.bench.busbw/1",
        "created_utc": benchlib.utc_now(),
        "command": [sys.executable, *sys.argv],
        "settings": {
            "world_size": args.world_size, "local_size": args.local_size,
            "local_size_effective": args.local_size_effective,
            "nodes": args.world_size // args.local_size_effective,
            "regime": args.regime, "backend": backend,
            "device": "cuda" if backend == "nccl" else "cpu",
            "dtype": "float32", "redop": "sum", "in_place": True,
            "min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "factor": args.factor,
            "sizes": list(args.sizes), "warmup": args.warmup, "iters": args.iters,
            "repeats": args.repeats, "rounds": args.rounds,
            "variants": list(args.variants), "telemetry_root": args.telemetry_root,
            "timeout_s": args.timeout, "collective_timeout_s": args.collective_timeout,
            "time_definition": "per op: the median window's timed total / iters, mean "
                               "over ranks (slowest rank: time_us_max_rank); with rounds, "
                               "the median over rounds (time_us_rounds)",
            "bus_factor": bus_factor(args.world_size),
        },
        "parent_env": benchlib.relevant_env(),
        "system": {}, "env": {},
        "status": "ok", "error": None, "wall_s": None,
        "variants": {},
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="commsched-busbw-") as tmp:
        spec = LaunchSpec(args.world_size, args.local_size, args.regime, backend, args.sizes,
                          args.warmup, args.iters, args.repeats, args.rounds, args.variants,
                          args.telemetry_root,
                          args.base_config, benchlib.free_port(),
                          min(args.collective_timeout, args.timeout), str(Path(tmp) / "w.json"))
        print(f"[busbw] spawning {args.world_size} workers ({backend}), regime "
              f"{args.regime}, {len(args.sizes)} sizes {human_bytes(args.sizes[0])}.."
              f"{human_bytes(args.sizes[-1])}, variants {','.join(args.variants)}", flush=True)
        outcome = benchlib.launch(worker_main, (spec,), args.world_size,
                                  max(1.0, deadline - time.monotonic()))
        path = Path(spec.result_path)
        partial = json.loads(path.read_text()) if path.exists() else {}
    document["status"] = "ok" if outcome.ok else "error"
    document["error"] = outcome.error
    document["wall_s"] = round(outcome.wall_s, 1)
    document["system"] = partial.get("system") or benchlib.system_info()
    document["env"] = partial.get("env", {})
    for name in args.variants:
        result = partial.get("variants", {}).get(name) or {
            "name": name, "label": VARIANTS[name], "status": "error",
            "error": f"not run: {outcome.error or 'worker ended early'}", "config": None,
            "telemetry_dir": None, "wall_s": None, "rows": []}
        document["variants"][name] = result
        document["rows"] += result["rows"]
    benchlib.write_json(Path(args.out), document)

    wrong = sum(r["wrong"] for r in document["rows"])
    failed = [n for n, v in document["variants"].items() if v["status"] != "ok"]
    print(f"[busbw] wrote {args.out}"
          + ("" if outcome.ok else f"; launch failed: {outcome.error}")
          + (f"; not measured: {', '.join(failed)}" if failed else "")
          + (f"; {wrong} WRONG elements" if wrong else ""), flush=True)
    print("", flush=True)
    print(headline(document), flush=True)
    for name, result in document["variants"].items():
        if result["rows"]:
            print(f"\n### {name}: {result['label']}\n", flush=True)
            print(variant_table(result), flush=True)
    links = nvlink_table(document)
    if links:
        print("\n### NVLink bytes sent per operation / payload (mean over ranks; a ring "
              "all-reduce sends 2(n-1)/n)\n", flush=True)
        print(links, flush=True)
    print("\n### busbw (GB/s) per size\n", flush=True)
    print(summary_table(document), flush=True)
    return 0 if outcome.ok and not failed and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
