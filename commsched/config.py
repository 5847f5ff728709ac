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

__all__ = ["Config", "ConfigError", "parse_bytes", "BYTES_RULE", "ENV_VARS", "GROUPS",
           "MAX_BYTES", "REMOVED", "env_fields", "field_docs", "setting_name",
           "settings_table", "warn_data_parallel_only"]


class ConfigError(CommschedError, ValueError):
    """A setting or argument was rejected; the message names the variable or argument."""


Policy = Literal["priority", "fifo"]
Decompose = Literal["none", "rs_ag", "hier", "leader", "auto"]
ReduceDtype = Literal["bfloat16", "float16"]
POLICIES = get_args(Policy)
REDUCE_DTYPES = get_args(ReduceDtype)
DECOMPOSITIONS = get_args(Decompose)

_BYTE_UNITS = {"": 1, "b": 1}
for _letter, _shift in (("k", 10), ("m", 20), ("g", 30)):
    _BYTE_UNITS.update(dict.fromkeys((_letter, _letter + "b", _letter + "ib"), 1 << _shift))
# ASCII digits only (\d would take any Unicode digit), at most 16 of them (int() of a
# 5000-digit string raises ValueError, not a ConfigError).
_BYTES_RE = re.compile(r"^\s*([0-9]{1,16})\s*([a-zA-Z]*)\s*$", re.ASCII)
_INT_RE = re.compile(r"^\s*([0-9]{1,12})\s*$", re.ASCII)
# Far above any gradient bucket; guards against typos such as 4000GiB. Every byte field's
# upper bound.
MAX_BYTES = 1 << 40
BYTES_RULE = "K, M and G (alone, or with B or iB) are powers of 1024"


# Variables that were settings once, and what took their place: setting one is an error
# that says so, never silence.
REMOVED = {
    "COMMSCHED_DISPATCH": "collectives are always issued by the thread that submits them "
                          "(the dispatch thread is gone)",
    "COMMSCHED_LOCAL_SIZE": "the ranks per node come from torchrun's LOCAL_WORLD_SIZE "
                            "(or Config(local_size=...))",
    "COMMSCHED_PROFILE_ITERS": "pass Config(profile_iters=...)",
    "COMMSCHED_PLAN_FORWARD": "the data-parallel mode plans for the next forward "
                              "(Config(plan_forward=False): the greedy plan)",
    "COMMSCHED_SPARSE_EMBEDDING_ROWS": "embedding gradients go dense with the first layers "
                                       "(Config(sparse_embedding_rows=...) sends them as rows)",
    "COMMSCHED_AUTOTUNE_ITERS": "pass Config(autotune_iters=...)",
    "COMMSCHED_TELEMETRY_NVML_PER_LINK": "pass Config(telemetry_nvml_per_link=False) for "
                                         "sums over links only",
}

# The concerns the settings are grouped by, in the order of the settings table.
SCHEDULER, DATA_PARALLEL, TELEMETRY, TUNING = (
    "scheduler", "data-parallel mode", "telemetry", "tuning")
GROUPS = (SCHEDULER, DATA_PARALLEL, TELEMETRY, TUNING)


def _byte_count(text: str) -> Optional[re.Match]:
    """``text`` as a number and a known unit, or None."""
    m = _BYTES_RE.match(text)
    return m if m and m.group(2).lower() in _BYTE_UNITS else None


