"""The ``commsched`` command: one entry point, one subcommand per job.

    commsched demo                     train a small model on 2 processes, scheduler on
    commsched run SCRIPT [ARGS]        same as python -m commsched.run
    commsched env                      the COMMSCHED_* variables and their current values
    commsched patch-launch SCRIPT      make a Megatron-LM launch script run under commsched
    commsched report RUN_DIR           per-iteration telemetry report
    commsched trace RUN_DIR -o F       Perfetto/Chrome trace of a run
    commsched floor TORCHRUN_ARGS...   how close a DDP script's step is to the overlap floor
    commsched simulate RUN_DIR ...     project a recorded run to N GPUs / other links
    commsched --version                commsched's version
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

# subcommand -> (module, function taking argv and returning an exit code, help)
_COMMANDS = {
    "demo": ("commsched.demo", "main", "train a small model on 2 processes, scheduler on"),
    "run": ("commsched.run", "main", "run a training script under commsched"),
    "env": ("commsched.cli", "env_main", "list COMMSCHED_* variables and validate them"),
    "patch-launch": ("commsched.megatron_patches.launch_script", "main",
                     "rewrite a Megatron-LM launch script to run under commsched"),
    "report": ("commsched.telemetry.report", "report_main", "telemetry report of a run"),
    "trace": ("commsched.telemetry.trace", "trace_main", "Perfetto trace of a run"),
    "floor": ("commsched.floor", "main",
              "time a DDP script's compute only, comm only, both at once and with the "
              "hook: its floor, and where its step goes"),
    "simulate": ("commsched.sim.whatif", "simulate_main",
                 "what-if projection of a recorded run to other cluster sizes"),
}


def env_main(argv: List[str]) -> int:
    """Print every variable commsched reads, its value here, and whether it is valid."""
    import os

    from .config import (ENV_VARS, GROUPS, Config, ConfigError, env_fields, settings_table,
                         shown_value)

    if argv in (["-h"], ["--help"]):
        print("usage: commsched env [--markdown]\n\nList every COMMSCHED_* variable by "
              "concern, its value here (or the default in effect) and its rule; exit 2 if a "
              "value is invalid.\n--markdown prints the settings tables of the README "
              "instead (defaults and rules).")
        return 0
    if argv == ["--markdown"]:
        sys.stdout.write(settings_table())
        return 0
    if argv:
        print(f"commsched env: error: unexpected arguments {argv}", file=sys.stderr)
        return 2
    fields = env_fields()
    width = max(map(len, fields))
    for group in GROUPS:
        print(f"[{group}]")
        for var, f in fields.items():
            if f.metadata["group"] == group:
                value = os.environ.get(var, f"(default {shown_value(f, f.default)})")
                print(f"{var:<{width}} {value:<17} {ENV_VARS[var]}")
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"commsched env: error: {exc}", file=sys.stderr)
        return 2
    return _combinations(config)


def _combinations(config) -> int:
    """The rules that tie settings together, as the data-parallel mode applies them: a
    combination it refuses is an error here too (exit 2), one it would not apply a
    warning line."""
    from .inputs import data_parallel_conflicts, ineffective_settings

    for line in ineffective_settings(config):
        print(f"commsched env: warning: {line}", file=sys.stderr)
    conflicts = data_parallel_conflicts(config)
    for line in conflicts:
        print(f"commsched env: error: {line}", file=sys.stderr)
    return 2 if conflicts else 0


def _usage() -> str:
    lines = ["usage: commsched COMMAND [ARGS...]", "       commsched --version", "",
             "commands:"]
    lines += [f"  {name:<14} {spec[2]}" for name, spec in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)    # no command: an error
        return 0 if argv else 2
    if argv == ["--version"]:
        from .version import __version__

        print(f"commsched {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    spec = _COMMANDS.get(command)
    if spec is None:
        import difflib
        close = difflib.get_close_matches(command, _COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"commsched: error: unknown command {command!r}{hint}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    module_name, function, _ = spec
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"commsched {command}: unavailable: {exc}", file=sys.stderr)
        return 2
    return int(getattr(module, function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
