"""``commsched patch-launch`` never leaves a half-written launch script.

Specification (launch_script._write_atomic): the patched text goes to a temporary file in
the target's directory, is flushed and fsynced, then renamed over the target. When any step
fails (disk full in the middle of the write, fsync error, chmod or rename refused, an
interrupt), the target keeps its previous bytes (or does not appear, for a new ``-o``
file), no temporary file is left behind, and the command exits 1 with a message naming the
target (an interrupt propagates as such).
"""

from __future__ import annotations

import errno
import os

import pytest

from commsched.megatron_patches import launch_script

from .harness import REPO, count_fault, run_forked

FIXTURE = os.path.join(REPO, "tests", "fixtures", "launch", "torchrun_basic.sh")


class _HalfWriter:
    """A file object whose write() stores the first half of the data, then fails."""

    def __init__(self, f, exc):
        self._f, self._exc = f, exc

    def write(self, data):
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fail_mid_write(exc):
    real = os.fdopen

    def fdopen(fd, *args, **kwargs):
        return _HalfWriter(real(fd, *args, **kwargs), exc)
    return ("fdopen", fdopen)


def _fail(name, exc):
    def fn(*args, **kwargs):
        raise exc
    return (name, fn)


FAULTS = {
    "disk full mid-write":
        lambda: _fail_mid_write(OSError(errno.ENOSPC, "No space left on device")),
    "I/O error mid-write": lambda: _fail_mid_write(OSError(errno.EIO, "Input/output error")),
    "fsync fails": lambda: _fail("fsync", OSError(errno.EIO, "Input/output error")),
    "chmod refused":
        lambda: _fail("chmod", PermissionError(errno.EPERM, "Operation not permitted")),
    "rename refused": lambda: _fail("replace", OSError(errno.EXDEV, "Invalid cross-device link")),
    "rename: disk full": lambda: _fail("replace", OSError(errno.ENOSPC, "No space left on device")),
}
TARGETS = ("in-place", "-o existing", "-o new")


def _setup(tmp_path, target_kind):
    d = tmp_path / "work"
    d.mkdir()
    script = d / "train.sh"
    script.write_bytes(open(FIXTURE, "rb").read())
    script.chmod(0o755)
    if target_kind == "in-place":
        return d, script, ["--in-place", str(script)], script
    out = d / "patched.sh"
    if target_kind == "-o existing":
        out.write_text("#!/bin/bash\necho previous version\n")
    return d, script, ["-o", str(out), str(script)], out


def _snapshot(d):
    return {p: open(os.path.join(d, p), "rb").read() for p in sorted(os.listdir(d))}


@pytest.mark.parametrize("target_kind", TARGETS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_write_leaves_the_target_unchanged_and_no_temp_file(tmp_path, monkeypatch,
                                                                     capsys, fault, target_kind):
    d, script, argv, target = _setup(tmp_path, target_kind)
    before = _snapshot(d)
    name, replacement = FAULTS[fault]()
    monkeypatch.setattr(launch_script.os, name, replacement)
    count_fault(f"patch-launch write: {fault}")
    rc = launch_script.main(["--set", "COMMSCHED=1", *argv])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 1
    assert str(target) in err and "cannot write" in err, err
    assert _snapshot(d) == before          # same files, same bytes: no temp file, no target


def test_an_interrupt_mid_write_leaves_the_target_unchanged(tmp_path, monkeypatch):
    d, script, argv, target = _setup(tmp_path, "in-place")
    before = _snapshot(d)
    name, replacement = _fail_mid_write(KeyboardInterrupt())
    monkeypatch.setattr(launch_script.os, name, replacement)
    count_fault("patch-launch write: interrupt")
    with pytest.raises(KeyboardInterrupt):
        launch_script.main(["--in-place", str(script)])
    monkeypatch.undo()
    assert _snapshot(d) == before


def test_a_real_file_size_limit_leaves_the_target_unchanged(tmp_path):
    """Not a simulation: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG) past 8 KiB,
    in a child process, for a launch script larger than that."""
    d = tmp_path / "work"
    d.mkdir()
    script = d / "big.sh"
    body = open(FIXTURE).read()
    script.write_text("# padding line to make the script large\n" * 1000 + body)
    script.chmod(0o755)
    before = _snapshot(d)
    assert os.path.getsize(script) > 16 * 1024
    count_fault("patch-launch write: RLIMIT_FSIZE")
    r = run_forked("cli", ["patch-launch", "--in-place", "--set", "COMMSCHED=1", str(script)],
                   cwd=str(d), timeout=60, limits={"fsize": 8 * 1024})
    assert r.rc == 1, r.describe()
    assert "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _snapshot(d) == before
