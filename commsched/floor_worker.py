"""One rank of a ``commsched floor`` launch; torchrun starts it in place of the script.

    python -m commsched.floor_worker --mode compute|comm|both|hook --iters N --warmup W \\
        [--profile-iters P] [--trace-dir T] --results DIR -- SCRIPT [ARGS...]
        (or -- -m MODULE [ARGS...])

An iteration ends at an ``optimizer.step()`` (the first optimizer that steps; a global
step post-hook, nothing added to the loop). The device is synchronised only at the ends
of the timed window, after step W and after step W+N, so the host runs ahead of the
device as in training. On CUDA, P more steps follow, recorded by torch.profiler
(``telemetry.window``: CUDA activity and a marker kernel at each backward's end and step's
end; none where the script runs a profiler of its own) and read into the result's
``window`` (``step_split.window_figures``); the trace is kept in T where given. After the
last step the script is stopped (every rank counts the same
steps, so every rank stops at the same one, with no collective to agree on it) and this
rank's result goes to ``DIR/<mode>-rank<r>.json``:

    compute   the script, every DistributedDataParallel forward after the first iteration
              inside ``no_sync()`` (DDP prepares its reducer in forward, so the backward
              it feeds reduces nothing); the first iteration syncs, so that DDP rebuilds
              its buckets in the order gradients became ready, and the layout it settled
              on is recorded for ``comm``
    comm      no script: the recorded buckets, one all-reduce each in bucket order per
              iteration, on the backend and device the script used
    both      compute's script, and in each iteration the comm launch's all-reduces issued
              when the first forward starts, asynchronously (on the backend's communication
              stream: nothing orders them after the backward) and waited for before the
              optimizer step: what compute and communication cost each other
    hook      the script with the commsched DDP hook (``commsched.run.install``), no
              telemetry

Each result also counts, over the timed window, the collectives issued on the process
groups involved and the calls of ``torch.autograd.backward``: what says compute only
ran no collective and comm only no backward.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["main"]


# What to report if the process ends inside the script (see _script_launch).
_on_exit: List[Callable[[], dict]] = []


class _WindowDone(BaseException):
    """Raised from the step hook after the last timed iteration: it ends the script the
    way an exception would (its ``finally`` blocks run), and ``except Exception`` in the
    script does not catch it."""


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Counters:
    """Collectives on the process groups seen and backward calls, read at the window's
    ends. A collective is counted by the group's sequence number (None where the backend
    does not keep one)."""

    def __init__(self) -> None:
        self.groups: List[object] = []
        self.backwards = 0
        self.profiled: Optional[object] = None     # the ProfiledWindow while it records
        self._original_backward = torch.autograd.backward

        def backward(*args, **kwargs):
            self.backwards += 1
            if self.profiled is not None:
                self.profiled.backward_started(args[0] if args else kwargs.get("tensors"))
            return self._original_backward(*args, **kwargs)

        torch.autograd.backward = backward

    def add_group(self, group) -> None:
        if group is not None and all(group is not g for g in self.groups):
            self.groups.append(group)

    def read(self) -> Dict[str, Optional[int]]:
        if dist.is_initialized():
            self.add_group(dist.group.WORLD)
        total: Optional[int] = 0
        for group in self.groups:
            try:
                total += int(group._get_sequence_number_for_group())
            except Exception:       # a backend without sequence numbers
                total = None
                break
        return {"collectives": total, "backwards": self.backwards}


class _Window:
    """Times optimizer steps W .. W+N, records P more under the profiler where it can, and
    stops the script after the last."""

    def __init__(self, warmup: int, iters: int, counters: _Counters,
                 on_end: Callable[[], None] = lambda: None, profile_iters: int = 0,
                 trace_path: Optional[str] = None):
        self.warmup, self.iters = warmup, iters
        self.counters = counters
        self.on_end = on_end
        self.optimizer_id: Optional[int] = None
        self.steps = 0
        self.t0 = self.t1 = 0.0
        self.start: Dict[str, Optional[int]] = {}
        self.end: Dict[str, Optional[int]] = {}
        self.step_times: List[float] = []
        self.profile_iters = profile_iters
        self.trace_path = trace_path
        self.profiled = None
        self.figures: Optional[dict] = None
        self.not_measured: Optional[str] = None

    def install(self):
        """Count and time every optimizer step from now on; returns the hook's handle."""
        from torch.optim.optimizer import register_optimizer_step_post_hook
        return register_optimizer_step_post_hook(self.on_step)

    def on_step(self, optimizer, args, kwargs) -> None:
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        if id(optimizer) != self.optimizer_id:
            return
        self.steps += 1
        last = self.warmup + self.iters
        if self.steps == self.warmup:
            _synchronize()
            self.start = self.counters.read()
            self.t0 = time.perf_counter()
            self.step_times.append(self.t0)
        elif self.warmup < self.steps <= last:
            self.step_times.append(time.perf_counter())
        if self.steps == last:
            _synchronize()
            self.t1 = time.perf_counter()
            self.end = self.counters.read()
            self.on_end()
            if not self.start_profile():
                raise _WindowDone()
        elif self.steps > last and self.profiled is not None:
            self.profiled.step_ended()
            if self.steps == last + self.profile_iters:
                self.stop_profile()
                raise _WindowDone()

    def start_profile(self) -> bool:
        """Start the profiled window after the timed one; False where there is none."""
        if self.profile_iters < 1:
            self.not_measured = "not measured: --profile-iters 0"
            return False
        from .telemetry.window import ProfiledWindow

        window = ProfiledWindow(self.profile_iters, self.trace_path)
        if not window.start():
            self.not_measured = window.reason
            return False
        self.profiled = self.counters.profiled = window
        return True

    def stop_profile(self) -> None:
        window, self.profiled, self.counters.profiled = self.profiled, None, None
        try:
            self.figures = window.stop()
        except Exception as exc:    # the timing stands without its window
            traceback.print_exc()
            self.figures = None
            window.reason = (f"not measured: the profiled window could not be read "
                             f"({type(exc).__name__}: {exc})")
        if self.figures is None:
            self.not_measured = window.reason

    def result(self) -> dict:
        count = {k: None if self.start.get(k) is None or self.end.get(k) is None
                 else self.end[k] - self.start[k] for k in ("collectives", "backwards")}
        return {"ms_per_iteration": (self.t1 - self.t0) * 1e3 / self.iters,
                "host_step_ms": [1e3 * (b - a) for a, b in
                                 zip(self.step_times, self.step_times[1:])], **count,
                "window": self.figures, "window_not_measured": self.not_measured}


