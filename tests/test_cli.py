"""The ``commsched`` command itself: --version, env, and the launcher's help."""

import os
import subprocess
import sys

import commsched


def _commsched(*argv, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    return subprocess.run([sys.executable, "-m", "commsched", *argv], capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})})


def test_version():
    proc = _commsched("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0, f"commsched {commsched.__version__}\n", "")


def test_env_shows_the_default_in_effect_for_unset_variables():
    proc = _commsched("env", env={"COMMSCHED_POLICY": "fifo"})
    assert proc.returncode == 0, proc.stderr
    values = {line.split()[0]: line.split()[1:3] for line in proc.stdout.splitlines()}
    assert values["COMMSCHED_POLICY"][0] == "fifo"
    assert values["COMMSCHED"] == ["(default", "0)"]
    assert values["COMMSCHED_GROUP_BYTES"] == ["(default", "256MiB)"]
    assert values["COMMSCHED_TELEMETRY_DIR"] == ["(default", "unset)"]
    assert "(unset)" not in proc.stdout


def test_run_help_speaks_of_behaviour_not_of_invariant_numbers():
    proc = _commsched("run", "--help")
    assert proc.returncode == 0
    assert "invariant" not in proc.stdout.lower()
    assert "nothing is patched or registered" in proc.stdout
    assert "--local-rank=N" in proc.stdout
