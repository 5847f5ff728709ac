"""commsched benchmark harness: iteration time of one model under every communication mode,
in one launch per network regime, following the project's benchmark protocol.

    python examples/bench/harness.py --model gpt --regime nvlink --out gpt_nvlink.json

For each regime the harness spawns its own workers (``--world-size``, default 2, 1 allowed; NCCL on
GPUs when CUDA has a GPU per worker, else gloo on CPU, which is only meant for the smoke
test), sets the regime's NCCL
environment before the process group starts, and for each model runs every mode of
``MODES`` in turn, rebuilding the model from the same seed for each (same weights, and
peak memory per mode). A mode that is not implemented yet is reported "n/a" with the reason;
a mode that fails (out of memory, an exception) is reported "error" and the run goes on.

Output: a JSON document (``--out``) with the system, the environment, per-mode statistics
and per-iteration times, and a markdown table printed last on stdout. The exit status is 0
when every mode ran or was n/a, 1 when a mode failed or a worker crashed or hung.

Modes: the protocol's canonical set (``MODES``: the plain loop without DDP or commsched,
compute only, comm only and the floor in
float32 and bfloat16, DDP and DDP + ``bf16_compress_hook``, the commsched hook with and
without telemetry, the data-parallel mode in float32, bfloat16 and rs_ag). Any other
setting is a variant of a commsched mode, not a mode of its own: ``--modes
commsched_dp@groups_in_flight=2`` runs that mode with those ``Config`` fields (values
written as their variables would be: ``4MiB``, ``1``, ``fifo``), and ``--set FIELD=VALUE``
gives every commsched mode of the launch that field.

Measurement options:

* ``--rounds R`` runs the selected modes R times, interleaved, every other round in
  reverse order (A B, B A, A B, ...), and pools each mode's samples: slow drift of the
  machine (clocks, host load) then falls on every mode alike, which is what a comparison
  of two close modes (telemetry on and off) needs.
* ``--telemetry-root DIR`` keeps the telemetry of every mode that records it in
  ``DIR/<regime>_w<world size>_<mode>`` (``commsched report`` / ``commsched.sim.validate``
  read them), each with the run's compute only and comm only as ``floor.json`` (the
  report's efficiency column); without it they go to temporary directories.

The floor is max(compute only, comm only) and a mode's efficiency floor / its time, both
from ``commsched.floor.floor_efficiency``, as ``commsched floor`` computes them.
* ``BENCH_SPLIT=1``: after a mode's timed windows, one more window of ``BENCH_WINDOW``
  steps recorded by ``commsched.telemetry.window.ProfiledWindow`` (CUDA only); every mode
  after compute only gets its step above compute only split by cause (``"split"``,
  ``"split_verdict"``: ``commsched.telemetry.step_split``), as ``commsched floor`` splits
  the hook's: the parts add up to the mode's timed median above compute only's (the
  round that recorded compute only's window), the device parts read from the windows
  (``window_above_ms``: the windows' own difference).
* ``--sweep 1M/4M,4M/16M,...`` adds one mode per PARTITION/CREDIT pair (bytes as the
  settings read them, ``commsched.config.parse_bytes``: K/M/G are powers of 1024; 0 = no
  partitioning / unbounded credit): the commsched hook with that setting and telemetry on:
  the runs the simulator is validated on.
* ``--dp-sweep 0/0,32M/128M,0/0/128M,0/0/256M/16M,...`` adds one mode per PARTITION/CREDIT
  pair (or PARTITION/CREDIT/GROUP triple, GROUP the layer-group size, or with /FIRST, the
  first layer group's size) of the data-parallel mode
  (``commsched.wrap``), telemetry off: its settings compared within one launch, interleaved
  with ``--rounds``, rather than across launches. CREDIT 0 leaves the mode its window of
  ``COMMSCHED_GROUPS_IN_FLIGHT`` layer groups (default 0: none, the plan orders them).

Adding a mode is a function ``run_x(bench) -> {"iter_ms": [...], ...}`` plus one ``Mode``
line in ``MODES``, for a comparison the protocol needs in every run; raise
``ModeUnavailable(reason)`` when it cannot run here.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import gc
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import benchlib  # first: puts the checkout on sys.path
from benchlib import ModeUnavailable, close_quietly, fmt, summarize_ms
from commsched.config import parse_bytes

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import models

DEFAULT_WORLD_SIZE = 2
SEED = 1234
DDP_BUCKET_CAP_MB = 25  # DDP's default cap; used by the bucket estimate, never passed to DDP

# ---------------------------------------------------------------------------------------
# Regimes: NCCL environment applied in each worker before the process group starts.
# ---------------------------------------------------------------------------------------

# value None = unset, so that a variable left in the caller's shell cannot leak into a
# regime that is defined by its absence.
REGIMES: Dict[str, Dict[str, Optional[str]]] = {
    "nvlink": {"NCCL_P2P_DISABLE": None, "NCCL_SHM_DISABLE": None},
    "host": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": None},
    "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
# NVLink multicast (NVLS) stays off on the benchmark machines.
ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0"}


def apply_regime_env(regime: str) -> None:
    for name, value in {**REGIMES[regime], **ALWAYS_ENV}.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ---------------------------------------------------------------------------------------
# Workloads: model, batch, loss and optimizer of each benchmarked model.
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One benchmarked model with its per-rank batch.

    ``items_per_rank`` counts tokens (GPT) or images (CNNs) one rank processes per step.
    """

    name: str
    unit: str
    items_per_rank: int
    shape: Dict[str, Any]
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.device, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str  # "adamw" | "sgd"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.strip().isdigit() or int(raw) < 1:
        raise SystemExit(f"{name}={raw!r}: expected a positive integer")
    return int(raw)


def gpt_workload(quick: bool) -> Workload:
    """GPT-like decoder, 24x1024, 16 heads, seq 512, micro-batch 4, vocab 50257 (~405M)."""
    if quick:
        config, micro_batch = models.GPTConfig(layers=2, hidden=128, heads=4, seq=64,
                                               vocab=4096), 2
    else:
        # BENCH_GPT_MICRO_BATCH=k: a GPU-bound variant (the default 4 is host-bound on H200).
        config, micro_batch = models.GPTConfig(), _env_int("BENCH_GPT_MICRO_BATCH", 4)

    return Workload("gpt", "tokens", micro_batch * config.seq,
                    {**dataclasses.asdict(config), "micro_batch": micro_batch},
                    lambda: models.GPT(config),
                    functools.partial(models.lm_batch, config.vocab, micro_batch, config.seq),
                    models.lm_loss, "adamw")


def gpt2_library_workload(quick: bool) -> Workload:
    """GPT-2 medium from ``transformers`` (GPT2LMHeadModel: 24x1024, 16 heads, seq 1024,
    vocab 50257, ~355M), random initialisation from its config, micro-batch 8
    (``BENCH_LM_MICRO_BATCH``): a GPU-bound step of real library code. Where
    ``transformers`` is missing every mode is n/a."""
    if quick:
        shape = dict(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=4096)
        micro_batch = 2
    else:
        shape = dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
        micro_batch = _env_int("BENCH_LM_MICRO_BATCH", 8)
    seq = shape["n_positions"]

    def build() -> nn.Module:
        try:
            import transformers
        except ImportError as exc:
            raise ModeUnavailable(f"transformers is not installed ({exc})") from None
        config = transformers.GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        return models.LibraryLM(transformers.GPT2LMHeadModel(config))

    return Workload("gpt2_lib", "tokens", micro_batch * seq,
                    {**shape, "library": "transformers GPT2LMHeadModel",
                     "micro_batch": micro_batch, "seq": seq},
                    build, functools.partial(models.lm_batch, shape["vocab_size"],
                                             micro_batch, seq),
                    models.lm_loss, "adamw")


def llama_library_workload(quick: bool) -> Workload:
    """The Llama-architecture decoder of ``models.llama_lm`` from ``transformers``
    (8x2048, MLP 5632, 16 heads, vocab 32000, untied; seq 2048, micro-batch 4), as
    ``train_lm.py`` trains it; ``BENCH_LLAMA_LAYERS=16`` makes it the ~0.94B one. Where
    ``transformers`` is missing every mode is n/a."""
    shape = models.LLAMA_QUICK_SHAPE if quick else dict(
        models.LLAMA_SHAPE, num_hidden_layers=_env_int(
            "BENCH_LLAMA_LAYERS", models.LLAMA_SHAPE["num_hidden_layers"]))

    def build() -> nn.Module:
        try:
            return models.llama_lm(shape)
        except ImportError as exc:
            raise ModeUnavailable(f"transformers is not installed ({exc})") from None

    return Workload("llama_lib", "tokens", shape["micro_batch"] * shape["seq"],
                    {**shape, "library": "transformers LlamaForCausalLM"},
                    build, functools.partial(models.lm_batch, shape["vocab_size"],
                                             shape["micro_batch"], shape["seq"]),
                    models.lm_loss, "adamw")


def _image_workload(name: str, build: Callable[[], nn.Module], batch: int, resolution: int,
                    classes: int, shape: Dict[str, Any]) -> Workload:
    def make_batch(device, generator):
        images = torch.randn(batch, 3, resolution, resolution, device=device,
                             generator=generator)
        labels = torch.randint(0, classes, (batch,), device=device, generator=generator)
        return images, labels

    return Workload(name, "images", batch,
                    {**shape, "batch": batch, "resolution": resolution, "classes": classes},
                    build, make_batch, F.cross_entropy, "sgd")