def _bucket_layout(model) -> List[dict]:
    """The gradient buckets DDP settled on, in bucket order: bytes and dtype of each."""
    try:
        buckets = model.reducer._get_zeros_like_grad_buckets()
        layout = [{"bytes": b.buffer().numel() * b.buffer().element_size(),
                   "dtype": str(b.buffer().dtype).replace("torch.", "")} for b in buckets]
        del buckets
        return layout
    except Exception:       # (private API; or no memory for a copy of the buckets)
        data = model._get_ddp_logging_data()
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        dtypes = str(data.get("dtypes", "float")).split(", ")
        dtype = "float32" if dtypes[0] in ("float", "float32") else dtypes[0]
        return [{"bytes": int(s), "dtype": dtype} for s in sizes.split(",") if s.strip()]


def _watch_ddp(counters: _Counters, models: List[object], compute_only: Callable[[], bool],
               before_forward: Callable[[object], None] = lambda model: None) -> None:
    """Record every DistributedDataParallel the script builds (and its process group);
    with ``compute_only()`` true, run its forwards inside ``no_sync()``; call
    ``before_forward(model)`` before each forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, forward = DDP.__init__, DDP.forward

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models.append(self)
        counters.add_group(getattr(self, "process_group", None))

    def no_sync_forward(self, *args, **kwargs):
        before_forward(self)
        if not compute_only():
            return forward(self, *args, **kwargs)
        with self.no_sync():
            return forward(self, *args, **kwargs)

    DDP.__init__ = __init__
    DDP.forward = no_sync_forward


def _run_target(target: List[str]) -> None:
    """Run the script (or ``-m module``) as ``python`` would, with its arguments."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")


