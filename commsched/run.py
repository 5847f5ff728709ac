"""The launcher: run an unmodified training script with commsched toggled by environment.

    python -m commsched.run SCRIPT [ARGS...]
    python -m commsched.run -m MODULE [ARGS...]
    torchrun --nproc-per-node 8 -m commsched.run train.py --lr 3e-4

With ``COMMSCHED=1``, every ``DistributedDataParallel`` the script constructs gets the
commsched hook (``Config.from_env()``), and Megatron-core is patched when the script imports
it. With ``COMMSCHED`` unset or 0 nothing is patched or registered: the script runs exactly
as it would without commsched (invariant 3). Settings are validated before the script
starts, whatever ``COMMSCHED`` says, so a typo never goes unnoticed.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from .config import Config, ConfigError

__all__ = ["main", "install"]

USAGE = "usage: python -m commsched.run [-m MODULE | SCRIPT] [ARGS...]"

_installed: Optional[Config] = None


def install(config: Config) -> None:
    """Make every DistributedDataParallel constructed from now on register the commsched
    hook, and patch Megatron-core when it is imported. Idempotent."""
    global _installed
    if _installed is not None:
        return
    from torch.nn.parallel import DistributedDataParallel

    from commsched.hooks import register

    original_init = DistributedDataParallel.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        register(self, config)

    __init__.__wrapped__ = original_init
    DistributedDataParallel.__init__ = __init__
    try:
        from commsched import megatron_patches
    except ImportError:  # pragma: no cover - the package always ships it
        megatron_patches = None
    apply_on_import = getattr(megatron_patches, "apply_on_import", None)
    if apply_on_import is not None:
        apply_on_import(config)
    _installed = config


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
        module, args = argv[1], argv[2:]
    else:
        script, args = argv[0], argv[1:]
        if not os.path.isfile(script):
            print(f"commsched: error: SCRIPT {script!r} is not a file\n{USAGE}",
                  file=sys.stderr)
            return 2
    if config.enabled:
        install(config)
    if module is not None:
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
