"""Telemetry that cannot be written never stops training.

Specification (recorder.open_recorder, writer.StoreWriter): when the telemetry directory
cannot be created or written, when the disk fills up during the run, or when the store
reaches COMMSCHED_TELEMETRY_MAX_BYTES, training goes on with the same results, telemetry
turns itself off, and each rank issues exactly one TelemetryWarning saying so.

Two gloo ranks train a small model with DDP + the commsched hook (telemetry on) and with
stock DDP; the final parameters must be bitwise equal (2 ranks: see test_ddp_hook.py).
Faults, one scenario each:
  unwritable_path   COMMSCHED_TELEMETRY_DIR below a regular file (fails even for root)
  readonly_dir      a directory with mode 0o500 (only when the tests do not run as root:
                    root writes there anyway, which is detected and reported as skipped)
  size_cap          COMMSCHED_TELEMETRY_MAX_BYTES=96KiB, reached after a few iterations
  disk_full         RLIMIT_FSIZE=160 KiB on the rank: the kernel refuses writes past it
                    (EFBIG), as a full disk refuses them (ENOSPC)
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings

import pytest

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched.hooks
from commsched import Config
from commsched.telemetry import TelemetryWarning, load_run
from distributed import run_group, run_workers

from .harness import count_fault, count_hang, note

STEPS = 24
SCENARIOS = ("unwritable_path", "readonly_dir", "size_cap", "disk_full")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def _train(rank, config):
    """STEPS iterations; returns final parameters, and the hook state (None: stock DDP)."""
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    state = commsched.hooks.register(ddp, config) if config is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        ddp(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()], state


def _readonly_dir_applies(path) -> bool:
    """Whether mode 0o500 actually stops this process from writing (not as root)."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o500)
    probe = os.path.join(path, f".probe{os.getpid()}")
    try:
        open(probe, "w").close()
    except OSError:
        return True
    os.unlink(probe)
    return False


def _scenario(rank, name, root):
    base = os.path.join(root, name)
    config = Config(enabled=True, partition_bytes=512, credit_bytes=0, policy="fifo",
                    telemetry_dir=os.path.join(base, "run"))
    limit = None
    if name == "unwritable_path":
        config = config.replace(telemetry_dir=os.path.join(root, "a_file", "run"))
    elif name == "readonly_dir":
        if not _readonly_dir_applies(os.path.join(base, "ro")):
            return {"skipped": "running as root: mode 0o500 does not stop writes"}
        config = config.replace(telemetry_dir=os.path.join(base, "ro", "run"))
    elif name == "size_cap":
        config = config.replace(telemetry_max_bytes=96 << 10)
    elif name == "disk_full":
        limit = 160 << 10
    reference, _ = _train(rank, None)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.getsignal(signal.SIGXFSZ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
        try:
            params, state = _train(rank, config)
            recorder = state.recorder
            state.close()
        finally:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, old)
                signal.signal(signal.SIGXFSZ, old_handler)
    telemetry_warnings = [str(w.message) for w in caught
                          if issubclass(w.category, TelemetryWarning)]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(params, reference)),
        "warnings": telemetry_warnings,
        "enabled_after": bool(recorder is not None and recorder.enabled),
        "reason": getattr(recorder, "disabled_reason", None),
        "store": getattr(recorder, "path", None),
    }


def _worker(rank, world, root):
    results = {name: _scenario(rank, name, root) for name in SCENARIOS}
    with open(os.path.join(root, f"result{rank}.json"), "w") as f:
        json.dump(results, f)


def test_training_continues_with_one_warning_when_telemetry_cannot_be_written(tmp_path):
    (tmp_path / "a_file").write_text("a regular file where a directory is expected\n")
    try:
        run_workers(_worker, 2, str(tmp_path), timeout=240)
    except TimeoutError:
        count_hang()
        raise
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    problems, applied = [], []
    for rank, res in enumerate(results):
        for name in SCENARIOS:
            r = res[name]
            if "skipped" in r:
                note(f"telemetry failure scenario {name} not applied: {r['skipped']}")
                continue
            applied.append(name)
            count_fault(f"telemetry write failure during training: {name}")
            if not r["equal"]:
                problems.append(f"rank {rank} {name}: training results differ from stock DDP")
            if len(r["warnings"]) != 1:
                problems.append(f"rank {rank} {name}: {len(r['warnings'])} TelemetryWarnings "
                                f"(expected exactly 1): {r['warnings']}")
            elif "telemetry disabled" not in r["warnings"][0]:
                problems.append(f"rank {rank} {name}: warning does not say telemetry is "
                                f"disabled: {r['warnings'][0]}")
            if r["enabled_after"]:
                problems.append(f"rank {rank} {name}: recorder still enabled")
    assert not problems, "\n".join(problems)
    assert {"unwritable_path", "size_cap", "disk_full"} <= set(applied)
    # The faults struck mid-run, not at open: what was committed before is readable.
    for name in ("size_cap", "disk_full"):
        run = load_run(str(tmp_path / name / "run"))
        assert run.iterations, name
        assert len({i["iteration"] for i in run.iterations}) < STEPS, name


EXIT_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "scripts",
                           "train_ddp_exit.py")
LAUNCHES = 3


def _unprivileged(probe_dir):
    """The argv prefix under which a mode 0o500 directory refuses writes: nothing for a
    user; for root, setpriv dropping the capability that overrides file modes. None where
    that cannot be had."""
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search",
                  "--inh-caps", "-all", "--"]
    probe = os.path.join(probe_dir, "probe")
    r = subprocess.run(prefix + [sys.executable, "-c", f"open({probe!r}, 'w')"],
                       capture_output=True, timeout=60)
    return prefix if r.returncode != 0 else None


def test_a_read_only_telemetry_dir_never_aborts_a_launched_rank(tmp_path):
    """COMMSCHED=1 with COMMSCHED_TELEMETRY_DIR in a read-only directory, under torchrun, a
    script that ends by returning: each rank warns once that telemetry is off and ends
    with status 0. The race this guards against (a gloo worker releasing commsched's last
    collective while the interpreter finalizes, see commsched/workers.py) aborted about
    one launch in three; ``LAUNCHES`` launches catch it most of the time."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    prefix = _unprivileged(str(ro))
    if prefix is None:
        pytest.skip("cannot make a directory read-only for the ranks (root without setpriv)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update({"COMMSCHED": "1", "COMMSCHED_TELEMETRY_DIR": str(ro / "runs")})
    cmd = prefix + [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "127.0.0.1:0", "--log-dir", str(tmp_path / "logs"), "-m", "commsched.run",
                    EXIT_SCRIPT]
    for launch in range(LAUNCHES):
        proc = run_group(cmd, env=env, timeout=180)
        assert "terminate called" not in proc.stderr, f"launch {launch}: " + proc.stderr[-3000:]
        assert proc.returncode == 0, f"launch {launch}: " + proc.stderr[-3000:]
        assert sorted(l.split()[0] for l in proc.stdout.splitlines()) == ["rank=0", "rank=1"]
        for rank in (0, 1):
            assert proc.stderr.count(f"commsched telemetry disabled for rank {rank}:") == 1
    assert os.listdir(ro) == []
