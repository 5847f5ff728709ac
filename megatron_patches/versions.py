"""Which megatron-core releases the patches support, declared as data, and the check that
runs before anything is patched.

The replacements in ``bucket_group.py`` reproduce the semantics of four methods of
``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup`` (and wrap its
constructor). Those are private methods: a release may change them at any time. So a
release is supported only when it belongs to a series listed in ``SUPPORTED`` *and* every
method the replacements stand in for, or call, still has the signature recorded for that
series. Anything else raises :class:`UnsupportedMegatronVersion` before a single attribute
is touched.

Adding a series means reading its ``param_and_grad_buffer.py``, recording the signatures
below, and naming what changed in ``features`` (see ``bucket_group.py`` for what each
feature switches on).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from typing import Dict, FrozenSet, NamedTuple, Optional, Tuple

from commsched.errors import CommschedError

__all__ = ["UnsupportedMegatronVersion", "MegatronSeries", "SUPPORTED", "megatron_version",
           "check_supported", "signature_text"]


class UnsupportedMegatronVersion(CommschedError, RuntimeError):
    """The installed megatron-core is not one the patches were written against."""


class MegatronSeries(NamedTuple):
    """One supported release series (``major.minor``, any patch level or local suffix)."""

    series: str
    signatures: Dict[str, str]
    """Method of ``_ParamAndGradBucketGroup`` -> its signature without annotations."""
    features: FrozenSet[str]
    """Behaviour of the series that the replacements reproduce beyond 0.16's:
    ``grad_reduce_finished`` (finish_grad_sync is idempotent within an iteration),
    ``extra_main_grads`` (params with a separate higher-precision main_grad are copied into
    the grad buffer before the collective and back after it), ``cudagraph_wgrad_events``
    (start_grad_sync first waits for CUDA-graph weight-gradient events)."""
    quantized_param_check: Tuple[str, str]
    """(module, function) telling whether a parameter has FP8/FP4 storage, whose all-gather
    needs megatron's post-processing (then the original param sync runs)."""


_COMMON_SIGNATURES = {
    "__init__": "(self, buckets, ddp_config, collective_group, collective_group_size)",
    "start_grad_sync": "(self, force_all_reduce=False)",
    "finish_grad_sync": "(self, force_all_reduce=False)",
    "start_param_sync": "(self, force_sync=False)",
    "finish_param_sync": "(self, skip_next_bucket_dispatch=False)",
    "check_grads": "(self, check_for_nan_or_inf, check_for_large)",
}

SUPPORTED: Tuple[MegatronSeries, ...] = (
    MegatronSeries(
        series="0.16",
        signatures=dict(_COMMON_SIGNATURES),
        features=frozenset(),
        quantized_param_check=("megatron.core.fp8_utils", "is_float8tensor"),
    ),
    MegatronSeries(
        series="0.19",
        signatures={**_COMMON_SIGNATURES, "_copy_back_extra_main_grads": "(self)"},
        features=frozenset({"grad_reduce_finished", "extra_main_grads",
                            "cudagraph_wgrad_events"}),
        quantized_param_check=("megatron.core.distributed.param_and_grad_buffer",
                               "_param_uses_quantized_storage"),
    ),
)
"""Supported megatron-core series, oldest first."""

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:[.\w+-]*)\s*$")


def megatron_version() -> str:
    """The version of the megatron-core that is imported (a Megatron-LM checkout reports
    e.g. ``0.19.1+f8837c0``), falling back to the installed distribution's metadata."""
    try:
        from megatron.core import package_info
        return str(package_info.__version__)
    except ImportError:
        return importlib.metadata.version("megatron-core")


def signature_text(function) -> str:
    """``(self, force_sync=False)``: the parameters with their defaults, no annotations."""
    sig = inspect.signature(function)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _supported_list() -> str:
    return ", ".join(f"{s.series}.x" for s in SUPPORTED)


def check_supported(bucket_group_cls, version: Optional[str] = None) -> MegatronSeries:
    """The series entry for ``version`` (default: :func:`megatron_version`), after checking
    that ``bucket_group_cls`` has every method with the recorded signature.

    Raises :class:`UnsupportedMegatronVersion` naming the version, the supported series and
    what differs; it inspects only, it changes nothing.
    """
    version = megatron_version() if version is None else version
    m = _VERSION.match(version)
    series = next((s for s in SUPPORTED if m and s.series == f"{m.group(1)}.{m.group(2)}"),
                  None)
    if series is None:
        raise UnsupportedMegatronVersion(
            f"commsched.megatron_patches: megatron-core {version} is not supported "
            f"(supported: {_supported_list()}); nothing was patched. Run without "
            f"COMMSCHED=1, or install a supported megatron-core.")
    problems = []
    for name, expected in series.signatures.items():
        function = bucket_group_cls.__dict__.get(name)
        if function is None:
            problems.append(f"{name} is missing")
            continue
        found = signature_text(function)
        if found != expected:
            problems.append(f"{name}{found} (expected {name}{expected})")
    module, attr = series.quantized_param_check
    if not callable(getattr(importlib.import_module(module), attr, None)):
        problems.append(f"{module}.{attr} is missing")
    if problems:
        raise UnsupportedMegatronVersion(
            f"commsched.megatron_patches: megatron-core {version} claims series "
            f"{series.series} but {bucket_group_cls.__name__} differs from it: "
            f"{'; '.join(problems)}. Supported: {_supported_list()}; nothing was patched.")
    return series
