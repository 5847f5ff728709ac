"""One reporting convention (commsched/errors.py): errors derive from CommschedError,
warnings from CommschedWarning, notices are one line on stderr from rank 0."""

import ast
import builtins
import importlib
import os
import subprocess
import sys
import warnings

import commsched
from commsched import notices
from commsched.config import Config, warn_data_parallel_only
from commsched.data_parallel import DataParallelWarning
from commsched.telemetry import TelemetryWarning


def test_every_warning_commsched_issues_is_a_commsched_warning():
    assert issubclass(commsched.CommschedWarning, UserWarning)
    for category in (TelemetryWarning, DataParallelWarning):
        assert issubclass(category, commsched.CommschedWarning), category
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_data_parallel_only(Config(group_bytes=1 << 20), "DDP hook")
    assert [w.category for w in caught] == [commsched.CommschedWarning]


def test_a_notice_is_one_line_on_rank_0_and_nothing_elsewhere():
    code = ("from commsched import notices; "
            "notices.say('one   line\\n  only'); notices.say('second')")
    out = {}
    for rank in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={"RANK": rank, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        out[rank] = proc.stderr
    assert out == {"0": "commsched: one line only\ncommsched: second\n", "1": ""}


def test_the_start_up_line_names_the_settings_away_from_their_defaults(capsys):
    config = Config(enabled=True, partition_bytes=1 << 10, credit_bytes=4 << 10,
                    telemetry_dir="runs/b")
    notices.started("the DDP hook", config, "runs/b/20261128-120000-000")
    notices.started("the DDP hook", Config(enabled=True))
    assert capsys.readouterr().err.splitlines() == [
        f"commsched: on (version {commsched.__version__}): the DDP hook; settings: "
        "COMMSCHED_PARTITION_BYTES=1KiB, COMMSCHED_CREDIT_BYTES=4KiB; "
        "telemetry: runs/b/20261128-120000-000",
        f"commsched: on (version {commsched.__version__}): the DDP hook; settings: defaults"]


# The package's source folders and the names they install as (setup.py's package_dir).
_SOURCES = {"commsched": "commsched", "hooks": "commsched.hooks",
            "megatron_patches": "commsched.megatron_patches"}
_ROOT = os.path.join(os.path.dirname(__file__), "..")


def _package_sources():
    """(module name, parsed source) of every module of the package."""
    for folder, package in _SOURCES.items():
        for dirpath, _, files in os.walk(os.path.join(_ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(_ROOT, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in sorted(files):
                if name.endswith(".py"):
                    module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    with open(os.path.join(dirpath, name)) as f:
                        yield module, ast.parse(f.read())


def test_the_package_raises_no_builtin_exception_directly():
    """Every error commsched raises is a ``CommschedError`` (a module's ``__getattr__``
    raising AttributeError is the import protocol, not an error of commsched's)."""
    builtin = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}
    found = []
    for module, tree in _package_sources():
        protocol = [(f.lineno, f.end_lineno) for f in tree.body
                    if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Raise) and node.exc is not None
                    and not any(a <= node.lineno <= b for a, b in protocol)):
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in builtin:
                    found.append(f"{module}:{node.lineno} {exc.id}")
    assert not found, found


def test_every_warning_category_the_package_uses_is_a_commsched_warning():
    categories = set()
    for module, tree in _package_sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "warnings"):
                category = (node.args[1] if len(node.args) > 1 else
                            next((k.value for k in node.keywords if k.arg == "category"), None))
                assert isinstance(category, ast.Name), f"{module}:{node.lineno}"
                categories.add((module, category.id))
    assert len(categories) >= 5
    for module, name in categories:
        category = getattr(importlib.import_module(module), name)
        assert issubclass(category, commsched.CommschedWarning), (module, name)