def parse_bytes(text: str, name: str) -> int:
    """Parse ``"4194304"``, ``"4MiB"``, ``"4M"``, ``"64KB"`` or ``"inf"`` into a byte count:
    the one byte parser of the settings and the scripts under ``examples/``. K, M and G
    are powers of 1024 whichever way they are written.

    ``inf`` (or ``0`` where the field allows it) means unbounded and is returned as 0.
    ``name`` is the variable or argument named in the error message.
    """
    if text.strip().lower() in ("inf", "unlimited"):
        return 0
    m = _byte_count(text)
    if m is None:
        raise ConfigError(f"{name}={text!r}: expected a byte count such as 4194304, 4MiB, "
                          f"512K, 1GiB or inf ({BYTES_RULE})")
    value = int(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if value > MAX_BYTES:
        raise ConfigError(f"{name}={text!r}: {value} bytes is larger than the 1 TiB limit")
    return value


def _env(var: Optional[str], group: str, minimum: int = 0, maximum: int = MAX_BYTES,
         zero: str = "") -> dict:
    """Field metadata: the variable (None: a constructor argument only), the concern it
    belongs to, an int field's range, and for a byte count what 0 means where that is not
    "unbounded" (``inf`` is then refused rather than read as 0). The data-parallel mode's
    fields are read by it alone (the DDP hook and the Megatron patches send the buckets
    their framework hands them). The field's description is its attribute docstring (see
    ``field_docs``)."""
    return {"env": var, "group": group, "min": minimum, "max": maximum, "zero": zero}


@dataclass(frozen=True)
class Config:
    """Validated commsched settings. Construct directly, or with ``Config.from_env()``.

    The fields are grouped by concern (``GROUPS``). Each field's attribute docstring is
    its one description: its first paragraph, one line that states a rule, is the help of
    ``commsched env`` and the README's settings table (``commsched env --markdown``); the
    rest says why. A field without a variable is a constructor argument only."""

    # ---- scheduler: every adapter ---------------------------------------------------------
    enabled: bool = field(default=False, metadata=_env("COMMSCHED", SCHEDULER))
    """0 or 1: the launcher's master switch; with 0 nothing is patched or registered."""

    partition_bytes: int = field(default=0, metadata=_env("COMMSCHED_PARTITION_BYTES",
                                                          SCHEDULER))
    """Cut requests into chunks of this size, which a more urgent request may overtake;
    0 or inf: whole requests.

    A remainder under 1/8 of it rides with the last chunk. Every chunk is one more
    collective to issue: a size under 64KiB from the environment gets a warning. The data-parallel mode cuts its layer groups' all-reduces unless a
    window of whole groups applies (``groups_in_flight``); rs_ag never cuts its
    reduce-scatters and all-gathers."""

    credit_bytes: int = field(default=0, metadata=_env("COMMSCHED_CREDIT_BYTES", SCHEDULER))
    """Most bytes in flight per process group (a larger chunk goes alone); 0 or inf:
    unbounded.

    A bounded window returns credit as collectives end on the device, through the lane's
    completion thread: each chunk then costs a wake-up of that thread. The data-parallel
    mode, where this is unbounded, gets a window of whole layer groups instead
    (``groups_in_flight``)."""

    policy: Optional[Policy] = field(default=None, metadata=_env("COMMSCHED_POLICY",
                                                                 SCHEDULER))
    """priority (a plan from device timings: what the next forward needs first, once ready)
    or fifo (submission order); unset: fifo for Megatron-LM, priority elsewhere.

    Megatron-LM submits its bucket groups in the order its own overlap issues them
    ([Note: Megatron's fifo default] in docs/design.md)."""

    decompose: Decompose = field(default="none", metadata=_env("COMMSCHED_DECOMPOSE",
                                                               SCHEDULER))
    """How an all-reduce runs: none, rs_ag, hier, leader, or auto (per chunk size none,
    unless hier or leader measured more than 20% faster).

    rs_ag: reduce-scatter then all-gather. hier: intra-node reduce-scatter, inter-node
    all-reduce of each shard, intra-node all-gather. leader: reduce to a node leader,
    all-reduce among leaders, broadcast. auto is timed once at the first request, and is
    none on one node; at each size the first of none, hier, leader that no other beat by
    more than 20% of its time wins (``calibrate.AUTO_MARGIN``), so that noise between
    launches does not flip the choice. Rank 0 says the choice in one line; ``commsched
    report`` shows the measured times."""

    local_size: int = field(default=0, metadata=_env(None, SCHEDULER, maximum=1 << 20))
    """Ranks per node for hier, leader and auto; 0: torchrun's LOCAL_WORLD_SIZE (one node
    when unset)."""

    profile_iters: int = field(default=2, metadata=_env(None, SCHEDULER, minimum=1,
                                                        maximum=100_000))
    """Iterations of an unchanged request layout profiled on the device before a priority
    plan is built; at least 1.

    They run in fifo order; a lane's first iteration is not one of them."""

    timeout_s: int = field(default=0, metadata=_env("COMMSCHED_TIMEOUT_S", SCHEDULER,
                                                    maximum=30 * 24 * 3600))
    """Seconds a collective may run, or the ranks' start-up agreement wait, before the
    waiting ranks get an error naming it; 0: the process group's own timeout (300 s for
    the agreement).

    The error names the chunk, op, bytes, group and iteration; the agreement's, the ranks
    that did not answer (``commsched.safety.STARTUP_BOUND_S``)."""

    verify: bool = field(default=False, metadata=_env("COMMSCHED_VERIFY", SCHEDULER))
    """0 or 1: check every iteration's dispatch sequence across ranks (one small collective
    per iteration)."""

    # ---- data-parallel mode (commsched.wrap) only -----------------------------------------
    group_bytes: int = field(default=256 << 20, metadata=_env(
        "COMMSCHED_GROUP_BYTES", DATA_PARALLEL, zero="one layer group per module"))
    """A layer group (unit of communication and update) closes at a module boundary at this
    many bytes of gradients; 0: one per module.

    ``wrap(group_bytes=...)`` overrides it. Each group is one request per iteration:
    smaller groups overlap more but cost more host time per iteration, larger ones expose
    more of the last group's communication."""

    first_group_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_FIRST_GROUP_BYTES", DATA_PARALLEL, zero="off"))
    """The first layers' group closes at this size, each next at twice the one before, up to
    the group size; 0: off.

    The first layers' group is reduced last in backward and needed first by the next
    forward: no compute hides its all-reduce. A smaller one shortens that wait, for a few
    more requests per iteration."""

    groups_in_flight: int = field(default=0, metadata=_env(
        "COMMSCHED_GROUPS_IN_FLIGHT", DATA_PARALLEL, maximum=1 << 20))
    """At most this many layer groups in flight (decompose none, no credit window); 0: the
    plan orders them, nothing is held back.

    An override: the plan, built from the device's timings, already puts the first
    layers' group ahead of the queued ones in the stream, without holding anything back
    on the host."""

    grad_reduce_dtype: Optional[ReduceDtype] = field(default=None, metadata=_env(
        "COMMSCHED_GRAD_REDUCE_DTYPE", DATA_PARALLEL))
    """bfloat16 or float16: all-reduce each layer group in that type, as DDP's
    ``bf16_compress_hook`` does; unset: the gradients' own type.

    Decompose none only. The reduced gradients carry that type's rounding, as with those
    DDP hooks: compare against them, not against float32 DDP. Costs a buffer of that type
    per layer group. Row gradients (``sparse_embedding_rows``) are gathered in their own
    type."""

    sparse_embedding_rows: int = field(default=0, metadata=_env(None, DATA_PARALLEL,
                                                                maximum=1 << 40))
    """An ``nn.Embedding`` with at least this many rows sends its gradient as the rows the
    batch looked up; 0: off.

    Decompose none only. Token ids and rows are all-gathered at the end of backward instead
    of joining the first layers' dense all-reduce, and a weight tied to an output layer has
    that layer's dense gradient reduced as soon as backward produced it. Every rank's
    backward must look up as many tokens. The gathered rows are world size x tokens per
    rank x width: they can pay only while that is well under the embedding's rows x width.
    Values are DDP's sums, added in another order (``commsched/data_parallel/sparse.py``)."""

    plan_forward: bool = field(default=True, metadata=_env(None, DATA_PARALLEL))
    """With whole layer groups and policy priority, order the groups so that the next
    forward ends soonest; False: the greedy priority plan of the other adapters.

    A ready group may then wait for one the forward needs earlier. :mod:`commsched.plan`
    describes the model the plan is built on."""

    # ---- telemetry ------------------------------------------------------------------------
    telemetry_dir: Optional[str] = field(default=None, metadata=_env(
        "COMMSCHED_TELEMETRY_DIR", TELEMETRY))
    """Each launch records into a new run directory under this one (``commsched report
    DIR``); unset: no telemetry.

    A run directory is named by its start time and holds one SQLite store per rank;
    ``commsched report`` and ``commsched trace`` read the newest."""

    nvtx: bool = field(default=False, metadata=_env("COMMSCHED_NVTX", TELEMETRY))
    """0 or 1: NVTX ranges around dispatched chunks and iterations, for Nsight Systems."""

    telemetry_nvml_period_ms: int = field(default=100, metadata=_env(
        "COMMSCHED_TELEMETRY_NVML_PERIOD_MS", TELEMETRY, maximum=3_600_000))
    """Period in ms of the background thread sampling NVLink counters; 0: no NVML sampling.

    Samples are also taken at iteration boundaries."""

    telemetry_nvml_per_link: bool = field(default=True, metadata=_env(None, TELEMETRY))
    """Read the NVLink counters link by link at iteration boundaries; False: sums over
    links only.

    A per-link read costs many times a read of the sums, which the periodic samples take
    (``docs/telemetry.md``)."""

    telemetry_max_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_TELEMETRY_MAX_BYTES", TELEMETRY))
    """Size cap of each rank's telemetry store, where telemetry turns itself off with one
    warning; 0 or inf: no cap."""

    # ---- tuning ---------------------------------------------------------------------------
    autotune: bool = field(default=False, metadata=_env("COMMSCHED_AUTOTUNE", TUNING))
    """0 or 1: once a layout is stable, try the partition size, credit window and
    decomposition the simulator picks; keep them only if iterations got faster.

    Changes timing only, never results. One round per stable layout; every switch is
    agreed in the collective sequence. The decisions are in ``Scheduler.tuning_log()`` and
    the telemetry table ``tuning``."""

    autotune_iters: int = field(default=5, metadata=_env(None, TUNING, minimum=2,
                                                         maximum=100_000))
    """Iterations the tuner profiles as its baseline and measures as its trial; at least
    2."""

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
        """The settings that only the data-parallel mode reads (``commsched.wrap``) which
        this config sets away from their defaults: their variables, or their field names
        where they have none."""
        return [setting_name(f) for f in dataclasses.fields(self)
                if f.metadata["group"] == DATA_PARALLEL and getattr(self, f.name) != f.default]

    def changed_settings(self) -> List[str]:
        """``VAR=value`` (``field=value`` for a constructor argument) for each setting this
        config holds away from its default, the master switch aside, in field order."""
        return [f"{setting_name(f)}={shown_value(f, getattr(self, f.name))}"
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
        known = env_fields()
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
        _warn_small_partition(values.get("partition_bytes", 0))
        return cls(**values)

    @classmethod
    def parse(cls, name: str, raw: str):
        """The value of field ``name`` written as its variable would be (``"4MiB"``,
        ``"1"``, ``"fifo"``): for scripts that take settings as ``FIELD=VALUE``."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            raise ConfigError(f"{name}: not a Config field ({', '.join(fields)})")
        return _parse_field(fields[name], name, raw)


def env_fields() -> Dict[str, dataclasses.Field]:
    """The fields read from the environment, by variable, in field order."""
    return {f.metadata["env"]: f for f in dataclasses.fields(Config) if f.metadata["env"]}


def setting_name(f: dataclasses.Field) -> str:
    """How a setting is named to the user: its variable, or its field where it has none."""
    return f.metadata["env"] or f.name


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


# Below this a chunk's collective costs more host time (tens of µs each) than its transfer
# lasts on any link worth scheduling: a partition size under it slows every iteration.
SMALL_PARTITION = 64 << 10


def _warn_small_partition(value: int) -> None:
    if 0 < value < SMALL_PARTITION:
        warnings.warn(f"COMMSCHED_PARTITION_BYTES={value}: chunks under 64KiB each cost a "
                      f"collective's host time for little data, and make a step many times "
                      f"slower; use 1MiB or more (0: whole requests)", CommschedWarning,
                      stacklevel=3)


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
ENV_VARS = {var: _summary(_DOCS.get(f.name, "")) for var, f in env_fields().items()}
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
    """The README's settings table, in markdown: one table per concern, each row a variable,
    its default and its rule."""
    out = []
    for group in GROUPS:
        rows = [f for f in env_fields().values() if f.metadata["group"] == group]
        out += [f"**{group.capitalize()}**", "", "| variable | default | rule |", "|---|---|---|"]
        out += [f"| `{f.metadata['env']}` | `{_shown_default(f)}` | "
                f"{_summary(_DOCS.get(f.name, ''))} |" for f in rows]
        out.append("")
    return "\n".join(out)
