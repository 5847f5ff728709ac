"""commsched configuration: one dataclass, parsed once, at the edge.

Every knob has a field here with its meaning, its environment variable and its default.
``Config.from_env()`` is the only place that reads ``COMMSCHED*`` variables; everything
downstream receives a validated ``Config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Literal, Mapping, Optional, get_args

from .errors import CommschedError, CommschedWarning

__all__ = ["Config", "ConfigError", "parse_bytes", "ENV_VARS", "MAX_BYTES", "REMOVED",
           "field_docs", "settings_table", "warn_data_parallel_only"]


class ConfigError(CommschedError, ValueError):
    """A configuration value was rejected; the message names the variable or argument."""


Policy = Literal["priority", "fifo"]
Decompose = Literal["none", "rs_ag", "hier", "leader", "auto"]
ReduceDtype = Literal["bfloat16", "float16"]
POLICIES = get_args(Policy)
REDUCE_DTYPES = get_args(ReduceDtype)
DECOMPOSITIONS = get_args(Decompose)

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
}
# ASCII digits only (\d would take any Unicode digit), at most 16 of them (int() of a
# 5000-digit string raises ValueError, not a ConfigError).
_BYTES_RE = re.compile(r"^\s*([0-9]{1,16})\s*([a-zA-Z]*)\s*$", re.ASCII)
_INT_RE = re.compile(r"^\s*([0-9]{1,12})\s*$", re.ASCII)
# Far above any gradient bucket; guards against typos such as 4000GiB. Every byte field's
# upper bound.
MAX_BYTES = 1 << 40


# Variables that were settings once, and what took their place: setting one is an error
# that says so, never silence.
REMOVED = {
    "COMMSCHED_DISPATCH": "collectives are always issued by the thread that submits them "
                          "(the dispatch thread is gone)",
}


def _byte_count(text: str) -> Optional[re.Match]:
    """``text`` as a number and a known unit, or None."""
    m = _BYTES_RE.match(text)
    return m if m and m.group(2).lower() in _BYTE_UNITS else None


def parse_bytes(text: str, name: str) -> int:
    """Parse ``"4194304"``, ``"4MiB"``, ``"64kb"`` or ``"inf"`` into a byte count.

    ``inf`` (or ``0`` where the field allows it) means unbounded and is returned as 0.
    ``name`` is the variable or argument named in the error message.
    """
    if text.strip().lower() in ("inf", "unlimited"):
        return 0
    m = _byte_count(text)
    if m is None:
        raise ConfigError(
            f"{name}={text!r}: expected a byte count such as 4194304, 4MiB, 512KiB, 1GiB or inf"
        )
    value = int(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if value > MAX_BYTES:
        raise ConfigError(f"{name}={text!r}: {value} bytes is larger than the 1 TiB limit")
    return value


def _env(var: str, minimum: int = 0, maximum: int = MAX_BYTES, zero: str = "",
         data_parallel: bool = False) -> dict:
    """Field metadata: the variable, an int field's range, for a byte count what 0 means
    where that is not "unbounded" (``inf`` is then refused rather than read as 0), and
    whether only the data-parallel mode reads it (the DDP hook and the Megatron patches
    send the buckets their framework hands them). The field's description is its attribute
    docstring (see ``field_docs``)."""
    return {"env": var, "min": minimum, "max": maximum, "zero": zero,
            "data_parallel": data_parallel}


@dataclass(frozen=True)
class Config:
    """Validated commsched settings. Construct directly, or with ``Config.from_env()``.

    Each field's attribute docstring is its one description: its first paragraph is the
    help of ``commsched env`` and the README's settings table (``commsched env
    --markdown``)."""

    enabled: bool = field(default=False, metadata=_env("COMMSCHED"))
    """Master switch of the launcher, 0 or 1: with 0 (or unset) nothing is patched or
    registered and training runs exactly as without commsched."""

    partition_bytes: int = field(default=0, metadata=_env("COMMSCHED_PARTITION_BYTES"))
    """Chunk size requests are cut into (a remainder under 1/8 of it rides with the last
    chunk); 0 or inf: whole requests. A chunk of a more urgent request can then go before
    the queued chunks of others.

    Every chunk is one more collective to issue. The data-parallel mode cuts its layer
    groups' all-reduces unless a window of whole groups applies (``groups_in_flight``);
    rs_ag never cuts its reduce-scatters and all-gathers."""

    credit_bytes: int = field(default=0, metadata=_env("COMMSCHED_CREDIT_BYTES"))
    """Credit window: most bytes in flight per process group; 0 or inf: unbounded. A
    chunk larger than the window goes alone once nothing else is in flight.

    A bounded window returns credit as collectives end on the device, through the lane's
    completion thread: each chunk then costs a wake-up of that thread, and on a fast link
    the window starves it. The data-parallel mode, where this is unbounded, gets a window
    of whole layer groups instead (``groups_in_flight``)."""

    group_bytes: int = field(default=256 << 20, metadata=_env(
        "COMMSCHED_GROUP_BYTES", zero="one layer group per module", data_parallel=True))
    """Data-parallel mode (``commsched.wrap``): a layer group, the unit of communication
    and of optimizer update, closes at a module boundary once it holds this many bytes of
    gradients; 0: one group per module. ``wrap(group_bytes=...)`` overrides it.

    Each group is one request per iteration: smaller groups overlap more but cost more
    host time per iteration, larger ones expose more of the last group's communication."""

    first_group_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_FIRST_GROUP_BYTES", zero="off", data_parallel=True))
    """Data-parallel mode: the layer group holding the model's first layers closes once it
    holds this many bytes of gradients, each next group at twice the one before, up to
    ``group_bytes``; 0: off (every group ``group_bytes``).

    The first layers' group is reduced last in backward and needed first by the next
    forward: no compute hides its all-reduce. A smaller one shortens that wait, for a few
    more requests per iteration."""

    groups_in_flight: int = field(default=0, metadata=_env(
        "COMMSCHED_GROUPS_IN_FLIGHT", maximum=1 << 20, data_parallel=True))
    """Data-parallel mode, decompose none, with the credit window unbounded: at most this
    many layer groups in flight, later ones held in the scheduler until one completes; 0:
    no such window, the plan orders the groups on the link (the default).

    An override: the plan, built from the device's timings, already puts the first
    layers' group ahead of the queued ones in the stream, without holding anything back
    on the host."""

    sparse_embedding_rows: int = field(default=0, metadata=_env(
        "COMMSCHED_SPARSE_EMBEDDING_ROWS", maximum=1 << 40, data_parallel=True))
    """Data-parallel mode, decompose none: an ``nn.Embedding`` with at least this many rows
    sends its lookup's gradient as the rows the batch touched (token ids and rows,
    all-gathered at the end of backward) instead of in the first layers' dense
    all-reduce, and a weight tied to an output layer has that layer's dense gradient
    reduced as soon as backward produced it; 0: off. Every rank's backward must look up
    as many tokens.

    The gathered rows are world size x tokens per rank x width: they can pay only while
    that is well under the embedding's rows x width. Values are DDP's sums, added in
    another order (``commsched/data_parallel/sparse.py``). Off by default: it did not pay on the
    models measured (``benchmarks/dp_rows_window_2xH200_2026-11-28.md``)."""

    grad_reduce_dtype: Optional[ReduceDtype] = field(default=None, metadata=_env(
        "COMMSCHED_GRAD_REDUCE_DTYPE", data_parallel=True))
    """Data-parallel mode, decompose none: bfloat16 or float16 casts each layer group's
    gradients to that type for its all-reduce (half the bytes of float32 on the link) and
    back after it, as DDP's ``bf16_compress_hook`` / ``fp16_compress_hook`` do; unset: the
    gradients' own type.

    The reduced gradients then carry that type's rounding (about 3 significant digits for
    bfloat16), as with those DDP hooks: compare against them, not against float32 DDP.
    Costs a buffer of that type per layer group (half the gradients' memory). Row
    gradients (``COMMSCHED_SPARSE_EMBEDDING_ROWS``) are gathered in their own type."""

    policy: Optional[Policy] = field(default=None, metadata=_env("COMMSCHED_POLICY"))
    """Dispatch order: priority (a plan built from profiled iterations on the device's
    clock: what the next forward needs first, once it is ready, on a link that runs one
    collective at a time) or fifo (the order requests are submitted); unset: fifo for
    Megatron-LM's bucket groups, priority elsewhere.

    Megatron-LM submits its bucket groups' collectives in the order its own overlap issues
    them (``docs/design.md`` links the measurement behind its default)."""

    plan_forward: bool = field(default=True, metadata=_env("COMMSCHED_PLAN_FORWARD",
                                                           data_parallel=True))
    """Data-parallel mode with whole layer groups and policy priority, 0 or 1: 1 orders the
    groups so that the next forward ends soonest (a ready group may wait for one the
    forward needs earlier); 0 uses the greedy priority replay, as the other adapters do.

    See :mod:`commsched.plan` for the model the plan is built on."""

    decompose: Decompose = field(default="none", metadata=_env("COMMSCHED_DECOMPOSE"))
    """How an all-reduce chunk runs: none (one all-reduce), rs_ag (reduce-scatter then
    all-gather), hier (intra-node reduce-scatter, inter-node all-reduce of each shard,
    intra-node all-gather), leader (reduce to a node leader, all-reduce among leaders,
    broadcast), auto (per chunk size the fastest of none/hier/leader, timed once at the
    first request; none on one node)."""

    local_size: int = field(default=0, metadata=_env("COMMSCHED_LOCAL_SIZE",
                                                     maximum=1 << 20))
    """Ranks per node for hier, leader and auto; 0: the launcher's LOCAL_WORLD_SIZE (all
    ranks one node when unset)."""

    profile_iters: int = field(default=2, metadata=_env(
        "COMMSCHED_PROFILE_ITERS", minimum=1, maximum=100_000))
    """Iterations with an unchanged request layout, run in fifo order and profiled on the
    device, before a priority plan is built; at least 1. A lane's first iteration is not
    one of them."""

    timeout_s: int = field(default=0, metadata=_env("COMMSCHED_TIMEOUT_S",
                                                    maximum=30 * 24 * 3600))
    """Seconds a collective may run without completing before the waiting ranks get an
    error naming it (chunk, op, bytes, group, iteration); 0: the process group's own
    timeout."""

    verify: bool = field(default=False, metadata=_env("COMMSCHED_VERIFY"))
    """0 or 1: cross-check every iteration's dispatch sequence across ranks (one small
    collective per iteration) and report the first divergence."""

    autotune: bool = field(default=False, metadata=_env("COMMSCHED_AUTOTUNE"))
    """0 or 1: once a process group's request layout is stable, profile it, pick the
    partition size, credit window (and none/rs_ag) on the simulator, try that and keep it
    only if iterations got faster. Changes timing only, never results.

    One round per stable layout; every switch is agreed in the collective sequence. The
    decisions are in ``Scheduler.tuning_log()`` and the telemetry table ``tuning``."""

    autotune_iters: int = field(default=5, metadata=_env(
        "COMMSCHED_AUTOTUNE_ITERS", minimum=2, maximum=100_000))
    """Iterations the autotuner profiles as its baseline and measures as its trial; at
    least 2."""

    telemetry_dir: Optional[str] = field(default=None, metadata=_env(
        "COMMSCHED_TELEMETRY_DIR"))
    """Directory under which each launch writes a run directory, named by its start time,
    holding the telemetry store (SQLite, one file per rank); ``commsched report DIR`` reads
    the newest. Unset: no telemetry."""

    nvtx: bool = field(default=False, metadata=_env("COMMSCHED_NVTX"))
    """0 or 1: NVTX ranges around dispatched chunks and iterations (Nsight Systems)."""

    telemetry_nvml_period_ms: int = field(default=100, metadata=_env(
        "COMMSCHED_TELEMETRY_NVML_PERIOD_MS", maximum=3_600_000))
    """NVLink counter sampling period in ms, in a background thread (samples are also
    taken at iteration boundaries); 0: no NVML sampling."""

    telemetry_nvml_per_link: bool = field(default=True, metadata=_env(
        "COMMSCHED_TELEMETRY_NVML_PER_LINK"))
    """0 or 1: 1 reads the NVLink DATA counters link by link in the samples at iteration
    boundaries (a read costs about ten times one of the sums over links, which the
    periodic samples take); 0: sums over links only."""

    telemetry_max_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_TELEMETRY_MAX_BYTES"))
    """Size cap of each rank's telemetry store; at the cap telemetry turns itself off with
    one warning. 0 or inf: no cap."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                _check_int(f.name, value, f.metadata["min"], f.metadata["max"])
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"{f.name}={value!r}: expected True or False")
        if self.policy is not None:
            _check_choice("policy", self.policy, POLICIES)
        if self.grad_reduce_dtype is not None:
            _check_choice("grad_reduce_dtype", self.grad_reduce_dtype, REDUCE_DTYPES)
        _check_choice("decompose", self.decompose, DECOMPOSITIONS)
        if self.telemetry_dir is not None and (
                not isinstance(self.telemetry_dir, str) or not self.telemetry_dir.strip()):
            raise ConfigError(
                f"telemetry_dir={self.telemetry_dir!r}: expected a non-empty path or None")

    def data_parallel_only(self) -> List[str]:
        """The variables of the settings that only the data-parallel mode reads
        (``commsched.wrap``) which this config sets away from their defaults."""
        return [f.metadata["env"] for f in dataclasses.fields(self)
                if f.metadata["data_parallel"] and getattr(self, f.name) != f.default]

    def changed_settings(self) -> List[str]:
        """``VAR=value`` for each setting this config holds away from its default, the
        master switch aside, in the order of the settings table."""
        return [f"{f.metadata['env']}={shown_value(f, getattr(self, f.name))}"
                for f in dataclasses.fields(self)
                if f.name != "enabled" and getattr(self, f.name) != f.default]

    def replace(self, **changes) -> "Config":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def with_policy(self, default: str) -> "Config":
        """This config, with ``policy`` set to ``default`` where it is unset (each adapter
        says what its default is; a ``Scheduler`` made with it unset plans: priority)."""
        return self if self.policy is not None else self.replace(policy=default)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Read every ``COMMSCHED*`` variable from ``environ`` (default ``os.environ``).

        Unknown ``COMMSCHED_*`` names are rejected with a suggestion, since a misspelt
        variable silently ignored is a setting silently not applied.
        """
        environ = os.environ if environ is None else environ
        known = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        for var in environ:
            if var in REMOVED:
                raise ConfigError(f"{var}: no longer a commsched setting: {REMOVED[var]}; "
                                  f"unset it")
            if (var == "COMMSCHED" or var.startswith("COMMSCHED_")) and var not in known:
                close = difflib.get_close_matches(var, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(f"{var}: unknown commsched variable{hint} "
                                  f"(known: {', '.join(sorted(known))})")
        values = {}
        for var, f in known.items():
            raw = environ.get(var)
            if raw is None:
                continue
            values[f.name] = _parse_field(f, var, raw)
        return cls(**values)


def warn_data_parallel_only(config: "Config", adapter: str, stacklevel: int = 2) -> None:
    """One warning naming the data-parallel-only settings ``config`` sets, which
    ``adapter`` (the DDP hook, the Megatron patches) does not read: a setting silently
    not applied is what rejecting unknown variables guards against too."""
    names = config.data_parallel_only()
    if names:
        warnings.warn(
            f"commsched {adapter}: {', '.join(names)} "
            f"{'is' if len(names) == 1 else 'are'} read by the data-parallel mode "
            "(commsched.wrap) only and ignored here", CommschedWarning,
            stacklevel=stacklevel + 1)


def _parse_field(f: dataclasses.Field, var: str, raw: str):
    if f.type in ("bool", bool):
        if raw.strip() in ("0", "1"):
            return raw.strip() == "1"
        raise ConfigError(f"{var}={raw!r}: expected 0 or 1")
    if f.name.endswith("_bytes"):
        zero = f.metadata["zero"]
        if zero and (raw.strip().lower() in ("inf", "unlimited") or _byte_count(raw) is None):
            # parse_bytes reads "inf" as 0, which here means something else (and its
            # message for a malformed value would offer "inf").
            raise ConfigError(f"{var}={raw!r}: expected a byte count such as 100MiB "
                              f"(0: {zero})")
        return parse_bytes(raw, var)
    if f.type in ("int", int):
        m = _INT_RE.match(raw)
        low, high = f.metadata["min"], f.metadata["max"]
        if not m or not low <= int(m.group(1)) <= high:
            raise ConfigError(f"{var}={raw!r}: expected an integer from {low} to {high}")
        return int(m.group(1))
    if f.name == "policy":
        return _choice(var, raw, POLICIES)
    if f.name == "decompose":
        return _choice(var, raw, DECOMPOSITIONS)
    if f.name == "grad_reduce_dtype":
        return _choice(var, raw, REDUCE_DTYPES)
    if f.name == "telemetry_dir":
        if not raw.strip():
            raise ConfigError(f"{var}={raw!r}: expected a directory path")
        return raw
    raise ConfigError(f"{var}: no parser for field {f.name}")  # pragma: no cover


def _choice(var: str, raw: str, choices) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{var}={raw!r}: expected one of {', '.join(choices)}")
    return value


def _check_int(name: str, value, minimum: int, maximum: int = MAX_BYTES) -> None:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not minimum <= value <= maximum):
        raise ConfigError(f"{name}={value!r}: expected an integer from {minimum} to {maximum}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


def field_docs() -> Dict[str, str]:
    """Each ``Config`` field's attribute docstring, read from this module's source (empty
    where the source is not installed)."""
    import ast
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(Config))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _summary(doc: str) -> str:
    """A docstring's first paragraph on one line."""
    return " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "`")


_DOCS = field_docs()
ENV_VARS = {f.metadata["env"]: _summary(_DOCS.get(f.name, "")) for f in dataclasses.fields(Config)}
"""Every environment variable commsched reads, with its description's first paragraph."""


def _shown_default(f: dataclasses.Field) -> str:
    return shown_value(f, f.default)


def shown_value(f: dataclasses.Field, value) -> str:
    """``value`` of field ``f`` as its variable would be set (bytes in the largest exact
    unit, booleans as 0/1), or ``unset``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(int(value))
    if f.name.endswith("_bytes") and value:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return str(value)


def settings_table() -> str:
    """The README's settings table, in markdown: variable, default, description."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Config):
        lines.append(f"| `{f.metadata['env']}` | `{_shown_default(f)}` | "
                     f"{_summary(_DOCS.get(f.name, ''))} |")
    return "\n".join(lines) + "\n"
