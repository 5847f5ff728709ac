"""The step split on one GPU, against a hand reading of the same profiled windows, and what
recording a window costs the steps outside it.

    python examples/bench/step_split_check.py --out $OUT [--model gpt2-medium] [--rounds 2]

World size 1, NCCL, a GPT-2 from ``transformers`` (random initialisation from its config,
micro-batch 8, sequence 1024, bf16 autocast, fused AdamW):

1. ``commsched floor --profile-iters P --trace-dir OUT/traces --json`` on ``train_lm.py
   --model M``: the four launches, the hook's split and the both-at-once figures;
2. launches of this script (``--child``), each building the model, W warm-up steps, N
   timed steps, P more steps (recorded by ``ProfiledWindow`` with ``--record 1``, run
   alone with ``--record 0``), N timed steps again: compute only (DDP in ``no_sync``,
   recorded) and, over ``--rounds`` rounds interleaved, the data-parallel mode recorded and
   not; the data-parallel mode's split against compute only, from the package: of the
   timed steps before the window, the device parts from the two windows;
3. a hand reading of each pair of traces by ``hand_read`` below (kernel time summed by
   name, nothing shared with the package): names whose count per iteration differs from
   compute only's, or that compute only lacks, are own work, the others' change is the
   slowdown; the difference to the package's parts per step;
4. recording cost: the timed steps after the window, recorded against not (medians over
   the rounds).

Writes ``OUT/step_split_check.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, List, Optional

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent.parent))


# --- the hand reading: deliberately simple, sharing no code with commsched -----------------

def kernel_ms(path: str, iters: int) -> Dict[str, List[float]]:
    """Compute activity per name in a trace: [instances, ms] per iteration (NCCL kernels
    and the marker kernel left out)."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    out: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])
    devices = defaultdict(int)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            devices[e.get("args", {}).get("device", 0)] += 1
    device = max(devices, key=devices.get)
    for e in doc["traceEvents"]:
        if (e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")
                or e.get("args", {}).get("device", 0) != device):
            continue
        name = e["name"]
        if name.startswith("nccl") or "spin_kernel" in name:
            continue
        out[name][0] += 1 / iters
        out[name][1] += e["dur"] / 1e3 / iters
    return dict(out)


def hand_read(step_trace: str, compute_trace: str, iters: int) -> Dict[str, float]:
    step, base = kernel_ms(step_trace, iters), kernel_ms(compute_trace, iters)
    own = slowed = 0.0
    for name in set(step) | set(base):
        n_s, ms_s = step.get(name, [0.0, 0.0])
        n_b, ms_b = base.get(name, [0.0, 0.0])
        if abs(n_s - n_b) < 1e-9:
            slowed += ms_s - ms_b
        else:
            own += ms_s - ms_b
    return {"own_ms": own, "slowed_ms": slowed,
            "kernel_change_ms": sum(v[1] for v in step.values())
            - sum(v[1] for v in base.values())}


# --- one launch ---------------------------------------------------------------------------

