"""Nothing executes from configuration.

1. The package sources (commsched/, hooks/, megatron_patches/) contain no eval/exec/compile,
   no unpickling (pickle/marshal/shelve/dill, torch.load, numpy.load with pickles), no
   yaml.load, no os.system/os.popen/os.exec*/os.spawn*, no call with shell=True, and no
   import or run of a module/file whose name is not a literal (__import__,
   importlib.import_module, importlib.util.find_spec, runpy.*) — except the occurrences in
   ALLOWED, each justified. An ALLOWED entry that no longer matches fails the test too, so
   the list stays exact. The scan reads the syntax tree (docstrings and comments do not
   count) and resolves import aliases.
2. Values with shell metacharacters or Python code are data: COMMSCHED_TELEMETRY_DIR is a
   directory of exactly that name under the cwd, and `patch-launch --set` exports the value
   literally when the shell runs the patched script.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

from commsched.megatron_patches.launch_script import patch_script
from commsched.telemetry import load_run

from .harness import (PACKAGE_DIRS, REPO, clean_env, count_input, run_forked,
                      run_parallel, run_subprocess)

ALWAYS = {"eval", "exec", "compile", "breakpoint", "pickle.load", "pickle.loads",
          "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
          "cPickle.loads", "dill.load", "dill.loads", "marshal.load", "marshal.loads",
          "shelve.open", "yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load",
          "yaml.unsafe_load_all", "yaml.full_load_all", "torch.load", "os.system", "os.popen",
          "code.interact", "pty.spawn"}
PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn")
# Execute/import what their first argument names: fine with a literal, flagged otherwise.
BY_NAME = {"__import__", "importlib.import_module", "importlib.__import__",
           "importlib.util.find_spec", "runpy.run_path", "runpy.run_module", "runpy.run_code"}

# (file, callee, source of the call): why it cannot execute configuration.
ALLOWED: Dict[Tuple[str, str, str], str] = {
    ("commsched/cli.py", "importlib.import_module", "importlib.import_module(module_name)"):
        "module_name is looked up in the static _COMMANDS table by the subcommand name; "
        "an unknown subcommand is rejected before",
    ("megatron_patches/install.py", "importlib.import_module",
     "importlib.import_module(check_module)"):
        "check_module comes from versions.SUPPORTED, a static table of the package",
    ("megatron_patches/versions.py", "importlib.import_module",
     "importlib.import_module(module)"):
        "module comes from a series of versions.SUPPORTED, a static table of the package",
    ("commsched/run.py", "runpy.run_module",
     'runpy.run_module(module, run_name="__main__", alter_sys=True)'):
        "the launcher's job: run the module named by -m on its own command line (argv, "
        "never the environment), as python -m does",
    ("commsched/run.py", "runpy.run_path", 'runpy.run_path(script, run_name="__main__")'):
        "the launcher's job: run the script named on its own command line (argv)",
    ("commsched/run.py", "importlib.util.find_spec", "importlib.util.find_spec(name)"):
        "checks that the -m module from the launcher's command line exists before runpy "
        "runs it (imports its parent packages, as runpy would next)",
    ("commsched/floor_worker.py", "runpy.run_module",
     'runpy.run_module(target[1], run_name="__main__", alter_sys=True)'):
        "commsched floor's job: run the -m module its command line names (argv, never the "
        "environment), in each rank torchrun starts, as python -m does",
    ("commsched/floor_worker.py", "runpy.run_path",
     'runpy.run_path(target[0], run_name="__main__")'):
        "commsched floor's job: run the script its command line names (argv), in each rank "
        "torchrun starts",
}


def _dotted(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, source: str):
        self.source = source
        self.aliases: Dict[str, str] = {}
        self.constants: Dict[str, str] = {}
        self.hits: List[Tuple[str, str, int]] = []       # (callee, source, line)

    def visit_Import(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        for a in node.names:
            if node.module and node.level == 0:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _resolve(self, node) -> Optional[str]:
        name = _dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        head = self.aliases.get(head, head)
        return f"{head}.{rest}" if rest else head

    def _literal(self, node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return True
        return isinstance(node, ast.Name) and node.id in self.constants

    def visit_Call(self, node):
        callee = self._resolve(node.func) or ""
        flagged = callee in ALWAYS or callee.startswith(PREFIXES)
        if callee in BY_NAME:
            flagged = not (node.args and self._literal(node.args[0]))
        if callee.endswith("numpy.load") or callee == "np.load":
            flagged = any(k.arg == "allow_pickle" and not (
                isinstance(k.value, ast.Constant) and k.value.value is False)
                for k in node.keywords)
        if any(k.arg == "shell" and not (isinstance(k.value, ast.Constant) and
                                         k.value.value is False) for k in node.keywords):
            flagged, callee = True, callee + " (shell=True)"
        if flagged:
            self.hits.append((callee, ast.get_source_segment(self.source, node) or "",
                              node.lineno))
        self.generic_visit(node)


def scan(source: str) -> List[Tuple[str, str, int]]:
    tree = ast.parse(source)
    scanner = _Scanner(source)
    # Module-level NAME = "literal" assignments count as literals (TARGET = "megatron...").
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and \
                isinstance(stmt.value.value, str):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    scanner.constants[t.id] = stmt.value.value
    for node in ast.walk(tree):                   # imports anywhere, before the calls
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scanner.visit(node)
    scanner.visit(tree)
    return scanner.hits


def package_files() -> List[str]:
    out = []
    for top in PACKAGE_DIRS:
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_the_scanner_finds_every_form():
    sample = '''
import pickle as pk, subprocess, os, yaml, runpy, importlib
from marshal import loads as ml
from importlib import import_module
import torch
"""eval(x) in a docstring does not count"""
eval(text); exec(code); compile(src, "f", "exec")
pk.loads(blob); ml(blob); yaml.load(s); torch.load(path)
subprocess.run(cmd, shell=True); subprocess.Popen(cmd, shell=flag); os.system(cmd)
os.popen(cmd); os.execvp(a, b); __import__(name); import_module(name)
importlib.import_module(name); runpy.run_path(p)
importlib.import_module("json"); subprocess.run(["ls"], shell=False); yaml.safe_load(s)
'''
    expected = ["eval", "exec", "compile", "pickle.loads", "marshal.loads", "yaml.load",
                "torch.load", "subprocess.run (shell=True)", "subprocess.Popen (shell=True)",
                "os.system", "os.popen", "os.execvp", "__import__", "importlib.import_module",
                "importlib.import_module", "runpy.run_path"]
    count_input("no-exec scanner self-test forms", len(expected) + 3)
    assert [callee for callee, _, _ in scan(sample)] == expected


def test_package_sources_execute_nothing_from_configuration():
    files = package_files()
    assert len(files) >= 20, files
    count_input("package source files scanned", len(files))
    unexpected, used = [], set()
    for path in files:
        rel = os.path.relpath(path, REPO)
        with open(path, encoding="utf-8") as f:
            for callee, source, line in scan(f.read()):
                key = (rel, callee, source)
                if key in ALLOWED:
                    used.add(key)
                else:
                    unexpected.append(f"{rel}:{line}: {callee}: {source}")
    assert not unexpected, "code execution from a non-literal name:\n" + "\n".join(unexpected)
    stale = set(ALLOWED) - used
    assert not stale, f"ALLOWED entries that match nothing any more: {sorted(stale)}"


# --- values are data ---------------------------------------------------------------------------

PATH_VALUES = ["$(touch pwned)", "`touch pwned`", "; touch pwned", "| touch pwned",
               "$HOME", "~", "${IFS}x", "%s%n", "{0.__class__}", "a b",
               "--help", "-rf", "run\\dir", "\u2603", "runs/\u00fcn\u00efc\u00f6d\u00e9",
               "__import__('os').system('touch pwned')", "'; touch pwned; '"]


def test_telemetry_dir_with_metacharacters_is_a_literal_directory(tmp_path):
    """The recorder opened from COMMSCHED_TELEMETRY_DIR=<value> writes <cwd>/<value>/
    rank0.sqlite, and the cwd holds nothing else (in forked children)."""
    count_input("COMMSCHED_TELEMETRY_DIR values with metacharacters", len(PATH_VALUES))

    def one(item):
        k, value = item
        cwd = tmp_path / f"c{k}"
        cwd.mkdir()
        env = clean_env({"COMMSCHED_TELEMETRY_DIR": value})
        r = run_forked("reliability.children:open_recorder_here", value, env=env,
                       cwd=str(cwd), timeout=60)
        problems = []
        if r.rc != 0:
            problems.append(f"exit {r.rc}: {r.stderr[-500:]}")
        store = os.path.join(str(cwd), value, "rank0.sqlite")
        if not os.path.isfile(store):
            problems.append(f"no store at {store!r}")
        top = value.split("/")[0]
        if sorted(os.listdir(cwd)) != [top]:
            problems.append(f"cwd holds {sorted(os.listdir(cwd))}, expected [{top!r}]")
        if any("pwned" == f for _, _, fs in os.walk(tmp_path) for f in fs):
            problems.append("a file named pwned was created")
        return [f"  {value!r}: {p}" for p in problems]

    failures = [p for ps in run_parallel(one, list(enumerate(PATH_VALUES)), workers=3)
                for p in ps]
    assert not failures, "\n".join(failures)


TRAIN = """\
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DDP(torch.nn.Linear(8, 4))
for _ in range(3):
    model(torch.randn(2, 8)).sum().backward()
