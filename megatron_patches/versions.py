"""Which megatron-core releases the patches support, declared as data, and the check that
runs before anything is patched.

The replacements in ``bucket_group.py`` reproduce the semantics of four methods of
``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup`` (and wrap its
constructor). Those are private methods: a release may change them at any time. So a
release is supported only when it belongs to a series listed in ``SUPPORTED`` *and* every
method the replacements stand in for, or call, still has the signature recorded for that
series. Anything else raises :class:`UnsupportedMegatronVersion` before a single attribute
is touched.

A signature can stay while the body changes (0.19's ``start_grad_sync`` waits for the
previous bucket group under the same signature as 0.16's), so each replaced method's body is
pinned too: a digest of its source (:func:`source_hash`, blind to comments, blank lines,
docstrings and line wrapping) per release read.

Adding a series or a release means reading its ``param_and_grad_buffer.py``, recording the
signatures and source digests below, and naming what changed in ``features`` (see
``bucket_group.py`` for what each feature switches on).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import re
import textwrap
import tokenize
from typing import Dict, FrozenSet, NamedTuple, Optional, Tuple

from commsched.errors import CommschedError

__all__ = ["UnsupportedMegatronVersion", "MegatronSeries", "SUPPORTED", "megatron_version",
           "check_supported", "signature_text", "source_hash", "REPLACED"]


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
    sources: Dict[str, FrozenSet[str]]
    """Method in ``REPLACED`` -> the :func:`source_hash` of its body in the releases the
    replacements were written against (``releases``): a body that differs, in a release
    of the same series, changes what the replacement must reproduce."""
    releases: str
    """The releases whose sources were read for ``sources``."""


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
        sources={"start_grad_sync": frozenset({"ddad053efe41e44e"}),
                 "finish_grad_sync": frozenset({"bdc22096978cab08"}),
                 "start_param_sync": frozenset({"3707793e80efe6de"}),
                 "finish_param_sync": frozenset({"7b2a20f89821d031"})},
        releases="0.16.0, 0.16.1",
    ),
    MegatronSeries(
        series="0.19",
        signatures={**_COMMON_SIGNATURES, "_copy_back_extra_main_grads": "(self)"},
        features=frozenset({"grad_reduce_finished", "extra_main_grads",
                            "cudagraph_wgrad_events"}),
        quantized_param_check=("megatron.core.distributed.param_and_grad_buffer",
                               "_param_uses_quantized_storage"),
        sources={"start_grad_sync": frozenset({"e6e1edea97e84046"}),
                 "finish_grad_sync": frozenset({"e55910bfe8fd880e"}),
                 "start_param_sync": frozenset({"fed4d3afd96534ad"}),
                 "finish_param_sync": frozenset({"4d09ddb24e5985d1"})},
        releases="0.19.0, 0.19.1, 0.19.2 and the core_r0.19.0 branch",
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


# The methods the replacements stand in for: their bodies, not only their signatures, must be
# those of a release the replacements were written against.
REPLACED = ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync")


def source_hash(source: str) -> str:
    """A digest of a function's source that ignores what does not change its behaviour:
    comments, blank lines, line breaks inside brackets and the docstring. Computed from
    tokens (indentation kept as block markers, an f-string one token as before Python
    3.12), so it is the same on every Python version."""
    source = textwrap.dedent(source)
    function = ast.parse(source).body[0]
    first = function.body[0]
    docstring = (range(first.lineno, first.end_lineno + 1)
                 if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                 and isinstance(first.value.value, str) else range(0))
    kept = []
    for tok in _tokens(source):
        if tok.type in _IGNORED or (tok.start[0] in docstring and tok.type not in _BLOCKS):
            continue
        kept.append(tok.string if tok.type not in _MARKERS else _MARKERS[tok.type])
    return hashlib.sha256("\x1f".join(kept).encode()).hexdigest()[:16]


def _tokens(source: str):
    """``source``'s tokens, an f-string as one STRING token of its source text on every
    Python (3.12 and later split it into FSTRING_START, its parts and FSTRING_END)."""
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    lines = source.splitlines(keepends=True)
    depth, first = 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if fstring_start is not None and tok.type == fstring_start:
            depth += 1
            if depth == 1:
                first = tok
            continue
        if depth:
            if tok.type == fstring_end:
                depth -= 1
                if depth == 0:
                    yield tokenize.TokenInfo(tokenize.STRING,
                                             _text(lines, first.start, tok.end),
                                             first.start, tok.end, first.line)
            continue
        yield tok


def _text(lines, start, end) -> str:
    """The source text from ``start`` to ``end`` (tokenize's (row, column) positions)."""
    (row0, col0), (row1, col1) = start, end
    if row0 == row1:
        return lines[row0 - 1][col0:col1]
    return (lines[row0 - 1][col0:] + "".join(lines[row0:row1 - 1])
            + lines[row1 - 1][:col1])


_IGNORED = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
_BLOCKS = (tokenize.INDENT, tokenize.DEDENT)
_MARKERS = {tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>",
            tokenize.NEWLINE: "<newline>"}


def _body_hash(function) -> Optional[str]:
    try:
        return source_hash(inspect.getsource(function))
    except (OSError, TypeError, SyntaxError):
        return None


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
        elif name in series.sources:
            digest = _body_hash(function)
            if digest not in series.sources[name]:
                found_text = "source unavailable" if digest is None else f"source {digest}"
                problems.append(
                    f"the body of {name} is not that of megatron-core {series.releases}, "
                    f"which the replacement reproduces ({found_text})")
    module, attr = series.quantized_param_check
    if not callable(getattr(importlib.import_module(module), attr, None)):
        problems.append(f"{module}.{attr} is missing")
    if problems:
        raise UnsupportedMegatronVersion(
            f"commsched.megatron_patches: megatron-core {version} claims series "
            f"{series.series} but {bucket_group_cls.__name__} differs from it: "
            f"{'; '.join(problems)}. Supported: {_supported_list()}; nothing was patched.")
    return series
