"""Start-up hook of the Python processes a commsched launch starts.

``python -m commsched.run`` with ``COMMSCHED=1`` puts this directory first on
``PYTHONPATH``, so that every Python process started below it (the ranks Lightning's
launcher starts as ``python train.py``, ``torch.multiprocessing`` spawn workers, a
framework's own workers) imports this module at start-up, as Python does with any
``sitecustomize`` on its path. With ``COMMSCHED=1`` still in its environment, such a
process gets commsched as the launcher gives it (``commsched.run.install``) once torch or
commsched has been imported, so that one that never imports torch pays nothing; with
``COMMSCHED`` unset or 0 nothing happens. Either way the ``sitecustomize`` this one shadows,
if any, runs next. Why this route and not a ``.pth`` file: [Note: every process of the job]
in docs/design.md.
"""

import os
import sys


def _on() -> bool:
    return os.environ.get("COMMSCHED", "").strip() == "1"


# The finder below repeats the shape of megatron_patches.install's on purpose: this module
# runs at interpreter start-up from a bare PYTHONPATH entry and must import nothing of
# commsched (nor torch through it) until torch or commsched is imported by the process.
class _AfterImport:
    """A finder that wraps the loaders of ``torch`` and ``commsched`` so that commsched is
    installed once the outermost of their imports has finished (commsched imports torch:
    installing while commsched itself is half imported would fail)."""

    names = ("torch", "commsched")

    def __init__(self):
        self.busy = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname, self)
                return spec
        return None


class _Loader:
    """Delegates to the real loader, which it puts back on the module once executed."""

    def __init__(self, loader, name, finder):
        self.loader, self.name, self.finder = loader, name, finder

    def __getattr__(self, attribute):
        return getattr(self.loader, attribute)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        busy = self.finder.busy
        busy.add(self.name)
        try:
            self.loader.exec_module(module)
        finally:
            busy.discard(self.name)
            module.__loader__ = self.loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.loader
        if not busy:
            _install(self.finder)


def _install(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        return                                  # (installed already)
    try:
        import commsched.run

        commsched.run.install(commsched.run.Config.from_env())
    except Exception as exc:  # noqa: BLE001 - start-up must not fail the process
        sys.stderr.write(f"commsched: not installed in process {os.getpid()} "
                         f"({' '.join(sys.argv)[:200]}): {type(exc).__name__}: {exc}\n")


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (a distribution's, a user's)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if _on():
    sys.meta_path.insert(0, _AfterImport())
_chain()
