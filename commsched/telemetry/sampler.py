"""The NVLink sampler: one daemon thread per rank that owns every NVML call.

Timeline of one rank (the sampler never runs on the training or completion thread)::

    training thread   ──fwd──bwd──flush──step()──fwd──bwd──flush──step()──
                                          │ request()                │ request()
    completion thread ───chunk─chunk─chunk┼──chunk──────────────────┼──
    writer thread            (last chunk of an iteration) ─► request()
    sampler thread    ─S────────S───────S─S──S────────S───────────S─S──
                       periodic (period_ms)  └ on request, coalesced

Requests are coalesced through a ``threading.Event``: however many arrive while a query is
running, one more sample follows. A query is slow against a chunk ([Note: NVLink
counters] in docs/design.md), so requests must stay at iteration granularity, never per
chunk. With per-link sampling on, only samples requested with
``per_link`` read every link (application iteration boundaries; the end of a lane
iteration's communication when the application marks no boundaries; the first and the last
sample); the others read the sums, which is all a tight window around one iteration's or
one collective's communication needs. Every sample's sums come from the all-links
counters, so they form one series.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..threads import start_thread
from .nvml import (FIELD, HEALTH_COUNTERS, SCOPE_ALL_LINKS, GpuInfo, GpuSelector, LinkInfo,
                   NvmlBackend, NvmlUnavailable, discover_links, resolve_gpu)

__all__ = ["CounterSample", "HealthSample", "NvmlStatus", "NvlinkSampler", "COUNTERS"]

COUNTERS = ("data_tx", "data_rx", "raw_tx", "raw_rx")
ALL_LINKS = -1          # the link number under which sums over links are stored


@dataclass(frozen=True)
class CounterSample:
    """Cumulative NVLink counters (KiB) read at ``t_ns``: ``links[link] = (data_tx, data_rx,
    raw_tx, raw_rx)``, None where not sampled. ``links[-1]`` holds sums over links."""

    t_ns: int
    latency_ns: int
    links: Dict[int, Tuple[Optional[int], ...]]


@dataclass(frozen=True)
class HealthSample:
    """Per-link state, speed and error counters (``HEALTH_COUNTERS`` order) at ``t_ns``."""

    t_ns: int
    links: Dict[int, Tuple[Optional[int], ...]]


@dataclass(frozen=True)
class NvmlStatus:
    """Outcome of NVML start-up (once per run): ``status`` is ``ok`` or why not, and the
    topology when known. Also posted with ``status="error"`` if sampling later fails."""

    status: str
    detail: str = ""
    driver: Optional[str] = None
    gpu: Optional[GpuInfo] = None
    links: List[LinkInfo] = field(default_factory=list)


class NvlinkSampler:
    """Samples one GPU's NVLink counters on a period and on request, posting
    :class:`NvmlStatus`, :class:`CounterSample` and :class:`HealthSample` objects to ``sink``
    (the recorder's queue). ``clock`` is injectable so tests get deterministic times."""

    def __init__(self, backend: NvmlBackend, selector: GpuSelector,
                 sink: Callable[[object], None], *, period_s: float = 0.1,
                 per_link: bool = True, health_period_s: float = 1.0,
                 clock: Callable[[], int] = time.time_ns):
        self.backend = backend
        self.selector = selector
        self.sink = sink
        self.period_s = period_s
        self.per_link = per_link
        self.health_period_s = health_period_s
        self.clock = clock
        self.gpu: Optional[GpuInfo] = None
        self.links: List[LinkInfo] = []
        self._sums_query: List[Tuple[int, int]] = []
        self._full_query: List[Tuple[int, int]] = []
        self._health_broken = False
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._requested = 0
        self._served = 0
        self._links_requested = False
        self._alive = False
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # --- control, any thread -----------------------------------------------------------------
    def start(self) -> None:
        self._alive = True
        self._thread = start_thread(self._run, "commsched-nvml", "cs-nvml")

    def request(self, per_link: bool = True) -> int:
        """Ask for a sample as soon as possible, reading every link if ``per_link`` (and the
        sampler samples per link); returns a ticket for :meth:`sync`. Cheap (a lock and an
        Event.set): safe on the training thread."""
        with self._cond:
            self._requested += 1
            self._links_requested = self._links_requested or per_link
            ticket = self._requested
        self._wake.set()
        return ticket

    def sync(self, timeout: float = 10.0) -> bool:
        """Block until a sample taken after this call has been posted (False on timeout)."""
        if not self._alive:
            return True
        ticket = self.request()
        with self._cond:
            return self._cond.wait_for(lambda: self._served >= ticket or not self._alive,
                                       timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Take a last sample (so the final iteration is bracketed) and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- sampler thread ----------------------------------------------------------------------
    def open(self) -> NvmlStatus:
        """Initialise NVML, find the GPU and its links, and build the counter query."""
        self.backend.init()
        driver = self.backend.driver_version()
        self.gpu = resolve_gpu(self.backend, self.selector)
        self.links = discover_links(self.backend, self.gpu)
        active = [l.link for l in self.links if l.state == 1]
        if not active:
            raise NvmlUnavailable("no_nvlink", f"{self.gpu.name} ({self.gpu.pci_bus_id}) has "
                                  f"{len(self.links)} NVLinks, none active")
        self._sums_query = [(FIELD[c], SCOPE_ALL_LINKS) for c in COUNTERS]
        self._full_query = self._sums_query
        if self.per_link:
            # Per-link DATA locates traffic on links; RAW only as sums, to keep the query
            # short. The sums of every sample come from the all-links counters.
            self._full_query = [(FIELD[c], l) for l in active for c in ("data_tx", "data_rx")]
            self._full_query += self._sums_query
        return NvmlStatus("ok", f"{len(active)} active links, "
                          f"{'per-link' if self.per_link else 'sum over links'} counters",
                          driver, self.gpu, list(self.links))

    def sample_once(self, per_link: bool = True) -> CounterSample:
        """One counter query: every link's DATA counters too when ``per_link`` and the
        sampler samples per link, else the sums. The sample's time is the midpoint of the
        call, which is what the counters are closest to when the query takes milliseconds."""
        query = self._full_query if per_link else self._sums_query
        t0 = self.clock()
        values = self.backend.read_fields(self.gpu.index, query)
        t1 = self.clock()
        links: Dict[int, List[Optional[int]]] = {}
        for (field_id, scope), value in zip(query, values):
            link = ALL_LINKS if scope == SCOPE_ALL_LINKS else scope
            slot = COUNTERS.index(_COUNTER_BY_FIELD[field_id])
            links.setdefault(link, [None] * len(COUNTERS))[slot] = value
        return CounterSample((t0 + t1) // 2, t1 - t0,
                             {l: tuple(v) for l, v in sorted(links.items())})

    def health_once(self) -> Optional[HealthSample]:
        """Link state, speed and error counters; None once they proved unreadable (some
        drivers or vGPUs refuse them), which must not stop the throughput sampling."""
        if self._health_broken:
            return None
        query = [(FIELD[c], l.link) for l in self.links for c in HEALTH_COUNTERS]
        try:
            values = self.backend.read_fields(self.gpu.index, query) if query else []
        except Exception:
            self._health_broken = True
            return None
        t = self.clock()
        n = len(HEALTH_COUNTERS)
        links = {l.link: tuple(values[i * n:(i + 1) * n]) for i, l in enumerate(self.links)}
        return HealthSample(t, links)

    def _run(self) -> None:
        try:
            status = self.open()
        except NvmlUnavailable as exc:
            self._finish(NvmlStatus(exc.status, exc.detail, links=list(self.links),
                                    gpu=self.gpu))
            return
        except Exception as exc:  # an NVML failure must never reach training
            self._finish(NvmlStatus("error", f"NVML start-up failed: {exc!r}"))
            return
        try:
            first = self.sample_once()
            if all(v is None for v in first.links.get(ALL_LINKS, (None,))[:2]):
                self._finish(NvmlStatus("counters_unsupported",
                                        "NVLink throughput fields 138-141 not supported",
                                        status.driver, status.gpu, status.links))
                return
            self.sink(status)
            self.sink(first)
            self._post_health()
            self._loop()
        except Exception as exc:
            self._finish(NvmlStatus("error", f"NVML sampling failed: {exc!r}",
                                    status.driver, status.gpu, status.links))
            return
        self._finish(None)

    def _loop(self) -> None:
        next_sample = time.monotonic() + self.period_s
        next_health = time.monotonic() + self.health_period_s
        while True:
            stopping = self._stopping
            if not stopping:
                self._wake.wait(timeout=max(0.0, next_sample - time.monotonic()))
                stopping = self._stopping
            self._wake.clear()
            with self._cond:
                ticket = self._requested
                per_link, self._links_requested = self._links_requested, False
            self.sink(self.sample_once(per_link=per_link or stopping))
            with self._cond:
                self._served = ticket
                self._cond.notify_all()
            now = time.monotonic()
            next_sample = now + self.period_s
            if stopping or now >= next_health:
                self._post_health()
                next_health = now + self.health_period_s
            if stopping:
                return

    def _post_health(self) -> None:
        health = self.health_once()
        if health is not None:
            self.sink(health)

    def _finish(self, status: Optional[NvmlStatus]) -> None:
        if status is not None:
            self.sink(status)
        try:
            self.backend.shutdown()
        except Exception:
            pass
        with self._cond:
            self._alive = False
            self._cond.notify_all()


_COUNTER_BY_FIELD = {FIELD[c]: c for c in COUNTERS}
