"""NVML access for the NVLink sampler: a narrow backend interface, the real ``pynvml``
backend, a deterministic fake for tests, and topology discovery.

Facts this module relies on ([Note: NVLink counters] in docs/design.md):

* NVLink traffic is read with ``nvmlDeviceGetFieldValues`` fields 138/139 (DATA TX/RX) and
  140/141 (RAW TX/RX: DATA plus protocol overhead), cumulative uint64 KiB.
* The link is chosen by ``scopeId``; pynvml sets it only for ``(fieldId, scopeId)`` tuples. A
  bare field id silently reads link 0; ``scopeId = 0xFFFFFFFF`` reads the sum over links.
* A query is slow, a per-link one much slower than one of the sums over links, which is
  why only the sampler thread ever calls into NVML.
* Links to an NVSwitch report remote device type "switch" and remote PCI id FFFF...; only
  direct GPU-GPU links resolve to a peer GPU index.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..errors import CommschedError
from .errors import TelemetryWarning

__all__ = [
    "FIELD", "SCOPE_ALL_LINKS", "MAX_LINKS", "NvmlUnavailable", "GpuInfo", "LinkInfo",
    "GpuSelector", "NvmlBackend", "PynvmlBackend", "FakeNvmlBackend", "FakeGpu", "FakeLink",
    "discover_links", "resolve_gpu", "normalize_bus_id", "HEALTH_COUNTERS",
]

# Field ids (nvml.h); named here so the module does not need pynvml to be importable.
FIELD = {
    "data_tx": 138,     # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
    "data_rx": 139,     # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB
    "raw_tx": 140,      # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, KiB
    "raw_rx": 141,      # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX, KiB
    "link_count": 91,   # NVML_FI_DEV_NVLINK_LINK_COUNT
    "speed_mbps": 164,  # NVML_FI_DEV_NVLINK_GET_SPEED, MB/s per direction
    "state": 165,       # NVML_FI_DEV_NVLINK_GET_STATE
    "crc_flit": 38,     # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL (per link, all lanes)
    "crc_data": 45,     # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    "replay": 52,       # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    "recovery": 59,     # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
}
SCOPE_ALL_LINKS = 0xFFFFFFFF
MAX_LINKS = 36          # NVML_NVLINK_MAX_LINKS
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}
HEALTH_COUNTERS = ("state", "speed_mbps", "crc_flit", "crc_data", "replay", "recovery")


class NvmlUnavailable(CommschedError):
    """NVML or NVLink cannot be used here. ``status`` is the short code stored in the runs
    table (no_pynvml, no_nvml, no_gpu, no_nvlink, counters_unsupported); ``detail`` says why."""

    def __init__(self, status: str, detail: str = ""):
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class GpuInfo:
    index: int              # NVML index (not the CUDA index, which CUDA_VISIBLE_DEVICES remaps)
    name: str
    uuid: str
    pci_bus_id: str         # normalized, see normalize_bus_id


@dataclass(frozen=True)
class LinkInfo:
    link: int
    state: int              # 1 = active
    version: Optional[int]  # NVML enum (6 = NVLink 4)
    speed_mbps: Optional[int]
    remote_type: str        # gpu | switch | ibmnpu | unknown
    remote_pci_bus_id: Optional[str]
    peer_gpu_index: Optional[int] = None


@dataclass(frozen=True)
class GpuSelector:
    """Which GPU a rank samples. CUDA indices are remapped by CUDA_VISIBLE_DEVICES, so the
    UUID (from torch) is preferred; without it the CUDA index is mapped through
    CUDA_VISIBLE_DEVICES when that is a list of integers."""

    cuda_index: int
    uuid: Optional[str] = None


_BUS_RE = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$")


def normalize_bus_id(bus_id) -> Optional[str]:
    """``"00000000:18:00.0"`` and ``"0000:18:00.0"`` name the same device: return the
    canonical ``"0000:18:00.0"``, or None for unset ids (NVSwitch links report all F)."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    text = (bus_id or "").strip().rstrip("\x00")
    m = _BUS_RE.match(text)
    if not m:
        return None
    domain, bus, dev, fn = (int(g, 16) if g else 0 for g in m.groups())
    if bus == 0xFF and dev in (0x1F, 0xFF):
        return None
    if domain == 0xFFFFFFFF or domain == 0xFFFF:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


