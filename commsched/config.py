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
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .errors import CommschedError

__all__ = ["Config", "ConfigError", "parse_bytes", "ENV_VARS", "MAX_BYTES"]


class ConfigError(CommschedError, ValueError):
    """A configuration value was rejected; the message names the variable or argument."""


POLICIES = ("priority", "fifo")
DECOMPOSITIONS = ("none", "rs_ag", "hier", "leader", "auto")
DISPATCH_MODES = ("auto", "thread", "inline")

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


def parse_bytes(text: str, name: str) -> int:
    """Parse ``"4194304"``, ``"4MiB"``, ``"64kb"`` or ``"inf"`` into a byte count.

    ``inf`` (or ``0`` where the field allows it) means unbounded and is returned as 0.
    ``name`` is the variable or argument named in the error message.
    """
    if text.strip().lower() in ("inf", "unlimited"):
        return 0
    m = _BYTES_RE.match(text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ConfigError(
            f"{name}={text!r}: expected a byte count such as 4194304, 4MiB, 512KiB, 1GiB or inf"
        )
    value = int(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if value > MAX_BYTES:
        raise ConfigError(f"{name}={text!r}: {value} bytes is larger than the 1 TiB limit")
    return value


def _env(var: str, help: str, minimum: int = 0, maximum: int = MAX_BYTES,
         zero: str = "") -> dict:
    """Field metadata. ``zero``, for a byte count: what 0 means where that is not
    "unbounded"; ``inf`` is then refused rather than read as 0."""
    return {"env": var, "help": help, "min": minimum, "max": maximum, "zero": zero}


@dataclass(frozen=True)
class Config:
    """Validated commsched settings. Construct directly, or with ``Config.from_env()``."""

    enabled: bool = field(default=False, metadata=_env(
        "COMMSCHED",
        "Master switch, 0 or 1. With 0 (or unset) the launcher patches and registers nothing."))
    """Master switch. Off means off: nothing is patched or registered (invariant 3)."""

    partition_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_PARTITION_BYTES",
        "Chunk size a request is cut into, in bytes (suffixes KiB/MiB/GiB accepted); a "
        "remainder under 1/8 of it rides with the last chunk; 0 or inf (the default): "
        "whole requests. The data-parallel mode cuts its layer groups' all-reduces only "
        "under a credit window set in bytes (or autotune); rs_ag never cuts its "
        "reduce-scatters and all-gathers."))
    """Chunk size a request is partitioned into (a remainder under 1/8 of it is folded into
    the last chunk, see partition.py); 0 means no partitioning.

    Whole requests by default: every chunk is one more collective to issue, and a cut
    changes no order unless a credit window holds chunks back for a more urgent request to
    overtake. Partition only together with a credit window, on a link slow enough that
    the overtaking pays (see README, "When partitioning and a credit window pay")."""

    credit_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_CREDIT_BYTES",
        "Credit window: most bytes in flight per process group; 0 or inf is unbounded."))
    """Bytes allowed in flight per process group; 0 means unbounded. A chunk larger than
    the whole window is admitted alone once nothing else is in flight.

    Unbounded by default: credit returns through the completion thread, and on NVLink the
    time from a chunk's end to the next dispatch (GIL hand-offs while the training thread
    runs Python) exceeds a chunk's transfer time, so a bounded window starves the link
    (GPT 405M, 2x H200: 4 MiB chunks / 16 MiB credit 94 ms vs 69 ms unbounded). Bound it
    where priorities must overtake queued chunks on a slow network. The data-parallel
    mode, unbounded here, gets a window of whole layer groups instead (``groups_in_flight``);
    set here, this window applies to it too, in chunks of ``partition_bytes``."""

    group_bytes: int = field(default=256 << 20, metadata=_env(
        "COMMSCHED_GROUP_BYTES",
        "Data-parallel mode (commsched.wrap): a layer group, the unit of communication and "
        "of optimizer update, is closed at a module boundary once it holds this many bytes "
        "of gradients (suffixes KiB/MiB/GiB accepted); 0: one group per module. "
        "wrap(group_bytes=...) overrides it.", zero="one layer group per module"))
    """Layer-group size of the data-parallel mode, in gradient bytes (0: one group per
    parameter-owning module). Each group is one request per iteration, and a request costs
    ~0.5 ms of Python spread over the autograd and dispatch threads (gradient hand-over,
    submission, dispatch, completion), which contend for the GIL with backward's own hooks.
    On a host-bound model that, not the link, sets how small groups can usefully be.
    Measured on 2x H200 (GPT 405M, 1548 MiB of gradients, interleaved rounds in one
    launch), ms/iteration for 25/64/128/256/512 MiB/1 GiB groups (38/20/11/6/3/2 groups):
    NVLink 77.4/68.1/63.2/56.1 and, in a second launch, 57.6 (128 MiB)/49.8/51.8/55.1;
    host path 79.4/75.7/73.7/74.2 and 74.4 (128 MiB)/73.6/75.9/77.8. Larger groups expose
    more of the last group's communication, smaller ones pay more per-request work."""

    groups_in_flight: int = field(default=2, metadata=_env(
        "COMMSCHED_GROUPS_IN_FLIGHT",
        "Data-parallel mode (commsched.wrap, decompose none) with COMMSCHED_CREDIT_BYTES "
        "unbounded: at most this many layer groups' bytes in flight (a window of this many "
        "times the largest group), so that the first layers' group, reduced last in "
        "backward, overtakes the groups still queued and the next forward starts sooner; "
        "0: unbounded. COMMSCHED_CREDIT_BYTES, when set, applies instead.",
        maximum=1 << 20))
    """Credit window of the data-parallel mode's all-reduces, in layer groups (0: unbounded),
    where ``credit_bytes`` leaves the window unbounded and autotune is off; rs_ag leaves
    its window unbounded. Each group goes as one collective.

    Two, not one: with one group in flight the link idles from a group's end until the
    completion thread has returned its credit and the next group is issued (GIL hand-offs
    while the training thread runs the next forward). Measured on 2x H200 (GPT 405M, six
    256 MiB groups; ms/iteration, interleaved rounds in one launch each): 1 / 2 groups /
    unbounded, host path 70.1 / 69.8 / 73.5, NVLink 60.4 / 56.4 / 56.5; 2 groups /
    unbounded, host path 72.3 / 74.4, NVLink 64.9 / 64.4; 1 group / unbounded in two more
    launches, host path 67.2 / 72.7 and 75.8 / 74.4, NVLink 50.3 / 50.9 and 56.7 / 52.8."""

    policy: str = field(default="priority", metadata=_env(
        "COMMSCHED_POLICY",
        "Dispatch order: priority (layers the next forward needs first, from a profiled "
        "plan) or fifo (gradient-readiness order)."))
    """``priority``: dispatch by a plan built from a profile of readiness times and layer
    priorities; ``fifo``: dispatch in submission order."""

    plan_forward: bool = field(default=True, metadata=_env(
        "COMMSCHED_PLAN_FORWARD",
        "0 or 1: data-parallel mode (commsched.wrap) with whole layer groups and policy "
        "priority: 1 orders the groups so that the next forward ends soonest (a ready group "
        "may wait for one the forward needs earlier); 0 uses the greedy priority replay, as "
        "every other adapter does."))
    """Plan objective of the data-parallel mode (see :mod:`commsched.plan`): the end of the
    next forward, which consumes the layer groups in forward order, rather than the greedy
    replay that sends the most urgent ready group whenever the window allows. The greedy
    order commits a group as soon as it is ready, so the first layers' groups, ready last,
    queue behind it and the next forward waits for the whole iteration's communication.
    Measured on 2x H200 (GPT 405M, six 256 MiB groups, micro-batch 4, 3-4 interleaved
    rounds per launch), ms/iteration with / without, one launch per pair: host path
    65.5 / 67.7, 65.7 / 68.9, 65.5 / 70.2 and 64.4 / 69.1 (comm only 60.5-61.5); NVLink,
    host-bound, 37.3 / 44.6, 49.2 / 50.7, 49.6 / 64.1 and 55.7 / 55.6. Micro-batch 16:
    host path 94.8 / 97.0, NVLink 74.5 / 74.8."""

    decompose: str = field(default="none", metadata=_env(
        "COMMSCHED_DECOMPOSE",
        "How an all-reduce chunk is run: none (one all-reduce), rs_ag (reduce-scatter then "
        "all-gather), hier (intra-node reduce-scatter, inter-node all-reduce of each "
        "shard, intra-node all-gather), leader (reduce to a node leader, all-reduce among "
        "leaders, broadcast), auto (per chunk size, the fastest of none/hier/leader as timed "
        "once at the first request; none on one node)."))
    """Decomposition of all-reduce chunks: ``none``, ``rs_ag``, ``hier``, ``leader`` or
    ``auto``. The topology-aware ones run on the default process group."""

    dispatch: str = field(default="auto", metadata=_env(
        "COMMSCHED_DISPATCH",
        "Which thread issues the collectives: inline (the thread that submits, e.g. "
        "autograd's in backward; auto is the same), or thread (a dispatch thread per "
        "process group: submit() records readiness and queues the request). thread is not "
        "allowed with autotune."))
    """``inline`` (and ``auto``, the default): the thread that submits issues what the order
    allows, on its own stream: the request it submits, in the common case, as a plain
    collective would be issued. ``thread``: a dispatch thread per lane issues instead, at a
    GIL hand-off per request, competing with autograd for the GIL; not with ``autotune``,
    which decides at submission with state the dispatch thread would change later, nor
    with Megatron, which issues collectives of its own on the data-parallel group."""

    local_size: int = field(default=0, metadata=_env(
        "COMMSCHED_LOCAL_SIZE",
        "Ranks per node for hier/leader/auto; 0: the launcher's LOCAL_WORLD_SIZE (all ranks "
        "one node when unset).", maximum=1 << 20))
    """Ranks per node for the topology-aware decompositions; 0 takes LOCAL_WORLD_SIZE."""

    profile_iters: int = field(default=2, metadata=_env(
        "COMMSCHED_PROFILE_ITERS",
        "Iterations run in fifo order (and profiled) before a priority plan is built; >= 1.",
        minimum=1, maximum=100_000))
    """Warm-up iterations, dispatched FIFO and profiled, before the first priority plan."""

    timeout_s: int = field(default=0, metadata=_env(
        "COMMSCHED_TIMEOUT_S",
        "Seconds a collective may run without completing before the waiting ranks get an "
        "error naming it; 0: the process group's own timeout.", maximum=30 * 24 * 3600))
    """Hang detection: a chunk in flight this long without any completion is an error.
    0 takes the process group's timeout (torch's default: 30 minutes)."""

    verify: bool = field(default=False, metadata=_env(
        "COMMSCHED_VERIFY",
        "0 or 1: cross-check every iteration's dispatch sequence across ranks (one small "
        "collective per iteration) and report the first divergence."))
    """Debug mode: compare a digest of each iteration's dispatch sequence across ranks."""

    autotune: bool = field(default=False, metadata=_env(
        "COMMSCHED_AUTOTUNE",
        "0 or 1: once a process group's request layout is stable, profile it, pick the "
        "partition size, credit window (and none/rs_ag) on the simulator, run that for a "
        "trial and keep it only if iterations got faster (commsched/autotune.py)."))
    """Online tuning, one round per stable request layout: profile ``autotune_iters``
    iterations, search with ``commsched.sim.tune``, try the choice, keep or revert. Every
    switch is agreed in the collective sequence; it changes timing only, never results."""

    autotune_iters: int = field(default=5, metadata=_env(
        "COMMSCHED_AUTOTUNE_ITERS",
        "Iterations the autotuner profiles as its baseline and measures as its trial; >= 2.",
        minimum=2, maximum=100_000))
    """Length of the autotuner's baseline and trial windows, in lane iterations."""

    telemetry_dir: Optional[str] = field(default=None, metadata=_env(
        "COMMSCHED_TELEMETRY_DIR",
        "Directory for the telemetry store (SQLite) and exports; unset disables telemetry."))
    """Run directory for telemetry; ``None`` disables telemetry."""

    nvtx: bool = field(default=False, metadata=_env(
        "COMMSCHED_NVTX", "0 or 1: emit NVTX ranges around chunks and iterations."))
    """Emit NVTX ranges (for Nsight Systems) around dispatched chunks and iterations."""

    telemetry_nvml_period_ms: int = field(default=100, metadata=_env(
        "COMMSCHED_TELEMETRY_NVML_PERIOD_MS",
        "NVLink counter sampling period in ms (samples are also taken at iteration "
        "boundaries); 0 turns NVML sampling off.", maximum=3_600_000))
    """Period of the NVLink counter sampler thread, in ms; 0 disables NVML sampling."""

    telemetry_nvml_per_link: bool = field(default=True, metadata=_env(
        "COMMSCHED_TELEMETRY_NVML_PER_LINK",
        "1: read NVLink DATA counters per link in the samples at iteration boundaries "
        "(~14 ms a read on 18 links; periodic samples read the sums, ~1.1 ms); 0: only "
        "sums over links."))
    """Read per-link counters at iteration boundaries (else only the sums over links)."""

    telemetry_max_bytes: int = field(default=0, metadata=_env(
        "COMMSCHED_TELEMETRY_MAX_BYTES",
        "Size cap of each rank's telemetry store; at the cap telemetry turns itself off "
        "with one warning. 0 or inf: no cap."))
    """Size cap of each rank's store in bytes; 0 means no cap."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                _check_int(f.name, value, f.metadata["min"], f.metadata["max"])
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"{f.name}={value!r}: expected True or False")
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("decompose", self.decompose, DECOMPOSITIONS)
        _check_choice("dispatch", self.dispatch, DISPATCH_MODES)
        if self.dispatch == "thread" and self.autotune:
            raise ConfigError(
                "dispatch='thread' (COMMSCHED_DISPATCH): not with autotune=True "
                "(COMMSCHED_AUTOTUNE), which decides at submission with state the dispatch "
                "thread changes later; use auto or inline")
        if self.telemetry_dir is not None and (
                not isinstance(self.telemetry_dir, str) or not self.telemetry_dir.strip()):
            raise ConfigError(
                f"telemetry_dir={self.telemetry_dir!r}: expected a non-empty path or None")

    def replace(self, **changes) -> "Config":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Read every ``COMMSCHED*`` variable from ``environ`` (default ``os.environ``).

        Unknown ``COMMSCHED_*`` names are rejected with a suggestion, since a misspelt
        variable silently ignored is a setting silently not applied.
        """
        environ = os.environ if environ is None else environ
        known = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        for var in environ:
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


def _parse_field(f: dataclasses.Field, var: str, raw: str):
    if f.type in ("bool", bool):
        if raw.strip() in ("0", "1"):
            return raw.strip() == "1"
        raise ConfigError(f"{var}={raw!r}: expected 0 or 1")
    if f.name.endswith("_bytes"):
        zero = f.metadata["zero"]
        if zero and raw.strip().lower() in ("inf", "unlimited"):
            # parse_bytes reads "inf" as 0, which here means something else.
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
    if f.name == "dispatch":
        return _choice(var, raw, DISPATCH_MODES)
    if f.name == "telemetry_dir":
        if not raw.strip():
            raise ConfigError(f"{var}={raw!r}: expected a directory path")
        return raw
    raise AssertionError(f"no parser for {f.name}")  # pragma: no cover


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


ENV_VARS = {f.metadata["env"]: f.metadata["help"] for f in dataclasses.fields(Config)}
"""Every environment variable commsched reads, with its one-line help (README table)."""