def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commsched
    import models
    import train_lm
    from commsched.telemetry.window import ProfiledWindow

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    quick = args.model == "quick"
    model, shape = train_lm.build(quick, device, args.model)
    config = commsched.Config.from_env().replace(enabled=True, telemetry_dir=None)
    ddp = None
    if args.child == "dp":
        model, optimizer = commsched.wrap(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda), config)
    else:
        ddp = model = DDP(model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens, targets = train_lm.batch(shape, device, 0)
    trace = os.path.join(args.out, "traces", f"child-{args.child}-rec{args.record}-"
                                             f"{args.tag}.json.gz")
    window = ProfiledWindow(args.profile_iters, trace) if args.record else None

    def step(recording: bool) -> None:
        with ddp.no_sync() if ddp is not None else nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = models.lm_loss(model(tokens), targets)
            if recording:
                window.backward_started(loss)
            loss.backward()
        optimizer.step()
        if recording:
            window.step_ended()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step(False)
        sync()
        return (time.perf_counter() - t0) * 1e3 / n

    for _ in range(args.warmup):
        step(False)
    before = timed(args.iters)
    figures = None
    if window is not None and window.start():
        for _ in range(args.profile_iters):
            step(True)
        if args.child == "dp":
            commsched.drain(model)
        try:
            figures = window.stop()
        except Exception as exc:  # noqa: BLE001  (the timing stands; say why)
            window.reason = f"window not read: {type(exc).__name__}: {exc}"
    else:
        for _ in range(args.profile_iters):
            step(False)
    after = timed(args.iters)
    if args.child == "dp":
        commsched.drain(model)
    result = {"child": args.child, "record": args.record, "before_ms": before,
              "after_ms": after, "window": figures, "trace": trace if figures else None,
              "not_measured": None if window is None else window.reason}
    with open(args.result, "w") as f:
        json.dump(result, f)
    os._exit(0)     # (NCCL's and the mode's threads: nothing left to finalize)


# --- the driver ---------------------------------------------------------------------------

def child_env(args) -> Dict[str, str]:
    """No COMMSCHED settings, NVLink multicast off, and this checkout's commsched as
    installed (``commsched.hooks`` inside) first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.site, env.get("PYTHONPATH")) if p)
    env["NCCL_NVLS_ENABLE"] = "0"
    return env


def launch_child(args, kind: str, record: int, tag: str) -> dict:
    path = os.path.join(args.out, f"child-{kind}-rec{record}-{tag}.json")
    cmd = [sys.executable, __file__, "--child", kind, "--record", str(record), "--tag", tag,
           "--result", path, "--out", args.out, "--model", args.model,
           "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--profile-iters", str(args.profile_iters)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=child_env(args))
    if proc.returncode != 0 or not os.path.exists(path):
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"child {kind} record={record} failed ({proc.returncode})")
    print(f"[check] {kind} record={record} {tag}: {time.time() - t0:.0f} s", flush=True)
    with open(path) as f:
        return json.load(f)


def run_floor(args) -> dict:
    env = child_env(args)
    cmd = [sys.executable, "-m", "commsched", "floor", "--iters", str(args.iters), "--warmup",
           str(args.warmup), "--profile-iters", str(args.profile_iters), "--trace-dir",
           os.path.join(args.out, "traces", "floor"), "--json", "--standalone",
           "--nproc-per-node", "1", str(BENCH / "train_lm.py"), "--steps", "1000",
           *(["--quick"] if args.model == "quick" else ["--model", args.model])]
    t0 = time.time()
    # (from the site's directory: ``-m commsched`` must not find the checkout's package,
    # which lacks commsched.hooks, in the working directory)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(args.site))
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"commsched floor failed ({proc.returncode})")
    print(f"[check] commsched floor: {time.time() - t0:.0f} s", flush=True)
    return json.loads(proc.stdout)


def compare(name: str, parts: dict, hand: dict) -> dict:
    """A table row: the package's split (``above_ms`` the timed step above compute only,
    ``window_above_ms`` the windows' difference) against the hand reading."""
    row = {"name": name, **{k: parts.get(k) for k in (
        "above_ms", "window_above_ms", "exposed_ms", "tail_ms", "slowed_ms", "own_ms",
        "host_ms", "rest_ms")},
        "hand_own_ms": hand["own_ms"], "hand_slowed_ms": hand["slowed_ms"],
        "hand_kernel_change_ms": hand["kernel_change_ms"]}
    row["own_diff_ms"] = abs(parts["own_ms"] - hand["own_ms"])
    row["kernel_change_diff_ms"] = abs(parts["own_ms"] + parts["slowed_ms"]
                                       - hand["kernel_change_ms"])
    total = sum(parts[k] for k in ("exposed_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms"))
    row["parts_sum_vs_above"] = total / parts["above_ms"] if parts["above_ms"] else None
    return row


def fmt(v: Optional[float]) -> str:
    return "n/m" if v is None else f"{v:.2f}"


def driver(args) -> int:
    import tempfile

    import torch

    import benchlib
    from commsched.telemetry.step_split import not_measured, split, verdict_line

    os.makedirs(os.path.join(args.out, "traces", "floor"), exist_ok=True)
    args.site = str(benchlib.commsched_site(Path(tempfile.mkdtemp(prefix="split-check-"))))
    cuda = torch.cuda.is_available()
    doc: Dict[str, object] = {"card": torch.cuda.get_device_name(0) if cuda else "CPU",
                              "torch": torch.__version__,
                              "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                                       if cuda else None),
                              "model": args.model, "iters": args.iters,
                              "warmup": args.warmup, "profile_iters": args.profile_iters}
    rows = []
    out_path = os.path.join(args.out, "step_split_check.json")

    def save() -> None:         # after each stage: a run cut short keeps what it measured
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    try:
        floor = run_floor(args)
    except (SystemExit, subprocess.TimeoutExpired) as exc:    # the rest still runs
        print(f"[check] commsched floor: {exc}", file=sys.stderr, flush=True)
        floor = None
    doc["floor"] = floor
    traces = os.path.join(args.out, "traces", "floor")
    if floor is not None and floor["split"].get("own_ms") is not None:
        try:
            hand = hand_read(os.path.join(traces, "hook-rank0.json.gz"),
                             os.path.join(traces, "compute-rank0.json.gz"), args.profile_iters)
            rows.append(compare("hook (floor)", floor["split"], hand))
        except (OSError, ValueError, KeyError) as exc:
            doc["hand_read_error"] = f"{type(exc).__name__}: {exc}"

    doc["rows"] = rows
    save()
    compute = launch_child(args, "compute", 1, "r0")
    runs: Dict[int, List[dict]] = {0: [], 1: []}
    doc["recording"] = {"runs": runs, "compute": compute}
    for r in range(args.rounds):
        for record in ((0, 1) if r % 2 == 0 else (1, 0)):
            runs[record].append(launch_child(args, "dp", record, f"r{r}"))
            save()
    dp = runs[1][0]
    if dp["window"] is not None and compute["window"] is not None:
        # the timed steps before the window, of the launch the window is of
        parts = split(dp["window"], compute["window"],
                      timed_above_ms=dp["before_ms"] - compute["before_ms"])
        rows.append(compare("data-parallel", parts, hand_read(
            dp["trace"], compute["trace"], args.profile_iters)))
    else:
        # (one reason where both windows are missing for it, as on CPU; else each named)
        missing = [(name, r["not_measured"] or "not measured: its result holds no window")
                   for name, r in (("data-parallel", dp), ("compute only", compute))
                   if r["window"] is None]
        reason = (missing[0][1] if len(missing) == 2 and missing[0][1] == missing[1][1]
                  else "; ".join(f"the {name} window: {why}" for name, why in missing))
        parts = not_measured(reason, dp["before_ms"] - compute["before_ms"])
    doc["dp_split"] = parts
    doc["dp_verdict"] = verdict_line(parts)
    after_rec = statistics.median(x["after_ms"] for x in runs[1])
    after_plain = statistics.median(x["after_ms"] for x in runs[0])
    before_rec = statistics.median(x["before_ms"] for x in runs[1])
    doc["recording"] = {"after_recorded_ms": after_rec, "after_not_recorded_ms": after_plain,
                        "before_recorded_ms": before_rec,
                        "cost": after_rec / after_plain - 1,
                        "runs": runs, "compute": compute}
    save()

    print(f"\n{doc['card']}, torch {doc['torch']}, NCCL {doc['nccl']}, {args.model}, world "
          f"size 1; ms per iteration")
    both = floor["both_at_once"] if floor else {}
    print("floor: failed (its output is above)" if floor is None else
          f"floor: compute only {floor['compute_only_ms']:.2f}, comm only "
          f"{floor['comm_only_ms']:.2f}, both at once {floor['both_ms']:.2f}, hook "
          f"{floor['hook_ms']:.2f}; both at once against alone: compute kernels "
          f"{fmt(both['compute_slowed_ms'])} ms, collectives {fmt(both['comm_slowed_ms'])} ms"
          + (f" ({both['not_measured']})" if both.get("not_measured") else ""))
    if floor is not None:
        print(f"hook: {floor['split_verdict']}")
    print(f"data-parallel: {doc['dp_verdict']}")
    rec = doc["recording"]
    print(f"recording cost (data-parallel, {args.rounds} rounds interleaved): steps after the "
          f"window {rec['after_recorded_ms']:.2f} ms recorded vs {rec['after_not_recorded_ms']:.2f}"
          f" not = {100 * rec['cost']:+.2f}%; per round after/before: recorded "
          + ", ".join(f"{x['after_ms']:.2f}/{x['before_ms']:.2f}" for x in runs[1])
          + "; not recorded " + ", ".join(f"{x['after_ms']:.2f}/{x['before_ms']:.2f}"
                                         for x in runs[0]))
    print("| split, ms/step | above (timed) | window above | exposed | tail | slowed | own "
          "| host (profiled) | rest | hand own | own diff | hand kernel change | kernel diff "
          "| parts/above |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | " + " | ".join(fmt(row[k]) for k in (
            "above_ms", "window_above_ms", "exposed_ms", "tail_ms", "slowed_ms", "own_ms",
            "host_ms", "rest_ms", "hand_own_ms", "own_diff_ms", "hand_kernel_change_ms",
            "kernel_change_diff_ms", "parts_sum_vs_above")) + " |")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="gpt2-medium", choices=("gpt2", "gpt2-medium", "quick"),
                   help="GPT-2 small or medium (transformers); quick: train_lm.py's tiny GPT "
                        "(a CPU dry run: no window, every part not measured)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", choices=("compute", "dp"))
    p.add_argument("--record", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--result")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.child:
        child(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
