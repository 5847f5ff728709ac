"""The launcher: run an unmodified training script with commsched toggled by environment.

    python -m commsched.run SCRIPT [ARGS...]
    python -m commsched.run -m MODULE [ARGS...]
    torchrun --nproc-per-node 8 -m commsched.run train.py --lr 3e-4

With ``COMMSCHED=1``, every ``DistributedDataParallel`` the script constructs gets the
commsched hook (``Config.from_env()``) at its first forward, unless the script gives it a
comm hook of its own first, and Megatron-core is patched when the script imports it; rank 0
says so in one line, once every rank of the model's group answered that it has the hook.
Every Python process the script starts gets the same, while ``COMMSCHED=1`` is in its
environment (``commsched/startup/``): the ranks Lightning's launcher or ``ddp_spawn``
starts, a framework's workers. A process that trains without giving commsched anything to
schedule says so once (``commsched.unused``).
With ``COMMSCHED`` unset or 0 nothing is patched or registered: the script runs exactly as
it would without commsched, and rank 0 warns once about ``COMMSCHED_*`` settings that then
have no effect. Settings are validated before the script starts, whatever ``COMMSCHED``
says, so a typo never goes unnoticed.
Arguments a launcher puts before the script (``--local-rank=N`` from
torch.distributed.launch) reach the script, as they would without commsched.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
import warnings
from typing import List, Optional

from . import notices, unused
from .config import ENV_VARS, Config, ConfigError
from .errors import CommschedWarning

__all__ = ["main", "install"]

USAGE = "usage: python -m commsched.run [-m MODULE | SCRIPT] [ARGS...]"

# What a launcher puts ahead of the script's own arguments, which are ahead of the
# script's name here: torch.distributed.launch (without --use-env) passes --local-rank=N
# (--local_rank=N before torch 2.0) right after the module it runs.
_INJECTED = re.compile(r"--local[-_]rank=\d+")

_installed: Optional[Config] = None


def install(config: Config) -> None:
    """Make every DistributedDataParallel constructed from now on get the commsched hook
    (``commsched.hooks.launched``), and patch Megatron-core when it is imported.
    Idempotent."""
    global _installed
    if _installed is not None:
        return
    from commsched.hooks import launched

    launched.install(config)
    unused.watch()
    try:
        from commsched import megatron_patches
    except ImportError:  # pragma: no cover - the package always ships it
        megatron_patches = None
    apply_on_import = getattr(megatron_patches, "apply_on_import", None)
    if apply_on_import is not None:
        apply_on_import(config)
    _installed = config


STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")


def pass_on() -> None:
    """Put ``STARTUP_DIR`` first on ``PYTHONPATH``, so that the Python processes started
    from now on install commsched at start-up while ``COMMSCHED=1`` is in their environment
    ([Note: every process of the job] in docs/design.md)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path[:1] != [STARTUP_DIR]:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [STARTUP_DIR] + [p for p in path if p != STARTUP_DIR])


def _unrunnable(module: str) -> str:
    """Why ``-m module`` cannot start (as ``python -m`` would say it), or "" when it can.

    Only a module that cannot be found is reported here; an ImportError raised by code
    that the module's parent packages run while being imported is the script's own error
    and keeps its traceback. Importing the parents is what runpy does next anyway."""
    import importlib.util

    if module.startswith("."):
        return "relative module names are not supported"
    for name in (module, module + ".__main__"):
        try:
            spec = importlib.util.find_spec(name)
        except ValueError as exc:
            return str(exc)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                return str(exc)
            raise
        if spec is None:
            return (f"No module named {name!r}" if name == module else
                    "a package without a __main__ module, so it cannot be run")
        if spec.submodule_search_locations is None:
            return ""           # a module; a package runs its __main__
    return ""


def _warn_without_effect() -> None:
    """Once, from rank 0: the COMMSCHED_* settings given while COMMSCHED is not 1, which
    then do nothing here."""
    names = [var for var in ENV_VARS if var != "COMMSCHED" and var in os.environ]
    if names and notices.is_rank0():
        is_, has = ("is", "it has") if len(names) == 1 else ("are", "they have")
        warnings.warn(
            f"commsched: {', '.join(names)} {is_} set but COMMSCHED=1 is not: the launcher "
            f"patches and registers nothing, so {has} no effect unless the script calls "
            f"commsched itself; set COMMSCHED=1 to turn commsched on", CommschedWarning,
            stacklevel=3)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    injected = []
    while argv and _INJECTED.fullmatch(argv[0]):
        injected.append(argv.pop(0))
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        print(__doc__.split("\n\n")[2] if not argv else __doc__, file=sys.stdout)
        return 2 if not argv else 0
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"commsched: error: {exc}", file=sys.stderr)
        return 2
    module = None
    if argv[0] == "-m":
        if len(argv) < 2:
            print(f"commsched: error: -m needs a module name\n{USAGE}", file=sys.stderr)
            return 2
        module, args = argv[1], injected + argv[2:]
    else:
        script, args = argv[0], injected + argv[1:]
        if not os.path.isfile(script):
            print(f"commsched: error: SCRIPT {script!r} is not a file\n{USAGE}",
                  file=sys.stderr)
            return 2
    if config.enabled:
        install(config)
        pass_on()
    else:
        _warn_without_effect()
    if module is not None:
        problem = _unrunnable(module)
        if problem:
            print(f"commsched: error: -m {module!r}: {problem}\n{USAGE}", file=sys.stderr)
            return 2
        sys.argv = [module] + args
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        # As `python SCRIPT` would: the script's directory first on sys.path.
        sys.argv = [script] + args
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