class NvmlBackend(Protocol):
    """What the sampler needs from NVML. Every method may raise NvmlUnavailable."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def gpu_info(self, index: int) -> GpuInfo: ...

    def link_info(self, index: int, link: int) -> Optional[LinkInfo]:
        """Static facts of one link, or None when the link does not exist on this GPU."""

    def read_fields(self, index: int,
                    fields: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        """Values of ``(field_id, scope_id)`` pairs in one query; None where unsupported."""


def resolve_gpu(backend: NvmlBackend, selector: GpuSelector) -> GpuInfo:
    """The NVML device a CUDA device selector refers to."""
    count = backend.device_count()
    infos = [backend.gpu_info(i) for i in range(count)]
    if selector.uuid:
        want = selector.uuid.lower().removeprefix("gpu-")
        for info in infos:
            if info.uuid.lower().removeprefix("gpu-") == want:
                return info
    index = selector.cuda_index
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries) and entries[index].isdigit():
            index = int(entries[index])
    if 0 <= index < count:
        return infos[index]
    raise NvmlUnavailable("no_gpu", f"CUDA device {selector.cuda_index} not found by NVML "
                                    f"({count} devices)")


def discover_links(backend: NvmlBackend, gpu: GpuInfo) -> List[LinkInfo]:
    """Every NVLink of ``gpu`` with its peer GPU resolved where the link is GPU-GPU."""
    by_bus = {}
    for i in range(backend.device_count()):
        by_bus[backend.gpu_info(i).pci_bus_id] = i
    links = []
    for link in range(MAX_LINKS):
        info = backend.link_info(gpu.index, link)
        if info is None:
            continue
        peer = by_bus.get(info.remote_pci_bus_id) if info.remote_type == "gpu" else None
        links.append(LinkInfo(info.link, info.state, info.version, info.speed_mbps,
                              info.remote_type, info.remote_pci_bus_id, peer))
    return links


# --- real NVML ------------------------------------------------------------------------------

class PynvmlBackend:
    """NVML through ``pynvml`` from the nvidia-ml-py distribution."""

    def __init__(self) -> None:
        self._nv = None
        self._handles: Dict[int, object] = {}
        self._buffers: Dict[tuple, "_FieldBuffer"] = {}

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable("no_pynvml", f"nvidia-ml-py is not installed ({exc})") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable("no_nvml", str(exc)) from None
        self._nv = pynvml

    def shutdown(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
            self._nv = None
            self._handles.clear()
            self._buffers.clear()

    def _handle(self, index: int):
        if index not in self._handles:
            self._handles[index] = self._nv.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def driver_version(self) -> str:
        return _text(self._nv.nvmlSystemGetDriverVersion())

    def device_count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def gpu_info(self, index: int) -> GpuInfo:
        nv, h = self._nv, self._handle(index)
        pci = nv.nvmlDeviceGetPciInfo(h)
        return GpuInfo(index, _text(nv.nvmlDeviceGetName(h)), _text(nv.nvmlDeviceGetUUID(h)),
                       normalize_bus_id(pci.busId) or "")

    def link_info(self, index: int, link: int) -> Optional[LinkInfo]:
        nv, h = self._nv, self._handle(index)
        try:
            state = int(nv.nvmlDeviceGetNvLinkState(h, link))
        except nv.NVMLError:
            return None     # NotSupported / InvalidArgument: no such link (or PCIe-only GPU)
        version = _try(nv, lambda: int(nv.nvmlDeviceGetNvLinkVersion(h, link)))
        remote = _try(nv, lambda: int(nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)))
        bus = _try(nv, lambda: nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
        speed = self.read_fields(index, [(FIELD["speed_mbps"], link)])[0]
        return LinkInfo(link, state, version, speed, REMOTE_TYPES.get(remote, "unknown"),
                        normalize_bus_id(bus))

    def read_fields(self, index: int,
                    fields: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        """One ``nvmlDeviceGetFieldValues`` call into a buffer kept per (GPU, query): no
        allocation per sample, and ``FIELD_GUARD`` spare entries after the ones asked for,
        filled with a sentinel and checked after each call. A library that writes past
        the entries it was given (seen as heap corruption, ``free(): invalid next size``,
        in processes sampling per-link counters) then writes into the guard rather than
        the heap, and the write is reported once as a TelemetryWarning."""
        key = (index, tuple(fields))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = _FieldBuffer(self._nv, fields)
        return buffer.read(self._handle(index))


FIELD_GUARD = 16              # spare nvmlFieldValue_t entries after each query's
_GUARD_FIELD_ID = 0xFFFFFFFF  # sentinel fieldId of the spare entries


class _FieldBuffer:
    """A reusable ``nvmlFieldValue_t`` array for one query, followed by guard entries whose
    bytes are compared after every call."""

    __slots__ = ("nv", "fn", "count", "array", "fields", "guard_at", "guard", "warned")

    def __init__(self, nv, fields: Sequence[Tuple[int, int]]):
        import ctypes
        self.nv = nv
        self.fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
        self.fields = list(fields)
        n = len(self.fields)
        self.count = ctypes.c_int32(n)
        self.array = (nv.c_nvmlFieldValue_t * (n + FIELD_GUARD))()
        for i in range(n, n + FIELD_GUARD):
            self.array[i].fieldId = _GUARD_FIELD_ID
        size = ctypes.sizeof(nv.c_nvmlFieldValue_t)
        self.guard_at = ctypes.addressof(self.array) + n * size
        self.guard = ctypes.string_at(self.guard_at, FIELD_GUARD * size)
        self.warned = False

    def read(self, handle) -> List[Optional[int]]:
        import ctypes
        array, n = self.array, len(self.fields)
        for i, (field_id, scope) in enumerate(self.fields):
            array[i].fieldId, array[i].scopeId = field_id, scope
        ret = self.fn(handle, self.count, ctypes.byref(array))
        if ctypes.string_at(self.guard_at, len(self.guard)) != self.guard:
            ctypes.memmove(self.guard_at, self.guard, len(self.guard))
            if not self.warned:
                self.warned = True
                warnings.warn(f"NVML wrote past the {n} field values it was asked for; the "
                              "guard entries kept it off the heap", TelemetryWarning)
        if ret != 0:
            raise self.nv.NVMLError(ret)
        return [_field_value(array[i]) for i in range(n)]


_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                  6: "usVal"}


def _field_value(v) -> Optional[int]:
    if v.nvmlReturn != 0:
        return None
    member = _VALUE_MEMBERS.get(int(v.valueType))
    return None if member is None else getattr(v.value, member)


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _try(nv, fn):
    try:
        return fn()
    except nv.NVMLError:
        return None


# --- deterministic fake ---------------------------------------------------------------------

@dataclass
class FakeLink:
    """One link of a fake GPU. ``tx_kib``/``rx_kib`` are the DATA counter increments per read;
    RAW counters add ``raw_overhead`` (a fraction of DATA) on top."""

    state: int = 1
    version: int = 6
    speed_mbps: int = 26562
    remote_type: str = "switch"
    remote_pci_bus_id: Optional[str] = None
    tx_kib: int = 0
    rx_kib: int = 0


@dataclass
class FakeGpu:
    name: str = "Fake GPU"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "0000:18:00.0"
    links: List[FakeLink] = field(default_factory=list)
    counters_supported: bool = True


_THROUGHPUT_IDS = {FIELD[k] for k in ("data_tx", "data_rx", "raw_tx", "raw_rx")}


class FakeNvmlBackend:
    """An NVML with scripted, deterministic counters.

    Each ``read_fields`` call advances every link's DATA counters by its ``tx_kib``/``rx_kib``
    (so after ``k`` reads link ``l`` reports ``k * tx_kib``), unless ``counter_fn`` is given:
    ``counter_fn(gpu_index, link, counter_name, read_number) -> KiB`` then defines every value.
    ``fail`` is raised from ``init`` to simulate a machine without NVML.
    """

    def __init__(self, gpus: Sequence[FakeGpu], *, driver: str = "580.00",
                 counter_fn: Optional[Callable[[int, int, str, int], int]] = None,
                 fail: Optional[NvmlUnavailable] = None):
        self.gpus = list(gpus)
        self.driver = driver
        self.counter_fn = counter_fn
        self.fail = fail
        self.reads = 0
        self.initialized = False
        self.fields_read: List[List[Tuple[int, int]]] = []

    def init(self) -> None:
        if self.fail is not None:
            raise self.fail
        self.initialized = True

    def shutdown(self) -> None:
        self.initialized = False

    def driver_version(self) -> str:
        return self.driver

    def device_count(self) -> int:
        return len(self.gpus)

    def gpu_info(self, index: int) -> GpuInfo:
        g = self.gpus[index]
        return GpuInfo(index, g.name, g.uuid, normalize_bus_id(g.pci_bus_id) or "")

    def link_info(self, index: int, link: int) -> Optional[LinkInfo]:
        links = self.gpus[index].links
        if link >= len(links):
            return None
        fl = links[link]
        return LinkInfo(link, fl.state, fl.version, fl.speed_mbps, fl.remote_type,
                        normalize_bus_id(fl.remote_pci_bus_id))

    def _counter(self, index: int, link: int, name: str, read: int) -> int:
        if self.counter_fn is not None:
            return int(self.counter_fn(index, link, name, read))
        fl = self.gpus[index].links[link]
        base = fl.tx_kib if name.endswith("tx") else fl.rx_kib
        scale = 1.25 if name.startswith("raw") else 1.0
        return int(read * base * scale)

    def read_fields(self, index: int,
                    fields: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        # Only throughput queries advance the script, so health/topology reads in between
        # do not change the counter values a test expects.
        if any(f in _THROUGHPUT_IDS for f, _ in fields):
            self.reads += 1
        self.fields_read.append(list(fields))
        gpu = self.gpus[index]
        names = {v: k for k, v in FIELD.items()}
        out: List[Optional[int]] = []
        for field_id, scope in fields:
            name = names.get(field_id)
            if name in ("data_tx", "data_rx", "raw_tx", "raw_rx"):
                if not gpu.counters_supported:
                    out.append(None)
                elif scope == SCOPE_ALL_LINKS:
                    out.append(sum(self._counter(index, l, name, self.reads)
                                   for l in range(len(gpu.links)) if gpu.links[l].state == 1))
                else:
                    out.append(self._counter(index, scope, name, self.reads))
            elif name == "state":
                out.append(gpu.links[scope].state)
            elif name == "speed_mbps":
                out.append(gpu.links[scope].speed_mbps)
            elif name in ("crc_flit", "crc_data", "replay", "recovery"):
                out.append(0)
            else:
                out.append(None)
        return out