def vgg16_workload(quick: bool) -> Workload:
    """VGG-16, batch 32 per GPU at 224x224, 1000 classes (138M parameters)."""
    if quick:
        kw = dict(width=1 / 16, pool=1, classifier_hidden=64, num_classes=10)
        return _image_workload("vgg16", lambda: models.vgg16(**kw), 4, 32, 10, kw)
    return _image_workload("vgg16", models.vgg16, 32, 224, 1000, {"width": 1.0})


def resnet50_workload(quick: bool) -> Workload:
    """ResNet-50, batch 64 per GPU at 224x224, 1000 classes (25.6M parameters)."""
    if quick:
        kw = dict(width=1 / 8, num_classes=10)
        return _image_workload("resnet50", lambda: models.resnet50(**kw), 4, 32, 10, kw)
    return _image_workload("resnet50", models.resnet50, 64, 224, 1000, {"width": 1.0})


WORKLOADS: Dict[str, Callable[[bool], Workload]] = {
    "gpt": gpt_workload, "gpt2_lib": gpt2_library_workload,
    "llama_lib": llama_library_workload, "vgg16": vgg16_workload,
    "resnet50": resnet50_workload}


# ---------------------------------------------------------------------------------------
# Bench: what a mode needs (device, seeded model, step, timing loop)
# ---------------------------------------------------------------------------------------

