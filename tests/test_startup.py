"""Every process of the job gets the same treatment ([Note: every process of the job] in
docs/design.md): under ``COMMSCHED=1 python -m commsched.run``, a Python process the script
starts (``python child.py``, a ``torch.multiprocessing`` spawn worker) has commsched
installed as the launcher's own process has, once it imports torch; with COMMSCHED=0 in
its environment, or never importing torch, it gets nothing and loads nothing; and a
``sitecustomize`` of the user's that the start-up directory shadows still runs."""

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, sys
before = "torch" in sys.modules
if sys.argv[1] == "torch":
    from torch.nn.parallel import DistributedDataParallel as DDP
    patched = DDP.__init__.__module__ != "torch.nn.parallel.distributed"
else:
    patched = None
print(json.dumps({"torch_at_start": before, "patched": patched,
                  "torch_at_end": "torch" in sys.modules,
                  "user_site": "USER_SITECUSTOMIZE" in sys.modules}))
"""

SCRIPT = """
import json, os, subprocess, sys
import torch.multiprocessing as mp

def spawned(_, queue):
    from torch.nn.parallel import DistributedDataParallel as DDP
    queue.put(DDP.__init__.__module__ != "torch.nn.parallel.distributed")

if __name__ == "__main__":
    child = sys.argv[1]
    out = {}
    for name, env in (("on", os.environ), ("off", {**os.environ, "COMMSCHED": "0"})):
        for imports in ("torch", "nothing"):
            proc = subprocess.run([sys.executable, child, imports], env=env, text=True,
                                  capture_output=True, check=True)
            out[f"{name}/{imports}"] = json.loads(proc.stdout)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(spawned, args=(queue,), nprocs=1)
    out["spawned"] = queue.get()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """What the children of a script under ``COMMSCHED=1 python -m commsched.run`` saw,
    with a user's sitecustomize on PYTHONPATH."""
    tmp = tmp_path_factory.mktemp("startup")
    (tmp / "child.py").write_text(CHILD)
    (tmp / "script.py").write_text(SCRIPT)
    (tmp / "user").mkdir()
    (tmp / "user" / "sitecustomize.py").write_text(
        "import sys\nsys.modules['USER_SITECUSTOMIZE'] = sys\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSCHED")}
    env.update(COMMSCHED="1", PYTHONPATH=str(tmp / "user"))
    proc = subprocess.run([sys.executable, "-m", "commsched.run", str(tmp / "script.py"),
                           str(tmp / "child.py")], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_child_that_imports_torch_has_commsched_installed(seen):
    assert seen["on/torch"]["patched"] is True


def test_a_spawned_worker_has_commsched_installed(seen):
    assert seen["spawned"] is True


def test_with_commsched_0_in_its_environment_a_child_gets_nothing(seen):
    assert seen["off/torch"]["patched"] is False


@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_child_that_never_imports_torch_loads_none(seen, switch):
    assert seen[f"{switch}/nothing"] == {"torch_at_start": False, "patched": None,
                                         "torch_at_end": False, "user_site": True}


def test_the_users_sitecustomize_still_runs(seen):
    assert all(seen[key]["user_site"] for key in ("on/torch", "off/torch"))