print("hooks", [type(s).__name__ for _, s in model._comm_hooks], flush=True)
dist.destroy_process_group()
"""


def test_launcher_treats_a_shell_command_in_the_telemetry_dir_as_a_name(tmp_path):
    """End to end, a real ``python -m commsched.run``: COMMSCHED_TELEMETRY_DIR='$(touch
    pwned)' makes a directory literally so named, in the cwd, holding the run's store."""
    work = tmp_path / "work"
    cwd = tmp_path / "cwd"
    work.mkdir()
    cwd.mkdir()
    (work / "train.py").write_text(TRAIN)
    value = "$(touch pwned)"
    env = clean_env({"COMMSCHED": "1", "COMMSCHED_TELEMETRY_DIR": value})
    count_input("launcher telemetry dir with a shell command")
    r = run_subprocess([sys.executable, "-m", "commsched.run", str(work / "train.py"),
                        str(work / "pg")], env=env, cwd=str(cwd), timeout=180)
    assert r.rc == 0, r.describe()
    assert "hooks ['CommschedState']" in r.stdout, r.stdout
    assert os.listdir(cwd) == [value]
    run = load_run(str(cwd / value))
    assert run.iterations
    created = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert "pwned" not in created


EXPORT_VALUES = ["$(touch pwned)", "`touch pwned`", "; touch pwned", "a'b\"c",
                 "x\ny; touch pwned", "$HOME", "\\$(touch pwned)", "\u2603 spaced value"]


def test_patch_launch_exports_values_literally(tmp_path):
    """bash runs the patched script's export block: every value arrives unchanged."""
    count_input("patch-launch --set values with metacharacters", len(EXPORT_VALUES))
    script = "#!/bin/bash\ntorchrun --nproc_per_node 2 pretrain_gpt.py\n"
    for k, value in enumerate(EXPORT_VALUES):
        patched = patch_script(script, {"COMMSCHED_TELEMETRY_DIR": value})
        block = patched.split("torchrun")[0]
        probe = block + 'printf "%s" "$COMMSCHED_TELEMETRY_DIR"\n'
        cwd = tmp_path / f"b{k}"
        cwd.mkdir()
        out = subprocess.run(["bash", "-c", probe], cwd=cwd, capture_output=True,
                             timeout=30, env={"PATH": os.environ.get("PATH", ""),
                                              "HOME": "/nonexistent"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.decode() == value
        assert os.listdir(cwd) == []