def thread_times() -> Dict[str, List[int]]:
    """Per thread of this process (Linux; empty elsewhere), by name (the main thread is
    "main"; threads of one name are summed): [ns on a CPU, ns waiting for a CPU, voluntary
    and involuntary context switches] since the thread started, from /proc. A thread's CPU
    time against its wall time tells computing from waiting; time waiting for a CPU and
    involuntary switches tell CPU contention; voluntary switches count the thread's waits
    (locks, the GIL, blocking calls)."""
    out: Dict[str, List[int]] = {}
    root = Path("/proc/self/task")
    if not root.is_dir():
        return out
    main = str(os.getpid())
    for task in root.iterdir():
        try:
            name = "main" if task.name == main else (task / "comm").read_text().strip()
            on_cpu, waiting = map(int, (task / "schedstat").read_text().split()[:2])
            switches = [int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                        if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt"))]
        except (OSError, ValueError):
            continue                      # a thread that ended meanwhile
        total = out.setdefault(name, [0, 0, 0, 0])
        for k, value in enumerate([on_cpu, waiting] + switches):
            total[k] += value
    return out


def thread_deltas(before: Dict[str, List[int]], after: Dict[str, List[int]],
                  steps: int) -> Dict[str, Dict[str, float]]:
    """Per thread name, per step: ms on a CPU, ms waiting for one, and switches."""
    deltas = {}
    for name, now in after.items():
        then = before.get(name, [0, 0, 0, 0])
        d = [a - b for a, b in zip(now, then)]
        if d[0] <= 0:
            continue
        deltas[name] = {"cpu_ms": round(d[0] * 1e-6 / steps, 3),
                        "runqueue_ms": round(d[1] * 1e-6 / steps, 3),
                        "voluntary": round(d[2] / steps, 1),
                        "involuntary": round(d[3] / steps, 1)}
    return deltas


class PhaseProbe:
    """``BENCH_PHASES=1``: where a host-bound step's time goes. Each timed step marks the
    end of its forward, backward and optimizer phases with a host timestamp and a CUDA
    event on the training stream. Per phase it reports the host time the training thread
    spent in it and the device lag at its end: how long after the host got there the
    stream got there (the stream reaches an event once the work queued before it ran). A
    lag near 0 means the device waited for the host; a growing lag, that the host ran
    ahead of a busy device. Events map onto the host clock through one event recorded on
    the idle stream at the start of each window. A few events per step: light enough not
    to change what it measures, unlike a profiler."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, window: int):
        self.ref = torch.cuda.Event(enable_timing=True)
        self.events = [torch.cuda.Event(enable_timing=True)
                       for _ in range(window * (len(self.PHASES) + 1))]
        self.marks: List[int] = []
        self.t_ref = 0
        self.host: Dict[str, List[float]] = {p: [] for p in self.PHASES}
        self.lag: Dict[str, List[float]] = {p: [] for p in self.PHASES}

    def begin_window(self) -> None:
        """After a device synchronisation: the reference event, and no marks yet."""
        self.ref.record()
        self.ref.synchronize()
        self.t_ref = time.perf_counter_ns()
        self.marks = []

    def mark(self) -> None:
        """The start of a step, then the end of each of its phases."""
        self.events[len(self.marks)].record()
        self.marks.append(time.perf_counter_ns())

    def end_window(self) -> None:
        """After a device synchronisation: fold the window's marks into the samples."""
        per_step = len(self.PHASES) + 1
        for first in range(0, len(self.marks), per_step):
            for k, phase in enumerate(self.PHASES, start=first + 1):
                device_ns = self.t_ref + self.ref.elapsed_time(self.events[k]) * 1e6
                self.host[phase].append((self.marks[k] - self.marks[k - 1]) * 1e-6)
                self.lag[phase].append((device_ns - self.marks[k]) * 1e-6)

    def summary(self) -> Dict[str, Dict[str, float]]:
        """Medians over the timed steps, in ms: host time per phase, device lag at its end."""
        def median(values: List[float]) -> float:
            return round(sorted(values)[len(values) // 2], 3) if values else float("nan")
        return {phase: {"host_ms": median(self.host[phase]), "lag_ms": median(self.lag[phase])}
                for phase in self.PHASES}


class StepMarks:
    """The steady state of a window: the time from the start of each step to the start of
    the next, for the window's interior steps (1 to k-2 of steps 0 to k-1).

    A window's mean pays once for its ends: it starts with nothing in flight and ends
    with a device synchronisation, which waits for the communication that would
    otherwise run into the next forward. A mode that overlaps one iteration with the next
    (the data-parallel mode) pays that drain once per window, the others about nothing.
    Between two interior step starts, every mode runs as it does in training, with no
    synchronisation. Starts are CUDA events on the training stream (where the device got
    to), or host times on CPU."""

    def __init__(self, window: int, cuda: bool):
        self.window = window
        self.events = ([torch.cuda.Event(enable_timing=True) for _ in range(window)]
                       if cuda else None)
        self.host = [0.0] * window
        self.intervals_ms: List[float] = []

    def mark(self, k: int) -> None:
        """Step ``k`` of the window starts."""
        if self.events is not None:
            self.events[k].record()
        else:
            self.host[k] = time.perf_counter()

    def end_window(self) -> None:
        """After the window's device synchronisation: keep its interior intervals."""
        for k in range(1, self.window - 1):
            if self.events is not None:
                ms = self.events[k].elapsed_time(self.events[k + 1])
            else:
                ms = (self.host[k + 1] - self.host[k]) * 1e3
            self.intervals_ms.append(ms)


class Bench:
    """Per-worker context handed to every mode: rank, device, workload, timing settings, and
    a cache shared by the modes of one workload (DDP's bucket sizes)."""

    def __init__(self, rank: int, world_size: int, backend: str, workload: Workload,
                 warmup: int, iters: int, telemetry_root: Optional[str] = None,
                 regime: str = ""):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.cuda = backend == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.workload = workload
        self.warmup = warmup
        self.iters = iters
        self.telemetry_root = telemetry_root
        self.regime = regime
        self.mode_name = ""
        self.cache: Dict[str, Any] = {}
        self.probe: Optional[PhaseProbe] = None     # BENCH_PHASES, while timed steps run
        self.phases: Optional[Dict[str, Dict[str, float]]] = None
        self.threads: Optional[Dict[str, Dict[str, float]]] = None
        self.scratch: List[str] = []    # temporary telemetry directories of the current mode
        self.kept: List[str] = []       # telemetry directories of the current mode, kept
        self.steady_ms: List[float] = []    # the last time()'s interior step intervals
        self.marks = None       # the ProfiledWindow while BENCH_SPLIT records (train_step)
        self.window: Optional[Dict[str, Any]] = None    # its figures, for run_mode
        self.window_reason: Optional[str] = None        # or why there are none
        self.losses: Optional[List[torch.Tensor]] = None    # BENCH_LOSSES: every step's

    def telemetry_dir(self, mode_name: str) -> str:
        """Where ``mode_name`` records its telemetry: under ``--telemetry-root`` (a fresh
        directory per round), else a temporary directory, removed once the mode ended."""
        if not self.telemetry_root:
            path = tempfile.mkdtemp(prefix=f"commsched-bench-{file_name(mode_name)}-")
            self.scratch.append(path)
            return path
        base = (Path(self.telemetry_root)
                / f"{self.regime}_w{self.world_size}_{file_name(mode_name)}")
        path, n = base, 1
        while path.exists():  # another round of the same mode
            n += 1
            path = base.with_name(f"{base.name}_r{n}")
        self.kept.append(str(path))
        return str(path)

    def build_model(self) -> nn.Module:
        """The workload's model on this device, from the same seed every time."""
        torch.manual_seed(SEED)
        with self.device:
            return self.workload.build()

    def ddp(self, model: nn.Module) -> DDP:
        """``model`` wrapped in DDP with its default settings: 25 MiB buckets after a 1 MiB
        first one. (Passing bucket_cap_mb=25 explicitly would drop the small first bucket.)"""
        return DDP(model, device_ids=[self.rank] if self.cuda else None)

    def optimizer(self, params) -> torch.optim.Optimizer:
        """AdamW (fused on CUDA) for GPT, SGD with momentum for the CNNs."""
        if self.workload.optimizer == "adamw":
            extra = {"fused": True} if self.cuda else {}
            return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **extra)
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """A fixed random batch, different on each rank."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(SEED + 1 + self.rank)
        return self.workload.make_batch(self.device, generator)

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> Callable[[], None]:
        """One training step: forward (bf16 autocast on CUDA; fp32 parameters and gradients),
        loss, backward, optimizer step, zero_grad."""
        inputs, targets = self.batch()
        loss_fn = self.workload.loss
        device_type = self.device.type

        def step() -> None:
            probe = self.probe
            if probe is not None:
                probe.mark()
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.cuda):
                loss = loss_fn(model(inputs), targets)
            if self.losses is not None:
                self.losses.append(loss.detach())     # (read after the mode: no sync here)
            if probe is not None:
                probe.mark()
            marks = self.marks
            if marks is not None:
                marks.backward_started(loss)
            loss.backward()
            if probe is not None:
                probe.mark()
            optimizer.step()
            if marks is not None:
                marks.step_ended()
            optimizer.zero_grad(set_to_none=True)
            if probe is not None:
                probe.mark()

        return step

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        benchlib.barrier(self.backend)

    def time(self, step: Callable[[], None],
             quiesce: Optional[Callable[[], None]] = None) -> List[float]:
        """Run ``warmup`` untimed then ``iters`` timed calls of ``step``; milliseconds per
        call, each measured between device synchronizations."""
        for _ in range(self.warmup):
            step()
        self.sync()
        self.barrier()
        times = []
        cpu0, main0 = time.process_time(), time.thread_time()
        threads0 = (thread_times() if "1" in (os.environ.get("BENCH_PHASES"),
                                              os.environ.get("BENCH_THREADS")) else None)
        # BENCH_WINDOW=k: synchronise only every k iterations (each sample is a window's
        # mean), so that communication may overlap the next forward, as in training.
        window = max(1, int(os.environ.get("BENCH_WINDOW", "1")))
        probe = (PhaseProbe(window)
                 if self.cuda and os.environ.get("BENCH_PHASES") == "1" else None)
        marks = StepMarks(window, self.cuda)
        # The training thread's CPU while it waits for the device in synchronize(), which
        # spins: left out of the CPU figures, which would otherwise equal the wall time of
        # every step and never show whether the host or the device sets the pace.
        waiting = 0.0
        for _ in range(self.iters):
            wait0 = time.thread_time()
            self.sync()
            waiting += time.thread_time() - wait0
            if probe is not None:
                probe.begin_window()
                self.probe = probe
            start = time.perf_counter()
            for k in range(window):
                marks.mark(k)
                step()
            wait0 = time.thread_time()
            self.sync()
            waiting += time.thread_time() - wait0
            times.append((time.perf_counter() - start) * 1e3 / window)
            marks.end_window()
            self.probe = None
            if probe is not None:
                probe.end_window()
        # CPU per iteration, all threads and the training thread alone (less its waits for
        # the device, above): where a mode's extra time goes when the GPU is not the
        # bottleneck.
        steps = self.iters * window
        self.cpu_ms = ((time.process_time() - cpu0 - waiting) * 1e3 / steps,
                       (time.thread_time() - main0 - waiting) * 1e3 / steps)
        self.steady_ms = marks.intervals_ms
        if os.environ.get("BENCH_PRINT_CPU") and dist.get_rank() == 0:
            print(f"[bench] cpu ms/iter: process {self.cpu_ms[0]:.1f}, training thread "
                  f"{self.cpu_ms[1]:.1f}; median {sorted(times)[len(times) // 2]:.1f} ms",
                  flush=True)
        if threads0 is not None:
            self.threads = thread_deltas(threads0, thread_times(), self.iters * window)
            print(f"[bench] rank {self.rank} {self.mode_name} threads per step (ms on CPU, "
                  "ms waiting for a CPU, voluntary/involuntary switches): " + ", ".join(
                      f"{n} {v['cpu_ms']:.1f} {v['runqueue_ms']:.1f} "
                      f"{v['voluntary']:.0f}/{v['involuntary']:.0f}"
                      for n, v in sorted(self.threads.items(), key=lambda kv: -kv[1]["cpu_ms"])
                      if v["cpu_ms"] >= 0.1), flush=True)
        if probe is not None:
            self.phases = probe.summary()
            print(f"[bench] rank {self.rank} {self.mode_name} phases (host ms / device lag "
                  "ms at the end): " + ", ".join(
                      f"{p} {v['host_ms']:.2f} / {v['lag_ms']:.2f}"
                      for p, v in self.phases.items()), flush=True)
        profile_dir = os.environ.get("BENCH_PROFILE")
        if profile_dir:
            self.profile(step, window, Path(profile_dir), quiesce)
        if os.environ.get("BENCH_SPLIT") == "1":
            self.record_split_window(step, window, quiesce)
        return times

    def record_split_window(self, step: Callable[[], None], window: int,
                            quiesce: Optional[Callable[[], None]] = None) -> None:
        """BENCH_SPLIT=1: ``window`` more steps recorded for the step split (not timed);
        ``self.window`` holds the figures, or None where it cannot record (on CPU)."""
        from commsched.telemetry.window import ProfiledWindow

        recorder = ProfiledWindow(window)
        self.window = None
        if not recorder.start():
            self.window_reason = recorder.reason
            return
        self.marks = recorder
        try:
            for _ in range(window):
                step()
            if quiesce is not None:
                quiesce()
        finally:
            self.marks = None
            self.window = recorder.stop()
            self.window_reason = recorder.reason

    def profile(self, step: Callable[[], None], window: int, directory: Path,
                quiesce: Optional[Callable[[], None]] = None) -> None:
        """BENCH_PROFILE=DIR: one more window of ``step`` under torch.profiler, after the
        timed ones, written as a Chrome trace to ``DIR/<regime>_<mode>_rank<r>.json.gz``
        (``_r2``... for further rounds); ``trace_overlap.py`` summarises it. Not part of
        the timed samples. On GPUs it records CUDA activity only (kernels, copies, the
        runtime calls that launched them): recording every operator on the CPU as well
        slows the host enough to change what a host-bound window looks like. ``quiesce``
        completes what the mode still has in flight after a step (the data-parallel mode's
        communication) before the profiler stops: the trace then holds the whole window,
        and no thread is inside a recorded operation while the profiler shuts down (with
        gloo collectives running, stopping it crashed the process)."""
        from torch.profiler import ProfilerActivity, profile

        directory.mkdir(parents=True, exist_ok=True)
        stem = f"{self.regime}_{file_name(self.mode_name)}_rank{self.rank}"
        path, n = directory / f"{stem}.json.gz", 1
        while path.exists():
            n += 1
            path = directory / f"{stem}_r{n}.json.gz"
        # BENCH_PROFILE_STACKS=1: every operator on the CPU too, with Python stacks, for
        # trace_overlap.py --python (which Python functions a thread's time goes to); it
        # slows the host, so a host-bound window's GPU figures are not read from such a trace.
        stacks = os.environ.get("BENCH_PROFILE_STACKS") == "1"
        activities = ([ProfilerActivity.CUDA] if self.cuda else []) + (
            [ProfilerActivity.CPU] if stacks or not self.cuda else [])
        self.sync()
        with profile(activities=activities, with_stack=stacks) as prof:
            for _ in range(window):
                step()
            if quiesce is not None:
                quiesce()
            self.sync()
        prof.export_chrome_trace(str(path))


# ---------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------

def run_plain(bench: Bench) -> Dict[str, Any]:
    """The same loop without DDP and without commsched: the step and the memory every
    data-parallel mode is held against (at world size 1, what data parallelism adds)."""
    model = bench.build_model()
    step = bench.train_step(model, bench.optimizer(model.parameters()))
    return {"iter_ms": bench.time(step)}


def run_compute_only(bench: Bench) -> Dict[str, Any]:
    """The DDP step inside ``no_sync()``: no gradient communication (the compute floor)."""
    model = bench.ddp(bench.build_model())
    step = bench.train_step(model, bench.optimizer(model.parameters()))

    def no_sync_step() -> None:
        with model.no_sync():
            step()

    return {"iter_ms": bench.time(no_sync_step)}


def run_ddp_default(bench: Bench) -> Dict[str, Any]:
    """Plain DDP (bucket_cap_mb 25): what users run today. Records the bucket sizes DDP
    settled on, for comm_only."""
    model = bench.ddp(bench.build_model())
    step = bench.train_step(model, bench.optimizer(model.parameters()))
    times = bench.time(step)
    buckets = ddp_bucket_bytes(model)
    if buckets is not None:
        bench.cache["buckets"] = buckets
    return {"iter_ms": times}


def run_ddp_python_hook(bench: Bench, hook: str = "bf16_compress_hook") -> Dict[str, Any]:
    """DDP with one of PyTorch's own Python hooks (``default_hooks.<hook>``):
    ``bf16_compress_hook``, DDP's own bfloat16 all-reduces, the reference for
    ``COMMSCHED_GRAD_REDUCE_DTYPE=bfloat16``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook == "bf16_compress_hook" and not bench.cuda:
        raise ModeUnavailable("NCCL only: DDP refuses bf16_compress_hook on gloo")
    model = bench.ddp(bench.build_model())
    model.register_comm_hook(None, getattr(default_hooks, hook))
    step = bench.train_step(model, bench.optimizer(model.parameters()))
    return {"iter_ms": bench.time(step)}


def run_comm_only(bench: Bench, dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """The same bytes and collectives as DDP without compute: one async all-reduce per
    gradient bucket, issued in bucket order, then all waited for (the comm floor). The
    benchmark models keep fp32 gradients; ``dtype`` bfloat16: the same elements in it, as
    DDP's ``bf16_compress_hook`` and ``COMMSCHED_GRAD_REDUCE_DTYPE=bfloat16`` send them."""
    bucket_bytes, source = bench.cache.get("buckets") or fallback_bucket_bytes(bench)
    size = torch.tensor([], dtype=dtype).element_size()
    buffers = [torch.zeros(max(1, n // 4), dtype=dtype, device=bench.device)
               for n in bucket_bytes]

    def step() -> None:
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for work in works:
            work.wait()

    return {"iter_ms": bench.time(step), "buckets": len(bucket_bytes),
            "bucket_bytes": bucket_bytes, "bucket_source": source,
            "total_bytes": sum(b.numel() * size for b in buffers)}


def run_both_at_once(bench: Bench) -> Dict[str, Any]:
    """Compute only with comm only's all-reduces beside it: the same buckets issued at the
    start of each step, asynchronously (nothing orders them after the backward), and
    waited for before the optimizer step. Its time against compute only and comm only is
    what the two cost each other on this machine; not a floor for a mode that runs
    communication beside the next forward."""
    bucket_bytes, source = bench.cache.get("buckets") or fallback_bucket_bytes(bench)
    buffers = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=bench.device)
               for n in bucket_bytes]
    model = bench.ddp(bench.build_model())
    optimizer = bench.optimizer(model.parameters())
    works: List[Any] = []

    def wait(opt, args, kwargs) -> None:
        for work in works:
            work.wait()
        works.clear()

    handle = optimizer.register_step_pre_hook(wait)
    step = bench.train_step(model, optimizer)

    def both_step() -> None:
        works.extend(dist.all_reduce(b, async_op=True) for b in buffers)
        with model.no_sync():
            step()

    try:
        times = bench.time(both_step)
    finally:
        handle.remove()
    return {"iter_ms": times, "buckets": len(bucket_bytes), "bucket_source": source}


def attach_split(bench: Bench, mode: "Mode", result: Dict[str, Any]) -> None:
    """BENCH_SPLIT=1: keep compute only's window and timed median; split every later
    mode's timed median above it, the device parts from the two windows."""
    if mode.name == "comm_only":
        bench.cache["comm_only_window"] = bench.window
        bench.cache["comm_only_window_reason"] = bench.window_reason
    if bench.window is None:
        return
    if mode.name == "compute_only":
        bench.cache["compute_only_window"] = (bench.window, result.get("median_ms"))
        return
    if "compute_only_window" not in bench.cache or mode.name in ("comm_only",
                                                                  "comm_only_bf16"):
        return
    from commsched.telemetry.step_split import both_at_once, split, verdict_line

    compute, compute_ms = bench.cache["compute_only_window"]
    timed = (result["median_ms"] - compute_ms
             if result.get("median_ms") is not None and compute_ms is not None else None)
    result["split"] = split(bench.window, compute, timed_above_ms=timed)
    result["split_verdict"] = verdict_line(result["split"])
    if mode.name == "both_at_once":
        result["both_at_once"] = both_at_once(
            bench.window, compute, bench.cache.get("comm_only_window"),
            bench.cache.get("comm_only_window_reason")
            or "not measured: comm only has not run in this launch")


# ``--set FIELD=VALUE``: Config fields every commsched mode of the launch runs with (a
# mode's own settings win); set in each worker from its LaunchSpec.
_SETTINGS: Dict[str, Any] = {}


def commsched_config(**overrides):
    """The Config of a commsched mode: the environment's, on, with ``--set`` and the mode's
    own ``overrides`` applied."""
    commsched = benchlib.import_commsched()
    return commsched.Config.from_env().replace(enabled=True, **{**_SETTINGS, **overrides})


def run_ddp_commsched(bench: Bench, **overrides) -> Dict[str, Any]:
    """DDP with the commsched comm hook, Config from COMMSCHED_* (defaults when unset) with
    ``overrides``; with ``autotune`` the timed steps start once the tuner judged."""
    config = commsched_config(**overrides)
    if config.autotune:
        return run_ddp_commsched_autotune(bench, config)
    hooks = benchlib.import_commsched_hooks()
    model = bench.ddp(bench.build_model())
    state = hooks.register(model, config=config)
    try:
        step = bench.train_step(model, bench.optimizer(model.parameters()))
        times = bench.time(step)
    finally:
        close_quietly(state, getattr(state, "recorder", None))
    return {"iter_ms": times, "commsched_config": dataclasses.asdict(config)}


def run_ddp_commsched_telemetry(bench: Bench, name: str = "ddp_commsched_telemetry",
                                **overrides) -> Dict[str, Any]:
    """The commsched hook with telemetry recorded (``--telemetry-root`` keeps it)."""
    return run_ddp_commsched(bench, telemetry_dir=bench.telemetry_dir(name), **overrides)


def run_ddp_commsched_autotune(bench: Bench, config, max_settle: int = 120
                               ) -> Dict[str, Any]:
    """The commsched hook with the online tuner (``config.autotune``). After the warm-up,
    steps run untimed until the tuner has judged its trial (keep / revert / unchanged /
    failed; at most ``max_settle`` steps), then the timed iterations measure what it
    settled on."""
    hooks = benchlib.import_commsched_hooks()
    model = bench.ddp(bench.build_model())
    state = hooks.register(model, config=config)
    final = ("keep", "revert", "unchanged", "failed")
    try:
        step = bench.train_step(model, bench.optimizer(model.parameters()))
        settle = 0
        while settle < max_settle:
            step()
            settle += 1
            # Every rank reads the same log (the tuner's decisions are rank-invariant), so
            # every rank leaves this loop at the same step.
            if any(e["event"] in final for e in state.scheduler.tuning_log()):
                break
        bench.sync()
        times = bench.time(step)
        log = state.scheduler.tuning_log()
    finally:
        close_quietly(state, getattr(state, "recorder", None))
    return {"iter_ms": times, "commsched_config": dataclasses.asdict(config),
            "settle_steps": settle, "tuning_log": log,
            "tuned": _tuned_setting(log, config)}


def _tuned_setting(log: List[dict], config) -> Dict[str, Any]:
    """The setting in force after the tuner's decisions."""
    tuned = {"partition_bytes": config.partition_bytes, "credit_bytes": config.credit_bytes,
             "decompose": config.decompose}
    for entry in log:
        if entry["event"] in ("trial", "keep") and entry["candidate_partition_bytes"] is not None:
            tuned = {"partition_bytes": entry["candidate_partition_bytes"],
                     "credit_bytes": entry["candidate_credit_bytes"],
                     "decompose": entry["candidate_decompose"]}
        elif entry["event"] in ("revert", "abandoned"):
            tuned = {"partition_bytes": entry["old_partition_bytes"],
                     "credit_bytes": entry["old_credit_bytes"],
                     "decompose": entry["old_decompose"]}
    return tuned


def run_commsched_dp(bench: Bench, **overrides) -> Dict[str, Any]:
    """commsched's own data-parallel mode (crossing the iteration barrier); ``overrides``
    replace fields of the config from the environment (``group_bytes``: the layer-group
    size)."""
    commsched = benchlib.import_commsched()
    config = commsched_config(**overrides)
    model = bench.build_model()
    model, optimizer = commsched.wrap(model, bench.optimizer(model.parameters()), config)
    # Layer groups go whole (one collective each) with rs_ag, and with `none` under an
    # unbounded credit window: the partition size does not apply then.
    whole = model._engine.whole_groups
    groups = len(model._engine.groups)
    # The window its lane runs under: COMMSCHED_CREDIT_BYTES, or groups_in_flight groups.
    window = model._engine.scheduler.config.credit_bytes
    try:
        step = bench.train_step(model, optimizer)
        times = bench.time(step, quiesce=lambda: commsched.drain(model))
        # rs_ag keeps only this rank's shard of the optimizer state: what it saves.
        from commsched.data_parallel.update import state_bytes
        state = state_bytes(optimizer)
        engine = model._engine
        summary = getattr(engine.scheduler, "plan_summary", None)
        plan = summary(engine.reduce_group) if summary is not None else None
    finally:
        close_quietly(model, optimizer)
    return {"iter_ms": times, "commsched_config": dataclasses.asdict(config),
            "optimizer_state_bytes": state, "whole_groups": whole, "layer_groups": groups,
            "credit_window_bytes": window, "plan": plan,
            "group_bytes": [g.buffer.numel() * g.buffer.element_size()
                            for g in engine.groups]}


@dataclass(frozen=True)
class Mode:
    """A row of the results: ``run`` measures it; ``run`` None marks the derived floor."""

    name: str
    label: str
    run: Optional[Callable[[Bench], Dict[str, Any]]]


# Run order = table order. ddp_default runs before comm_only, which reuses the bucket sizes
# that DDP settled on.
MODES: List[Mode] = [
    Mode("plain", "0 plain loop (no DDP, no commsched)", run_plain),
    Mode("compute_only", "1 compute only (no_sync)", run_compute_only),
    Mode("ddp_default", "4 DDP default (25 MiB buckets)", run_ddp_default),
    Mode("comm_only", "2 comm only (DDP buckets, all-reduce)", run_comm_only),
    Mode("floor", "3 floor = max(1, 2)", None),
    Mode("both_at_once", "3c both at once: 1 with 2's all-reduces beside it",
         run_both_at_once),
    Mode("comm_only_bf16", "2b comm only, bfloat16 all-reduces",
         lambda bench: run_comm_only(bench, torch.bfloat16)),
    Mode("floor_bf16", "3b floor of bfloat16 all-reduces = max(1, 2b)", None),
    Mode("ddp_bf16_hook", "4f DDP + PyTorch's bf16_compress_hook (bfloat16 all-reduces)",
         run_ddp_python_hook),
    Mode("ddp_commsched", "5 DDP + commsched hook", run_ddp_commsched),
    Mode("ddp_commsched_telemetry", "5e as 5, with telemetry and NVLink sampling",
         run_ddp_commsched_telemetry),
    Mode("commsched_dp", "6 commsched data-parallel mode", run_commsched_dp),
    Mode("commsched_dp_bf16", "6h as 6, bfloat16 all-reduces (grad_reduce_dtype)",
         lambda bench: run_commsched_dp(bench, grad_reduce_dtype="bfloat16")),
    Mode("commsched_dp_zero", "6b data-parallel mode, rs_ag (ZeRO-1 shards)",
         lambda bench: run_commsched_dp(bench, decompose="rs_ag")),
]
MODE_NAMES = [m.name for m in MODES]
NOT_SELECTED = "not selected (--modes)"


def _short_bytes(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def sweep_modes(pairs: Sequence[Tuple[int, int]]) -> List[Mode]:
    """One mode per (partition, credit): the commsched hook with that setting, telemetry
    on (``--sweep``)."""
    modes = []
    for partition, credit in pairs:
        name = f"sweep_p{_short_bytes(partition)}_c{_short_bytes(credit)}"
        label = (f"5s hook, partition {_short_bytes(partition) if partition else 'off'}, "
                 f"credit {_short_bytes(credit) if credit else 'unbounded'}, telemetry")

        def run(bench: Bench, partition=partition, credit=credit, name=name):
            return run_ddp_commsched(bench, partition_bytes=partition, credit_bytes=credit,
                                     telemetry_dir=bench.telemetry_dir(name))
        modes.append(Mode(name, label, run))
    return modes


def dp_sweep_modes(settings: Sequence[Tuple[int, ...]]) -> List[Mode]:
    """One mode per (partition, credit[, layer-group size[, first group's size]]): the
    data-parallel mode with that setting (``--dp-sweep``); without a size, the config's."""
    modes = []
    for partition, credit, *group in settings:
        name = f"dpsweep_p{_short_bytes(partition)}_c{_short_bytes(credit)}"
        label = (f"6s data-parallel mode, partition "
                 f"{_short_bytes(partition) if partition else 'off'}, "
                 f"credit {_short_bytes(credit) if credit else _group_window()}")
        overrides = {"partition_bytes": partition, "credit_bytes": credit}
        if group:
            name += f"_g{_short_bytes(group[0])}"
            label += f", groups {_short_bytes(group[0]) if group[0] else 'per module'}"
            overrides["group_bytes"] = group[0]
        if len(group) > 1:
            name += f"_f{_short_bytes(group[1])}"
            label += f", first group {_short_bytes(group[1]) if group[1] else 'as the others'}"
            overrides["first_group_bytes"] = group[1]

        def run(bench: Bench, overrides=overrides):
            return run_commsched_dp(bench, **overrides)
        modes.append(Mode(name, label, run))
    return modes


def _group_window() -> str:
    """The data-parallel mode's window where the credit window is unbounded."""
    n = benchlib.import_commsched().Config.from_env().groups_in_flight
    return _layer_groups(n) if n else "unbounded"


def _layer_groups(n: int) -> str:
    return f"{n} layer group{'s' if n > 1 else ''}"


# The modes that take settings of their own: ``NAME@FIELD=VALUE[@FIELD=VALUE...]`` runs
# NAME with those ``Config`` fields (each value written as its COMMSCHED_* variable would
# be: ``Config.parse``).
_VARIANT_BASES = {"commsched_dp": ("6v", run_commsched_dp),
                  "ddp_commsched": ("5v", run_ddp_commsched),
                  "ddp_commsched_telemetry": ("5ev", run_ddp_commsched_telemetry)}


def file_name(mode_name: str) -> str:
    """``mode_name`` in a file name: a variant's ``@`` and ``=`` as ``.`` and ``-``."""
    return mode_name.replace("@", ".").replace("=", "-")


def parse_variant(name: str) -> Tuple[str, Dict[str, Any]]:
    """``NAME@FIELD=VALUE...`` -> (NAME, {field: value}); ValueError names what is wrong."""
    base, *settings = name.split("@")
    if base not in _VARIANT_BASES or not settings:
        raise ValueError(f"{name!r}: a variant is one of {', '.join(_VARIANT_BASES)} followed "
                         f"by @FIELD=VALUE settings")
    return base, parse_settings(settings, f"{name!r}: ")


def parse_settings(settings: Sequence[str], where: str = "") -> Dict[str, Any]:
    """``FIELD=VALUE`` strings -> {field: value} of ``Config`` fields (``@`` variants,
    ``--set``); ValueError names what is wrong."""
    config = benchlib.import_commsched().Config
    overrides: Dict[str, Any] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(f"{where}{setting!r} is not FIELD=VALUE of a Config field")
        overrides[key] = config.parse(key, value)
    config(**overrides)         # (each value checked as the Config checks it)
    return overrides


def variant_modes(names: Sequence[str]) -> List[Mode]:
    """One mode per ``NAME@FIELD=VALUE...`` name (``--modes``)."""
    modes = []
    for name in names:
        base, overrides = parse_variant(name)
        code, run = _VARIANT_BASES[base]
        label = f"{code} {base}, " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        if run is run_ddp_commsched_telemetry:
            overrides = {"name": name, **overrides}
        modes.append(Mode(name, label, lambda bench, run=run, kw=overrides: run(bench, **kw)))
    return modes


def mode_table(sweep: Sequence[Tuple[int, int]] = (),
               dp_sweep: Sequence[Tuple[int, ...]] = (),
               variants: Sequence[str] = ()) -> List[Mode]:
    """Every mode of a launch, in table order: ``MODES``, the variants, then the sweeps'."""
    return [*MODES, *variant_modes(variants), *sweep_modes(sweep), *dp_sweep_modes(dp_sweep)]


def ddp_bucket_bytes(model: DDP) -> Optional[Tuple[List[int], str]]:
    """Byte sizes of DDP's gradient buckets in reduction order (rebuilt after the first
    iteration when available), from DDP's logging data."""
    try:
        data = model._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - private API; fall back to the estimate
        return None
    for key, source in (("rebuilt_bucket_sizes", "DDP rebuilt buckets"),
                        ("bucket_sizes", "DDP initial buckets")):
        text = data.get(key)
        if isinstance(text, str) and text.strip():
            return [int(s) for s in text.split(",")], source
    return None


def fallback_bucket_bytes(bench: Bench) -> Tuple[List[int], str]:
    """DDP's bucketing re-done from parameter sizes: parameters in reverse order, a bucket
    closed once it reaches its cap (1 MiB for the first, then 25 MiB)."""
    with torch.device("meta"):
        model = bench.workload.build()
    sizes = [p.numel() * p.element_size() for p in model.parameters()][::-1]
    return assign_buckets(sizes, dist._DEFAULT_FIRST_BUCKET_BYTES,
                          DDP_BUCKET_CAP_MB << 20), "estimate: DDP bucketing redone from parameter sizes"


def assign_buckets(sizes: List[int], first_cap: int, cap: int) -> List[int]:
    """Bucket byte totals when tensors of ``sizes`` fill buckets in order, a bucket closing
    as soon as it holds at least its cap (tensors are never split)."""
    buckets, current, limit = [], 0, first_cap
    for size in sizes:
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    if current:
        buckets.append(current)
    return buckets


# ---------------------------------------------------------------------------------------
# Running the modes of a workload (inside each worker)
# ---------------------------------------------------------------------------------------

# BENCH_MEMORY: allocation events kept per mode; older ones are overwritten. GPT at the
# default size allocates a few thousand blocks per iteration.
MEMORY_HISTORY_ENTRIES = 1_000_000

RESULT_KEYS = ("median_ms", "mean_ms", "p10_ms", "p90_ms", "min_ms", "max_ms")


def empty_result(mode: Mode, status: str, reason: Optional[str]) -> Dict[str, Any]:
    """A mode result with every standard key; numbers are None unless status is "ok"."""
    result: Dict[str, Any] = {"name": mode.name, "label": mode.label, "status": status,
                              "reason": reason}
    result.update({k: None for k in RESULT_KEYS})
    result.update({"iter_ms": [], "peak_mem_bytes": None, "peak_mem_bytes_max_rank": None,
                   "throughput": None, "throughput_unit": None, "efficiency": None,
                   "steady_ms": [], "steady_median_ms": None, "steady_efficiency": None})
    return result


def start_memory_history(bench: Bench) -> int:
    """``BENCH_MEMORY=DIR``: record every allocation of the mode (Python stacks), for
    ``memory_peak.py``. Returns the bytes already allocated, which have no history."""
    torch.cuda.synchronize(bench.device)
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                             max_entries=MEMORY_HISTORY_ENTRIES)
    return torch.cuda.memory_allocated(bench.device)


def dump_memory_history(bench: Bench, directory: Path, baseline: int) -> None:
    """Write the mode's history to ``DIR/<regime>_<mode>_rank<r>.pickle`` and stop
    recording. The snapshot is taken while the mode's objects may still be alive, before
    the collection that ends the mode."""
    directory.mkdir(parents=True, exist_ok=True)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    snapshot["baseline_bytes"] = baseline
    snapshot["device"] = torch.device(bench.device).index or 0
    path = directory / f"{bench.regime}_{file_name(bench.mode_name)}_rank{bench.rank}.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def run_mode(bench: Bench, mode: Mode) -> Dict[str, Any]:
    """Run one mode on this rank; failures become an "error" result. The ranks then agree
    on the outcome, so that a mode failed on either rank is reported failed."""
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(bench.device)
        torch.cuda.reset_accumulated_memory_stats(bench.device)   # (num_alloc_retries)
    failed = 0
    bench.losses = [] if os.environ.get("BENCH_LOSSES") == "1" else None
    bench.cpu_ms = None
    bench.phases = bench.threads = None
    bench.steady_ms = []
    bench.kept = []
    bench.window = None
    bench.window_reason = "not measured: the mode recorded no window"
    bench.mode_name = mode.name
    started = time.monotonic()
    memory_dir = os.environ.get("BENCH_MEMORY") if bench.cuda else None
    baseline = start_memory_history(bench) if memory_dir else 0
    try:
        measured = mode.run(bench)
        # (after the mode closed what it started: a thread left running by one round
        # would show as a count growing with the rounds)
        live_threads = threading.active_count()
        result = empty_result(mode, "ok", None)
        result.update(summarize_ms(measured["iter_ms"]))
        result.update(measured)
        if bench.steady_ms:
            result["steady_ms"] = bench.steady_ms
            result["steady_median_ms"] = statistics.median(bench.steady_ms)
        result["live_threads_after"] = [live_threads]    # this rank's, per round
        if bench.kept:
            result["telemetry_dirs"] = list(bench.kept)
        if bench.cpu_ms is not None:
            result["cpu_ms_per_iter"] = {"process": bench.cpu_ms[0],
                                         "training_thread": bench.cpu_ms[1]}
            result["process_cpu_ms_rounds"] = [bench.cpu_ms[0]]
        if bench.phases is not None:
            result["phases"] = [bench.phases]        # this rank's, per round (BENCH_PHASES)
        if bench.threads is not None:
            result["threads"] = [bench.threads]      # this rank's, per round (BENCH_PHASES)
        attach_split(bench, mode, result)
        if bench.losses:
            result["losses"] = [torch.stack(bench.losses).float().tolist()]    # per round
    except ModeUnavailable as exc:
        result = empty_result(mode, "n/a", str(exc))
    except Exception as exc:  # noqa: BLE001 - OOM or a bug in a mode: report it, go on
        failed = 1
        text = traceback.format_exc()
        print(f"[bench] rank {bench.rank} {mode.name} failed:\n{text}", file=sys.stderr,
              flush=True)
        result = empty_result(mode, "error", f"rank {bench.rank}: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        result["traceback"] = text[-4000:]
        del exc
    if memory_dir:
        dump_memory_history(bench, Path(memory_dir), baseline)
    gc.collect()
    for path in bench.scratch:      # the mode closed its recorder, or failed
        shutil.rmtree(path, ignore_errors=True)
    bench.scratch.clear()
    bench.losses = None
    peak = torch.cuda.max_memory_allocated(bench.device) if bench.cuda else 0
    # Reserved memory and the allocator's retries (a failed allocation that freed its
    # cache and tried again): fragmentation, which the allocated peak does not show.
    reserved = torch.cuda.max_memory_reserved(bench.device) if bench.cuda else 0
    retries = (torch.cuda.memory_stats(bench.device).get("num_alloc_retries", 0)
               if bench.cuda else 0)
    if bench.cuda:
        torch.cuda.empty_cache()
    # One collective: did any rank fail, and the largest peaks over ranks.
    flags = torch.tensor([failed, peak, reserved, retries], dtype=torch.int64,
                         device=bench.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item() and not failed:
        result = empty_result(mode, "error", "failed on another rank (see its stderr)")
    result["wall_s"] = round(time.monotonic() - started, 2)      # (this rank's, whole mode)
    if bench.cuda and result["status"] == "ok":
        result["peak_mem_bytes"] = peak
        result["peak_mem_bytes_max_rank"] = int(flags[1].item())
        result["peak_reserved_bytes_max_rank"] = int(flags[2].item())
        result["alloc_retries_max_rank"] = int(flags[3].item())
    if result["status"] == "ok" and result["median_ms"] and mode.name not in (
            "comm_only", "comm_only_bf16"):
        result["throughput"] = (bench.workload.items_per_rank * bench.world_size
                                / (result["median_ms"] / 1e3))
        result["throughput_unit"] = f"{bench.workload.unit}/s"
    return result


def finish_run(run: Dict[str, Any], table: Sequence[Mode] = MODES) -> Dict[str, Any]:
    """Fill in missing modes (of ``table``) as errors, derive the floor (max of compute only
    and comm only) and every mode's efficiency (floor / its time) with
    ``commsched.floor.floor_efficiency``, as ``commsched floor`` and the report do, and put
    the modes in table order; the same of bfloat16 all-reduces (``floor_bf16``,
    ``efficiency_bf16``). Idempotent."""
    modes = run.setdefault("modes", {})
    for mode in table:
        if mode.name not in modes and mode.run is not None:
            modes[mode.name] = empty_result(
                mode, "error", run.get("failure") or "not run (worker ended early)")
    for floor_name, comm_name, key in (("floor", "comm_only", "efficiency"),
                                       ("floor_bf16", "comm_only_bf16", "efficiency_bf16")):
        _derive_floor(run, modes, floor_name, comm_name, key)
    run["modes"] = {m.name: modes[m.name] for m in table}
    return run


def _derive_floor(run: Dict[str, Any], modes: Dict[str, Any], floor_name: str,
                  comm_name: str, key: str) -> None:
    """The row ``floor_name`` = max(compute only, ``comm_name``), and every measured mode's
    efficiency against it (``key``)."""
    from commsched.floor import floor_efficiency

    compute, comm = modes["compute_only"], modes.get(comm_name)
    floor_mode = next(m for m in MODES if m.name == floor_name)
    steady = None
    if compute["status"] == "ok" and comm is not None and comm["status"] == "ok":
        floor = empty_result(floor_mode, "ok", None)
        median = floor_efficiency(compute["median_ms"], comm["median_ms"])
        floor["median_ms"] = median["floor_ms"]
        floor["limited_by"] = median["limited_by"]
        floor["throughput"] = (run["items_per_step"] / (floor["median_ms"] / 1e3))
        floor["throughput_unit"] = f"{run['unit']}/s"
        if compute.get("steady_median_ms") and comm.get("steady_median_ms"):
            steady = (compute["steady_median_ms"], comm["steady_median_ms"])
            floor["steady_median_ms"] = floor_efficiency(*steady)["floor_ms"]
    else:
        floor = empty_result(floor_mode, "n/a", f"needs compute_only and {comm_name}")
    modes[floor_name] = floor
    for result in modes.values():
        if result["status"] == "ok" and floor["status"] == "ok":
            result[key] = floor_efficiency(
                compute["median_ms"], comm["median_ms"], result["median_ms"])["efficiency"]
            if result.get("steady_median_ms") and steady is not None:
                result["steady_" + key] = floor_efficiency(
                    *steady, result["steady_median_ms"])["efficiency"]


def save_floor_with_telemetry(run: Dict[str, Any]) -> None:
    """Keep the run's compute only and comm only in every telemetry run directory its
    modes kept (``--telemetry-root``), as ``floor.json``: ``commsched report`` of such a
    directory then shows each iteration's efficiency against the floor of the same
    workload."""
    from commsched.floor import save_floor

    compute, comm = run["modes"]["compute_only"], run["modes"]["comm_only"]
    if compute["status"] != "ok" or comm["status"] != "ok":
        return
    for result in run["modes"].values():
        for path in result.get("telemetry_dirs") or []:
            if os.path.isdir(path):
                save_floor(path, {"source": "harness", "workload": run["model"],
                                  "regime": run["regime"], "shape": run["workload"],
                                  "compute_only_ms": compute["median_ms"],
                                  "comm_only_ms": comm["median_ms"]})


def merge_round(previous: Optional[Dict[str, Any]], result: Dict[str, Any]
                ) -> Dict[str, Any]:
    """Pool a mode's samples over rounds (``--rounds``): all iterations' times, the median
    of each round, the largest peak memory; a failed round makes the mode failed."""
    if result["status"] == "ok":
        result["round_medians_ms"] = [result["median_ms"]]
    if previous is None:
        return result
    if previous["status"] != "ok" or result["status"] != "ok":
        return previous if previous["status"] == "error" else result
    merged = dict(result)
    merged["iter_ms"] = previous["iter_ms"] + result["iter_ms"]
    merged.update(summarize_ms(merged["iter_ms"]))
    merged["round_medians_ms"] = previous["round_medians_ms"] + [result["median_ms"]]
    if previous.get("steady_ms") and result.get("steady_ms"):
        merged["steady_ms"] = previous["steady_ms"] + result["steady_ms"]
        merged["steady_median_ms"] = statistics.median(merged["steady_ms"])
    for key in ("peak_mem_bytes", "peak_mem_bytes_max_rank", "peak_reserved_bytes_max_rank",
                "alloc_retries_max_rank"):
        if previous.get(key) is not None and result.get(key) is not None:
            merged[key] = max(previous[key], result[key])
    if previous.get("cpu_ms_per_iter") and result.get("cpu_ms_per_iter"):
        rounds = len(previous["round_medians_ms"])
        merged["cpu_ms_per_iter"] = {
            k: (previous["cpu_ms_per_iter"][k] * rounds + v) / (rounds + 1)
            for k, v in result["cpu_ms_per_iter"].items()}
    for key in ("phases", "threads", "live_threads_after", "process_cpu_ms_rounds",
                "telemetry_dirs", "losses"):
        if previous.get(key) and result.get(key):
            merged[key] = previous[key] + result[key]
    if result.get("throughput"):
        merged["throughput"] = result["throughput"] * result["median_ms"] / merged["median_ms"]
    return merged


def progress_line(regime: str, model: str, result: Dict[str, Any]) -> str:
    head = f"[bench] {regime} {model} {result['name']}:"
    if result["status"] != "ok":
        return f"{head} {result['status']}: {result['reason']}"
    text = (f"{head} {result['median_ms']:.2f} ms/iter median")
    if result.get("p10_ms") is not None:
        text += f" (p10 {result['p10_ms']:.2f}, p90 {result['p90_ms']:.2f})"
    if result.get("steady_median_ms"):
        text += f", steady {result['steady_median_ms']:.2f}"
    if result.get("throughput"):
        text += f", {result['throughput']:.0f} {result['throughput_unit']}"
    if result.get("peak_mem_bytes"):
        text += f", peak {result['peak_mem_bytes'] / 2**30:.2f} GiB"
    if result.get("wall_s"):
        text += f", {result['wall_s']:.0f} s"
    return text


@dataclass(frozen=True)
class LaunchSpec:
    """What the parent tells the workers of one launch (picklable)."""

    regime: str
    models: Tuple[str, ...]
    modes: Tuple[str, ...]
    quick: bool
    warmup: int
    iters: int
    port: int
    backend: str
    collective_timeout_s: float
    result_path: str
    world_size: int = DEFAULT_WORLD_SIZE
    rounds: int = 1
    sweep: Tuple[Tuple[int, int], ...] = ()
    telemetry_root: Optional[str] = None
    dp_sweep: Tuple[Tuple[int, ...], ...] = ()
    variants: Tuple[str, ...] = ()
    settings: Tuple[Tuple[str, Any], ...] = ()     # --set

    def table(self) -> List[Mode]:
        return mode_table(self.sweep, self.dp_sweep, self.variants)


def worker(rank: int, spec: LaunchSpec) -> None:
    """Entry point of each spawned worker: one process group, every model and mode."""
    # A worker killed by a signal (SIGABRT from a heap check, SIGSEGV) prints every
    # thread's Python stack on stderr: which thread was where.
    faulthandler.enable(all_threads=True)
    interval_us = os.environ.get("BENCH_SWITCH_INTERVAL_US")
    if interval_us:
        # Experiment knob: how long a thread waiting for the GIL may be kept waiting.
        sys.setswitchinterval(float(interval_us) * 1e-6)
    apply_regime_env(spec.regime)
    _SETTINGS.update(spec.settings)
    if spec.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    benchlib.init_process_group(rank, spec.world_size, spec.port, spec.backend,
                                spec.collective_timeout_s)
    doc: Dict[str, Any] = {
        "regime": spec.regime, "backend": spec.backend, "world_size": spec.world_size,
        "device": "cuda" if spec.backend == "nccl" else "cpu",
        "env": benchlib.relevant_env(), "system": benchlib.system_info() if rank == 0 else {},
        "runs": [],
    }
    try:
        for model_name in spec.models:
            workload = WORKLOADS[model_name](spec.quick)
            bench = Bench(rank, spec.world_size, spec.backend, workload, spec.warmup,
                          spec.iters, spec.telemetry_root, spec.regime)
            if bench.cuda:
                torch.backends.cudnn.benchmark = workload.unit == "images"
            try:
                with torch.device("meta"):
                    params = models.count_parameters(workload.build())
            except ModeUnavailable:
                params = 0                # (every mode reports why)
            run = {"regime": spec.regime, "model": model_name, "workload": workload.shape,
                   "params": params, "unit": workload.unit,
                   "items_per_step": workload.items_per_rank * spec.world_size,
                   "autocast": "bf16" if bench.cuda else "none (fp32 on CPU)",
                   "optimizer": workload.optimizer, "modes": {}}
            doc["runs"].append(run)
            if rank == 0:
                print(f"[bench] {spec.regime} {model_name}: {params / 1e6:.1f}M parameters, "
                      f"{run['items_per_step']} {workload.unit}/step, backend "
                      f"{spec.backend}", flush=True)
            table = spec.table()
            for round_ in range(spec.rounds):
                if rank == 0 and spec.rounds > 1:
                    print(f"[bench] {spec.regime} {model_name}: round {round_ + 1} of "
                          f"{spec.rounds}", flush=True)
                # Every other round in reverse (A B, B A, A B, ...): a drift within a
                # round (clocks settling, a host getting busier) then falls on the first
                # and the last modes alike.
                for mode in table if round_ % 2 == 0 else table[::-1]:
                    if mode.run is None:
                        continue
                    if mode.name not in spec.modes:
                        result = empty_result(mode, "n/a", NOT_SELECTED)
                    else:
                        result = run_mode(bench, mode)
                    if rank == 0:
                        print(progress_line(spec.regime, model_name, result), flush=True)
                    run["modes"][mode.name] = merge_round(
                        run["modes"].get(mode.name) if round_ else None, result)
                    if rank == 0:
                        benchlib.write_json(Path(spec.result_path), doc)
            finish_run(run, table)
            if rank == 0:
                save_floor_with_telemetry(run)
                print(progress_line(spec.regime, model_name, run["modes"]["floor"]),
                      flush=True)
                benchlib.write_json(Path(spec.result_path), doc)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Parent: launches, merging, table
# ---------------------------------------------------------------------------------------

def run_launch(spec: LaunchSpec, timeout_s: float) -> Dict[str, Any]:
    """Spawn the workers of one regime and return their document, completed with errors
    for whatever a crashed or hung launch did not measure."""
    print(f"[bench] regime {spec.regime}: spawning {spec.world_size} workers ({spec.backend}), "
          f"models {', '.join(spec.models)}", flush=True)
    outcome = benchlib.launch(worker, (spec,), spec.world_size, timeout_s)
    path = Path(spec.result_path)
    doc = json.loads(path.read_text()) if path.exists() else {
        "regime": spec.regime, "backend": spec.backend, "world_size": spec.world_size,
        "env": {}, "system": {}, "runs": []}
    doc["status"] = "ok" if outcome.ok else "error"
    doc["error"] = outcome.error
    doc["wall_s"] = round(outcome.wall_s, 1)
    done = {run["model"] for run in doc["runs"]}
    for model_name in spec.models:
        if model_name not in done:
            workload = WORKLOADS[model_name](spec.quick)
            doc["runs"].append({"regime": spec.regime, "model": model_name,
                                "workload": workload.shape, "params": None,
                                "unit": workload.unit,
                                "items_per_step": workload.items_per_rank * spec.world_size,
                                "modes": {}})
    for run in doc["runs"]:
        if not outcome.ok and any(m.run and m.name not in run["modes"]
                                  for m in spec.table()):
            run["failure"] = f"not run: {outcome.error}"
        finish_run(run, spec.table())
    return doc


def results_table(document: Dict[str, Any]) -> str:
    """The markdown table of every run and mode."""
    headers = ["regime", "model", "mode", "ms/iter (median)", "p10-p90 ms", "efficiency",
               "x DDP", "steady ms", "steady efficiency", "throughput", "peak GiB",
               "reserved GiB", "alloc retries", "CPU ms/iter", "note"]
    rows = []
    rounds = (document.get("settings") or {}).get("rounds", 1)
    for launch in document["launches"]:
        for run in launch["runs"]:
            ddp = (run["modes"].get("ddp_default") or {}).get("median_ms")
            for result in run["modes"].values():
                if result["status"] == "n/a" and result["reason"] == NOT_SELECTED:
                    continue  # in the JSON; the table keeps to what was asked for
                to_ddp = (result["median_ms"] / ddp if ddp and result["median_ms"]
                          and result["name"] not in _NOT_TRAINING else None)
                cpu = (result.get("cpu_ms_per_iter") or {}).get("process")
                rows.append([run["regime"], run["model"], result["label"],
                             fmt(result["median_ms"], 2), _spread(result),
                             fmt(result["efficiency"], 3), fmt(to_ddp, 3),
                             fmt(result.get("steady_median_ms"), 2),
                             fmt(result.get("steady_efficiency"), 3), _throughput(result),
                             None if not result["peak_mem_bytes"]
                             else fmt(result["peak_mem_bytes"] / 2**30, 2),
                             None if not result.get("peak_reserved_bytes_max_rank")
                             else fmt(result["peak_reserved_bytes_max_rank"] / 2**30, 2),
                             result.get("alloc_retries_max_rank"),
                             fmt(cpu, 1), _rounds_note(result, rounds)])
    return benchlib.markdown_table(headers, rows)


def _rounds_note(result: Dict[str, Any], rounds: int) -> Optional[str]:
    """The note, led by how many of the asked rounds the mode finished where a launch ended
    early (``--timeout``): its row pools fewer samples than the others."""
    note = _note(result)
    done = len(result.get("round_medians_ms") or [])
    if result["status"] != "ok" or result["name"] in _FLOORS or not 0 < done < rounds:
        return note
    return f"{done} of {rounds} rounds" + (f"; {note}" if note else "")


# Rows that are not a training step (no ratio to DDP): compute alone, communication alone
# and their floor.
_FLOORS = frozenset(("floor", "floor_bf16"))
_NOT_TRAINING = frozenset(("compute_only", "comm_only", "comm_only_bf16", *_FLOORS))


def _spread(result: Dict[str, Any]) -> Optional[str]:
    if result["p10_ms"] is None:
        return None
    return f"{result['p10_ms']:.2f}-{result['p90_ms']:.2f}"


def _throughput(result: Dict[str, Any]) -> Optional[str]:
    if not result["throughput"]:
        return None
    unit = result["throughput_unit"].replace("tokens", "tok").replace("images", "img")
    return f"{result['throughput']:,.0f} {unit}"


def _note(result: Dict[str, Any]) -> Optional[str]:
    if result["status"] != "ok":
        reason = result["reason"] or ""
        return f"{result['status']}: {reason[:100]}"
    if result["name"] in ("comm_only", "comm_only_bf16"):
        mib = result["total_bytes"] / 2**20
        return (f"{result['buckets']} buckets, {mib:.{0 if mib >= 10 else 2}f} MiB "
                f"({result['bucket_source']})")
    if result["name"] in _FLOORS:
        return f"limited by {result['limited_by']}"
    tuned = result.get("tuned")
    if tuned:
        return (f"tuned: partition {tuned['partition_bytes'] >> 10} KiB, credit "
                f"{tuned['credit_bytes'] >> 10} KiB, {tuned['decompose']} after "
                f"{result['settle_steps']} steps")
    config = result.get("commsched_config")
    if config:
        partition = ("whole layer groups" if result.get("whole_groups")
                     else f"partition {config['partition_bytes'] >> 10} KiB")
        if result.get("layer_groups"):
            partition = f"{result['layer_groups']} {partition}"
        window = result.get("credit_window_bytes", config["credit_bytes"])
        credit = f"credit {window >> 10} KiB"
        if window != config["credit_bytes"]:
            credit += f" ({_layer_groups(config['groups_in_flight'])} in flight)"
        text = f"{partition}, {credit}, {config['policy']}, {config['decompose']}"
        if result.get("optimizer_state_bytes") is not None:
            text += f"; optimizer state {result['optimizer_state_bytes'] / 2**20:.0f} MiB/rank"
        return text
    return None


def headline(document: Dict[str, Any]) -> str:
    system = document.get("system") or {}
    settings = document["settings"]
    if settings["backend"] == "nccl":
        card = (f"{settings['world_size']}x {system.get('gpu_name')}, driver "
                f"{system.get('driver')}, CUDA {system.get('cuda')}, NCCL {system.get('nccl')}")
    else:
        card = f"CPU ({system.get('cpu_count')} cores), gloo - smoke run, not a benchmark"
    return (f"commsched benchmark: {card}, torch {system.get('torch')}; warmup "
            f"{settings['warmup']}, {settings['iters']} timed iterations"
            + (f" x {settings['rounds']} interleaved rounds" if settings.get("rounds", 1) > 1
               else "")
            + f"{', quick models' if settings['quick'] else ''}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt",
                        help=f"{'|'.join(WORKLOADS)}|all, or a comma-separated list")
    parser.add_argument("--regime", default="nvlink", choices=[*REGIMES, "all"])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, 2 warm-up and 3 timed iterations (smoke test)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed iterations per mode (default 10; 2 with --quick)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations per mode (default 30; 3 with --quick)")
    parser.add_argument("--modes", default="all",
                        help=f"comma-separated subset of {','.join(n for n in MODE_NAMES if n not in _FLOORS)} "
                             "(the --sweep and --dp-sweep modes are added to it); "
                             f"{' or '.join(_VARIANT_BASES)}@FIELD=VALUE[@...]: that mode "
                             "with those Config fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a Config field every commsched mode runs with, written as its "
                             "variable would be (repeatable; a variant's own @FIELD=VALUE "
                             "wins)")
    parser.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE,
                        help="workers per launch, one GPU each with NCCL (default 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the selected modes this many times, interleaved, and pool "
                             "each mode's samples (default 1)")
    parser.add_argument("--sweep", default="",
                        help="comma-separated PARTITION/CREDIT byte pairs (K/M/G suffixes, 0 = "
                             "off/unbounded), e.g. 1M/4M,4M/16M: one hook mode each, with "
                             "telemetry")
    parser.add_argument("--dp-sweep", default="",
                        help="comma-separated PARTITION/CREDIT byte pairs, as --sweep, or "
                             "PARTITION/CREDIT/GROUP[/FIRST] (GROUP: layer-group size, "
                             "FIRST: the first layer group's size, COMMSCHED_FIRST_GROUP_BYTES"
                             "): one data-parallel mode (commsched.wrap) each, telemetry off; "
                             "CREDIT 0: the mode's window of COMMSCHED_GROUPS_IN_FLIGHT "
                             "layer groups")
    parser.add_argument("--telemetry-root", default=None,
                        help="keep each telemetry-recording mode's run directory under this "
                             "directory (default: temporary directories)")
    parser.add_argument("--out", default="bench_results.json", help="JSON output path")
    parser.add_argument("--cpu", action="store_true", help="force gloo on CPU")
    parser.add_argument("--timeout", type=float, default=560.0,
                        help="seconds for the whole command; a launch still running when "
                             "it runs out is terminated and reported (default 560)")
    parser.add_argument("--collective-timeout", type=float, default=180.0,
                        help="process-group timeout in seconds (default 180)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 30)
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    args.models = tuple(WORKLOADS) if args.model == "all" else tuple(
        m.strip() for m in args.model.split(",") if m.strip())
    if not args.models or set(args.models) - set(WORKLOADS):
        parser.error(f"--model {args.model!r}: choose from {', '.join(WORKLOADS)}, all")
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    sweep_names = []
    for flag, build, sizes in (("sweep", sweep_modes, (2,)),
                               ("dp_sweep", dp_sweep_modes, (2, 3, 4))):
        text = getattr(args, flag)
        option = "--" + flag.replace("_", "-")
        try:
            pairs = tuple(_parse_pair(p, sizes) for p in text.split(",") if p.strip())
        except ValueError as exc:
            parser.error(f"{option} {text!r}: {exc}")
        names = [m.name for m in build(pairs)]
        if len(set(names)) != len(names):
            parser.error(f"{option} {text!r}: a pair is given twice")
        setattr(args, flag, pairs)
        sweep_names += names
    measured = [n for n in MODE_NAMES if n not in _FLOORS]
    args.modes = measured if args.modes == "all" else [m.strip() for m in args.modes.split(",")]
    args.variants = tuple(m for m in args.modes if "@" in m)
    for name in args.variants:
        try:
            parse_variant(name)
        except ValueError as exc:
            parser.error(f"--modes: {exc}")
    try:
        args.set = parse_settings(args.set)
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    unknown = set(args.modes) - set(measured) - set(args.variants)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {measured}")
    args.modes += sweep_names
    return args


def _parse_pair(text: str, sizes: Tuple[int, ...] = (2,)) -> Tuple[int, ...]:
    """``PARTITION/CREDIT`` (or, where ``sizes`` allows 3 and 4,
    ``PARTITION/CREDIT/GROUP[/FIRST]``)."""
    parts = text.split("/")
    if len(parts) not in sizes:
        raise ValueError(f"{text.strip()!r} is not PARTITION/CREDIT"
                         + ("[/GROUP[/FIRST]]" if 4 in sizes else ""))
    return tuple(parse_bytes(p, "size") for p in parts)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    models_ = args.models
    regimes = tuple(REGIMES) if args.regime == "all" else (args.regime,)
    backend = benchlib.choose_backend(args.cpu, args.world_size)
    if backend == "gloo":
        print(f"[bench] fewer than {args.world_size} GPUs (or --cpu): gloo on CPU; numbers "
              "are not a benchmark", flush=True)
    document: Dict[str, Any] = {
        "schema": "commsched.bench.harness/1",
        "created_utc": benchlib.utc_now(),
        "command": [sys.executable, *sys.argv],
        "settings": {"models": list(models_), "regimes": list(regimes),
                     "modes": list(args.modes), "quick": args.quick, "warmup": args.warmup,
                     "iters": args.iters, "world_size": args.world_size, "rounds": args.rounds,
                     "sweep": [list(p) for p in args.sweep],
                     "dp_sweep": [list(p) for p in args.dp_sweep], "set": args.set,
                     "telemetry_root": args.telemetry_root, "backend": backend,
                     "ddp_bucket_cap_mb": DDP_BUCKET_CAP_MB, "seed": SEED},
        "parent_env": benchlib.relevant_env(),
        "system": {},
        "launches": [],
    }
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="commsched-bench-") as tmp:
        for regime in regimes:
            spec = LaunchSpec(regime, models_, tuple(args.modes), args.quick, args.warmup,
                              args.iters, benchlib.free_port(), backend,
                              args.collective_timeout, str(Path(tmp) / f"{regime}.json"),
                              args.world_size, args.rounds, args.sweep, args.telemetry_root,
                              args.dp_sweep, args.variants, tuple(args.set.items()))
            remaining = deadline - time.monotonic()
            if remaining < 20:
                launch_doc = run_launch_skipped(spec, "time budget (--timeout) used up")
            else:
                launch_doc = run_launch(spec, remaining)
            document["launches"].append(launch_doc)
            if launch_doc.get("system") and not document["system"]:
                document["system"] = launch_doc["system"]
    if not document["system"]:
        document["system"] = benchlib.system_info()
    benchlib.write_json(Path(args.out), document)
    failures = [f"{run['regime']}/{run['model']}/{r['name']}"
                for launch in document["launches"] for run in launch["runs"]
                for r in run["modes"].values() if r["status"] == "error"]
    print(f"[bench] wrote {args.out}" + (f"; failed: {', '.join(failures)}" if failures
                                         else ""), flush=True)
    print("", flush=True)
    print(headline(document), flush=True)
    print("", flush=True)
    print(results_table(document), flush=True)
    ok = not failures and all(launch["status"] == "ok" for launch in document["launches"])
    return 0 if ok else 1


def run_launch_skipped(spec: LaunchSpec, reason: str) -> Dict[str, Any]:
    """The document of a launch that was not started."""
    doc = {"regime": spec.regime, "backend": spec.backend, "world_size": spec.world_size,
           "env": {}, "system": {}, "runs": [], "status": "error", "error": reason,
           "wall_s": 0.0}
    for model_name in spec.models:
        workload = WORKLOADS[model_name](spec.quick)
        doc["runs"].append(finish_run({
            "regime": spec.regime, "model": model_name, "workload": workload.shape,
            "params": None, "unit": workload.unit,
            "items_per_step": workload.items_per_rank * spec.world_size,
            "failure": f"not run: {reason}", "modes": {}}, spec.table()))
    return doc


if __name__ == "__main__":
    sys.exit(main())