class _Beside:
    """The both launch's collectives: the compute launch's buckets, all-reduced on the
    script's process group, issued before an iteration's first forward and waited for
    before its optimizer step."""

    def __init__(self, layout: List[dict]):
        self.layout = layout
        self.buffers: List[torch.Tensor] = []
        self.works: List[object] = []

    def issue(self, model) -> None:
        if self.works:          # (a later forward of the same iteration)
            return
        if not self.buffers:
            device = next(model.parameters()).device
            self.buffers = [torch.zeros(max(1, b["bytes"] // getattr(torch, b["dtype"]).itemsize),
                                        dtype=getattr(torch, b["dtype"]), device=device)
                            for b in self.layout]
        group = getattr(model, "process_group", None)
        self.works = [dist.all_reduce(b, group=group, async_op=True) for b in self.buffers]

    def wait(self, optimizer, args, kwargs) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


def _script_launch(mode: str, args, rank: int) -> dict:
    counters = _Counters()
    models: List[object] = []
    result: dict = {}
    if mode == "hook":
        from .config import Config
        from .run import install
        install(Config.from_env().replace(enabled=True, telemetry_dir=None))
    beside: Optional[_Beside] = None
    if mode == "both":
        with open(os.path.join(args.results, f"compute-rank{rank}.json")) as f:
            beside = _Beside(json.load(f)["layout"])
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(beside.wait)

    def record_layout() -> None:
        # (at the window's end: the buckets were rebuilt in the second iteration's forward)
        if mode == "compute":
            result["layout"] = [b for m in models for b in _bucket_layout(m)]
            result["backend"] = dist.get_backend() if dist.is_initialized() else None
            params = [p for m in models for p in m.parameters()]
            device = params[0].device if params else torch.device("cpu")
            result["device_type"] = device.type
            result["device_name"] = (torch.cuda.get_device_name(device)
                                     if device.type == "cuda" else None)

    trace = (os.path.join(args.trace_dir, f"{mode}-rank{rank}.json.gz")
             if args.trace_dir else None)
    window = _Window(args.warmup, args.iters, counters, record_layout, args.profile_iters,
                     trace)
    _watch_ddp(counters, models, lambda: mode in ("compute", "both") and window.steps >= 1,
               beside.issue if beside is not None else (lambda model: None))
    window.install()
    ended_early = {"error": f"{' '.join(args.target)} ended after {{steps}} optimizer steps; "
                            f"the measurement needs {args.warmup + args.iters} (--warmup "
                            f"{args.warmup} + --iters {args.iters})"}

    def ended() -> dict:
        if window.steps < args.warmup + args.iters:
            return {"error": ended_early["error"].format(steps=window.steps)}
        # The script ended inside the profiled window: the timing stands, the window not.
        if window.profiled is not None:
            window.profiled = counters.profiled = None
        window.figures = None
        window.not_measured = (f"not measured: the script ended after {window.steps} "
                               f"optimizer steps, inside the profiled window")
        return {**result, **window.result()}

    # A script that ends the process itself (os._exit after its exit handlers) never
    # returns here: say so from an exit handler.
    _on_exit.append(ended)
    try:
        _run_target(args.target)
    except _WindowDone:
        if not models:
            return {"error": "the script built no DistributedDataParallel model"}
        return {**result, **window.result()}
    except SystemExit:
        pass
    return ended()


def _comm_window_reason(reason: Optional[str], backend: str, world_size: int
                        ) -> Optional[str]:
    """The comm launch's window reason, with the cause where it is known: at world size 1
    an in-place NCCL sum all-reduce launches no kernel, so its window runs nothing."""
    from .telemetry.window import NO_DEVICE_ACTIVITY

    if reason == NO_DEVICE_ACTIVITY and backend == "nccl" and world_size == 1:
        return f"{reason}: at world size 1 NCCL's in-place sum launches no kernel"
    return reason


def _comm_launch(args, rank: int) -> dict:
    """The compute launch's buckets, all-reduced alone, W + N iterations."""
    with open(os.path.join(args.results, f"compute-rank{rank}.json")) as f:
        compute = json.load(f)
    backend, device_type = compute["backend"], compute["device_type"]
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    counters = _Counters()
    buffers = [torch.zeros(max(1, b["bytes"] // getattr(torch, b["dtype"]).itemsize),
                           dtype=getattr(torch, b["dtype"]), device=device)
               for b in compute["layout"]]

    def iteration() -> None:
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for work in works:
            work.wait()

    trace = (os.path.join(args.trace_dir, f"comm-rank{rank}.json.gz")
             if args.trace_dir else None)
    window = _Window(args.warmup, args.iters, counters, profile_iters=args.profile_iters,
                     trace_path=trace)
    for _ in range(args.warmup):
        iteration()
    _synchronize()
    window.start, window.t0 = counters.read(), time.perf_counter()
    for _ in range(args.iters):
        iteration()
    _synchronize()
    window.t1, window.end = time.perf_counter(), counters.read()
    if window.start_profile():
        for _ in range(args.profile_iters):
            iteration()
        window.stop_profile()
        window.not_measured = _comm_window_reason(window.not_measured, backend,
                                                  dist.get_world_size())
    return {**window.result(), "layout": compute["layout"], "backend": backend,
            "device_type": device_type}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m commsched.floor_worker --mode M --iters N --warmup W "
              "--results DIR -- SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="commsched.floor_worker")
    p.add_argument("--mode", choices=("compute", "comm", "both", "hook"), required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--profile-iters", type=int, default=0)
    p.add_argument("--trace-dir", default=None)
    args = p.parse_args(argv[:split])
    args.target = argv[split + 1:]
    rank = int(os.environ.get("RANK", 0))
    base = {"mode": args.mode, "rank": rank, "iters": args.iters, "warmup": args.warmup,
            "world_size": int(os.environ.get("WORLD_SIZE", 1))}
    path = os.path.join(args.results, f"{args.mode}-rank{rank}.json")

    def write(out: dict) -> None:
        _on_exit.clear()
        with open(path + ".tmp", "w") as f:
            json.dump({**base, **out}, f)
        os.replace(path + ".tmp", path)

    atexit.register(lambda: _on_exit and write(_on_exit[-1]()))
    try:
        if args.mode == "comm":
            out = _comm_launch(args, rank)
        else:
            out = _script_launch(args.mode, args, rank)
    except Exception as exc:  # the script's own failure, or a setting commsched refused
        traceback.print_exc()
        out = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    write(out)
    # The script was stopped inside its loop: its process group and threads (gloo's,
    # the scheduler's) are still up; end the process without finalizing the interpreter.
    from .workers import exit_worker
    exit_worker(1 if out.get("error") else 0)


if __name__ == "__main__":
    sys.exit(main())
