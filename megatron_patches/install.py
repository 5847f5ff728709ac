"""Installing and removing the megatron-core patches.

``apply()`` checks the megatron-core version and the signatures of the methods it replaces
(``versions.py``) before touching anything, then replaces them on the class
``_ParamAndGradBucketGroup`` itself (never a name another module imported), so that every
bucket group, existing or future, resolves to the replacements. ``remove()`` puts the very
same function objects back.

``apply_on_import()`` is what the launcher calls with ``COMMSCHED=1``: it applies the
patches the moment ``megatron.core.distributed.param_and_grad_buffer`` has been imported
(before any model can be built), so that Megatron-LM itself needs no change.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from typing import Optional

from commsched import notices
from commsched.config import Config, warn_data_parallel_only

from . import versions

__all__ = ["apply", "remove", "apply_on_import", "is_applied", "current_runtime", "TARGET"]

TARGET = "megatron.core.distributed.param_and_grad_buffer"
"""The module whose ``_ParamAndGradBucketGroup`` is patched."""

_lock = threading.RLock()
_installed = None          # (class, originals, runtime) while applied
_finder: Optional["_PatchAfterImport"] = None


def apply(config: Optional[Config] = None, *, observer=None) -> None:
    """Route megatron-core's bucket-group gradient syncs and parameter all-gathers through
    one commsched scheduler per process (created on first use).

    ``config`` defaults to ``Config.from_env()``; ``observer`` (default: a telemetry
    recorder when ``config.telemetry_dir`` is set) receives the scheduler's records.
    Raises :class:`~commsched.megatron_patches.UnsupportedMegatronVersion`, having changed
    nothing, for a megatron-core it was not written against. Applying twice is a no-op.
    Call it before the model is wrapped in megatron's DistributedDataParallel.

    Example::
        commsched.megatron_patches.apply(commsched.Config(partition_bytes=4 << 20))
        model = DistributedDataParallel(transformer_config, ddp_config, model)
    """
    global _installed
    with _lock:
        if _installed is not None:
            return
        config = Config.from_env() if config is None else config
        warn_data_parallel_only(config, "Megatron patches")
        module = importlib.import_module(TARGET)
        cls = module._ParamAndGradBucketGroup
        version = versions.megatron_version()
        series = versions.check_supported(cls, version)
        # Imported only now: it needs torch, and megatron is certainly loaded by now.
        from .bucket_group import PATCHED_METHODS, Runtime, make_replacements
        check_module, check_name = series.quantized_param_check
        is_quantized = getattr(importlib.import_module(check_module), check_name)
        originals = {name: cls.__dict__[name] for name in PATCHED_METHODS}
        runtime = Runtime(config, series, originals, is_quantized, observer, version)
        replacements = make_replacements(runtime)
        for name in PATCHED_METHODS:
            setattr(cls, name, replacements[name])
        _installed = (cls, originals, runtime)
        notices.say(f"megatron-core {version} bucket groups patched")


def remove(timeout: Optional[float] = 300.0) -> None:
    """Undo :func:`apply` (and a pending :func:`apply_on_import`): complete what the
    scheduler still has, stop it, and put megatron's original methods back, the same
    function objects. A no-op when nothing is applied."""
    global _installed
    with _lock:
        _uninstall_finder()
        if _installed is None:
            return
        cls, originals, runtime = _installed
        _installed = None
        for name, function in originals.items():
            setattr(cls, name, function)
        runtime.close(timeout)


def is_applied() -> bool:
    """Whether the patches are in place."""
    return _installed is not None


def current_runtime():
    """The applied patches' runtime (``.scheduler``, ``.states``), or None."""
    return None if _installed is None else _installed[2]


def apply_on_import(config: Config) -> None:
    """Apply the patches right after ``megatron.core.distributed.param_and_grad_buffer`` is
    first imported, or now if it already is. An unsupported megatron-core then fails that
    import with the :class:`UnsupportedMegatronVersion` message.

    Example::
        commsched.megatron_patches.apply_on_import(commsched.Config.from_env())
        runpy.run_path("pretrain_gpt.py", run_name="__main__")
    """
    global _finder
    with _lock:
        if _installed is not None:
            return
        if TARGET in sys.modules:
            apply(config)
            return
        if _finder is None:
            _finder = _PatchAfterImport(config)
            sys.meta_path.insert(0, _finder)


def _uninstall_finder() -> None:
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds TARGET through the other finders and wraps its loader, so that the patches are
    applied as soon as the module has executed."""

    def __init__(self, config: Config):
        self.config = config

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ApplyingLoader(spec.loader, self.config)
                return spec
        return None


class _ApplyingLoader(importlib.abc.Loader):
    """Delegates to the real loader; applies the patches once the module has executed."""

    def __init__(self, loader, config: Config):
        self._loader = loader
        self._config = config

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _uninstall_finder()
        apply(self._config)

    def __getattr__(self, name):       # get_source, get_filename, ... for tools
        return getattr(self._loader, name)
