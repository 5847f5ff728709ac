"""NVML backend, topology discovery and the sampler, against a fake NVML with deterministic
counters."""

import queue
import time
import threading

import pytest

from commsched.telemetry.nvml import (FIELD, SCOPE_ALL_LINKS, FakeGpu, FakeLink,
                                      FakeNvmlBackend, GpuSelector, NvmlUnavailable,
                                      PynvmlBackend, discover_links, normalize_bus_id)
from commsched.telemetry.sampler import (ALL_LINKS, CounterSample, HealthSample, NvlinkSampler,
                                         NvmlStatus)


def two_gpu_backend(**kw):
    """GPU 0: link 0 to GPU 1 directly, links 1-2 to an NVSwitch, link 3 inactive.
    DATA per read: link l sends (l+1)*100 KiB and receives 8 KiB."""
    gpu0 = FakeGpu(name="G0", uuid="GPU-aaaa", pci_bus_id="00000000:18:00.0", links=[
        FakeLink(remote_type="gpu", remote_pci_bus_id="00000000:2A:00.0", tx_kib=100, rx_kib=8),
        FakeLink(remote_type="switch", remote_pci_bus_id="FFFFFFFF:FF:FF.F", tx_kib=200,
                 rx_kib=8),
        FakeLink(remote_type="switch", tx_kib=300, rx_kib=8),
        FakeLink(state=0, tx_kib=0, rx_kib=0),
    ])
    gpu1 = FakeGpu(name="G1", uuid="GPU-bbbb", pci_bus_id="0000:2a:00.0",
                   links=[FakeLink(remote_type="gpu", remote_pci_bus_id="0000:18:00.0")])
    return FakeNvmlBackend([gpu0, gpu1], **kw)


class Clock:
    """A clock that advances 1000 ns per reading."""

    def __init__(self):
        self.t = 0

    def __call__(self):
        self.t += 1000
        return self.t


def opened(backend, per_link=True, sink=None):
    s = NvlinkSampler(backend, GpuSelector(0), sink or (lambda m: None), per_link=per_link,
                      clock=Clock())
    status = s.open()
    return s, status


def test_bus_ids_normalize_and_switch_ids_are_none():
    assert normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bus_id(b"0000:2A:00.0\x00") == "0000:2a:00.0"
    assert normalize_bus_id("FFFFFFFF:FF:FF.F") is None
    assert normalize_bus_id("") is None


def test_topology_resolves_direct_gpu_peers_only():
    links = discover_links(two_gpu_backend(), two_gpu_backend().gpu_info(0))
    assert [l.link for l in links] == [0, 1, 2, 3]
    assert links[0].remote_type == "gpu" and links[0].peer_gpu_index == 1
    assert links[1].remote_type == "switch" and links[1].peer_gpu_index is None
    assert links[1].remote_pci_bus_id is None
    assert links[3].state == 0
    assert links[0].speed_mbps == 26562


def test_gpu_is_found_by_uuid_before_index():
    s = NvlinkSampler(two_gpu_backend(), GpuSelector(0, uuid="bbbb"), lambda m: None)
    s.open()
    assert s.gpu.index == 1


def test_per_link_query_scopes_every_field_to_its_link():
    backend = two_gpu_backend()
    s, status = opened(backend)
    assert status.status == "ok"
    s.sample_once()
    fields = backend.fields_read[-1]
    # DATA TX/RX for each active link (0, 1, 2) as (field, link) pairs, then the four
    # counters over all links (the sums every sample has).
    assert fields == [(138, 0), (139, 0), (138, 1), (139, 1), (138, 2), (139, 2),
                      (138, SCOPE_ALL_LINKS), (139, SCOPE_ALL_LINKS),
                      (140, SCOPE_ALL_LINKS), (141, SCOPE_ALL_LINKS)]
    s.sample_once(per_link=False)
    assert backend.fields_read[-1] == [(f, SCOPE_ALL_LINKS) for f in (138, 139, 140, 141)]


def test_sum_only_query_uses_the_all_links_scope():
    backend = two_gpu_backend()
    s, _ = opened(backend, per_link=False)
    sample = s.sample_once()
    assert backend.fields_read[-1] == [(f, SCOPE_ALL_LINKS) for f in (138, 139, 140, 141)]
    # one read: tx 100+200+300 = 600 KiB, rx 3*8 = 24, RAW = 1.25x DATA in the fake
    assert sample.links == {ALL_LINKS: (600, 24, 750, 30)}


def test_samples_give_per_link_counters_sums_and_deltas():
    s, _ = opened(two_gpu_backend())
    first, second, third = s.sample_once(), s.sample_once(), s.sample_once()
    # after k reads link l holds k*(l+1)*100 KiB TX, k*8 KiB RX
    assert third.links[0][:2] == (300, 24)
    assert third.links[2][:2] == (900, 24)
    # link sums: 3 * (100+200+300) TX, 3*24 RX; RAW from the all-links scope, 1.25x DATA
    assert third.links[ALL_LINKS] == (1800, 72, 2250, 90)
    # per-sample deltas on link 1: 200 KiB per read
    assert second.links[1][0] - first.links[1][0] == 200
    # the sample time is the midpoint of the query (clock ticks 1000 ns per reading)
    assert (first.t_ns, first.latency_ns) == (1500, 1000)


def test_health_sample_reads_state_speed_and_errors_per_link():
    s, _ = opened(two_gpu_backend())
    h = s.health_once()
    assert h.links[0] == (1, 26562, 0, 0, 0, 0)
    assert h.links[3][0] == 0


def run_sampler(backend, **kw):
    """Start a sampler thread with a long period and collect what it posts."""
    q = queue.SimpleQueue()
    s = NvlinkSampler(backend, GpuSelector(0), q.put, period_s=kw.pop("period_s", 60.0), **kw)
    s.start()
    return s, q


def drain(q):
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def test_thread_samples_on_request_and_once_more_at_stop():
    s, q = run_sampler(two_gpu_backend())
    assert s.sync(timeout=10)           # a sample taken after the request was posted
    s.stop()
    msgs = drain(q)
    statuses = [m for m in msgs if isinstance(m, NvmlStatus)]
    samples = [m for m in msgs if isinstance(m, CounterSample)]
    assert [st.status for st in statuses] == ["ok"]
    # first sample at start, one for the request, one final sample at stop (period is 60 s)
    assert len(samples) == 3
    assert all(set(m.links) == {0, 1, 2, ALL_LINKS} for m in samples)     # every link
    assert any(isinstance(m, HealthSample) for m in msgs)


def test_a_request_without_per_link_reads_the_sums():
    s, q = run_sampler(two_gpu_backend())
    s.request(per_link=False)
    time.sleep(0.3)
    assert s.sync(timeout=10)           # per link
    s.stop()
    samples = [m for m in drain(q) if isinstance(m, CounterSample)]
    assert [set(m.links) for m in samples] == [
        {0, 1, 2, ALL_LINKS}, {ALL_LINKS}, {0, 1, 2, ALL_LINKS}, {0, 1, 2, ALL_LINKS}]


def test_periodic_samples_read_only_the_sums():
    s, q = run_sampler(two_gpu_backend(), period_s=0.05)
    # At least four samples (the start and three periodic ones) before stopping, however
    # slowly the thread gets the CPU on a loaded machine.
    deadline = time.monotonic() + 30
    while q.qsize() < 8 and time.monotonic() < deadline:     # (status, health messages too)
        time.sleep(0.05)
    s.stop()
    samples = [m for m in drain(q) if isinstance(m, CounterSample)]
    # the first (start) and last (stop) samples bound the run: every link; in between,
    # nothing was requested: the sums only, still one series with the others'
    assert set(samples[0].links) == set(samples[-1].links) == {0, 1, 2, ALL_LINKS}
    periodic = samples[1:-1]
    assert len(periodic) >= 3 and all(set(m.links) == {ALL_LINKS} for m in periodic)
    tx = [m.links[ALL_LINKS][0] for m in samples]
    assert tx == sorted(tx) and len(set(tx)) == len(tx)


@pytest.mark.parametrize("backend, status", [
    (FakeNvmlBackend([], fail=NvmlUnavailable("no_nvml", "driver not loaded")), "no_nvml"),
    (FakeNvmlBackend([FakeGpu(links=[])]), "no_nvlink"),
    (FakeNvmlBackend([FakeGpu(links=[FakeLink(state=0)])]), "no_nvlink"),
    (FakeNvmlBackend([FakeGpu(links=[FakeLink()], counters_supported=False)]),
     "counters_unsupported"),
])
def test_missing_nvml_or_nvlink_is_reported_once_and_sampling_stops(backend, status):
    s, q = run_sampler(backend)
    s._thread.join(10)
    assert not s._thread.is_alive()
    assert s.sync(timeout=1)            # never blocks on a sampler that is gone
    msgs = drain(q)
    assert [m.status for m in msgs if isinstance(m, NvmlStatus)] == [status]
    assert not any(isinstance(m, CounterSample) for m in msgs)


def test_sampling_error_midway_is_reported_and_the_thread_ends():
    backend = two_gpu_backend()
    boom = threading.Event()
    original = backend.read_fields

    def flaky(index, fields):
        if boom.is_set():
            raise RuntimeError("GPU is lost")
        return original(index, fields)
    backend.read_fields = flaky
    s, q = run_sampler(backend)
    assert s.sync(timeout=10)
    boom.set()
    s.request()
    s._thread.join(10)
    statuses = [m for m in drain(q) if isinstance(m, NvmlStatus)]
    assert [st.status for st in statuses] == ["ok", "error"]
    assert "GPU is lost" in statuses[-1].detail


def test_real_pynvml_backend_reports_why_it_is_unavailable_here():
    backend = PynvmlBackend()
    try:
        backend.init()
    except NvmlUnavailable as exc:
        assert exc.status in ("no_pynvml", "no_nvml")
    else:  # pragma: no cover - only on a machine with an NVIDIA driver
        backend.shutdown()
        pytest.skip("NVML is available on this machine")


def test_field_ids_match_nvml_headers():
    pynvml = pytest.importorskip("pynvml")
    assert FIELD["data_tx"] == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert FIELD["raw_rx"] == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX
    assert FIELD["speed_mbps"] == pynvml.NVML_FI_DEV_NVLINK_GET_SPEED
    assert FIELD["state"] == pynvml.NVML_FI_DEV_NVLINK_GET_STATE
    assert FIELD["replay"] == pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL


# --- the real backend's field buffer, against a fake library ----------------------------------

class _FakeLib:
    """What _FieldBuffer uses of pynvml: the struct, the error, a function pointer. The
    function writes ``value = fieldId * 10 + scopeId`` into ``count + overrun`` entries."""

    def __init__(self, overrun=0, ret=0):
        import pynvml
        self.c_nvmlFieldValue_t = pynvml.c_nvmlFieldValue_t
        self.NVMLError = pynvml.NVMLError
        self.overrun, self.ret, self.calls = overrun, ret, 0

    def _nvmlGetFunctionPointer(self, name):
        assert name == "nvmlDeviceGetFieldValues"

        def fn(handle, count, array_ref):
            import ctypes
            self.calls += 1
            array = ctypes.cast(ctypes.addressof(array_ref._obj),
                                ctypes.POINTER(self.c_nvmlFieldValue_t))
            for i in range(count.value + self.overrun):
                entry = array[i]
                entry.valueType, entry.nvmlReturn = 3, 0        # unsigned long long
                entry.value.ullVal = entry.fieldId * 10 + entry.scopeId
            return self.ret
        return fn


def test_field_buffer_reads_values_and_reuses_its_array():
    pytest.importorskip("pynvml")
    from commsched.telemetry.nvml import _FieldBuffer
    lib = _FakeLib()
    buffer = _FieldBuffer(lib, [(138, 0), (139, 5)])
    array = buffer.array
    assert buffer.read(None) == [1380, 1395]
    assert buffer.read(None) == [1380, 1395] and buffer.array is array and lib.calls == 2


def test_field_buffer_guard_catches_a_library_writing_past_the_end():
    pytest.importorskip("pynvml")
    from commsched.telemetry.nvml import _FieldBuffer
    lib = _FakeLib(overrun=3)
    buffer = _FieldBuffer(lib, [(138, 1)])
    with pytest.warns(RuntimeWarning, match="wrote past the 1 field values"):
        assert buffer.read(None) == [1381]
    guard = bytes(buffer.guard)
    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("error")                 # warned once; the guard is restored
        assert buffer.read(None) == [1381]
    import ctypes
    assert ctypes.string_at(buffer.guard_at, len(guard)) == guard


def test_field_buffer_raises_the_library_error():
    pytest.importorskip("pynvml")
    from commsched.telemetry.nvml import _FieldBuffer
    lib = _FakeLib(ret=3)                        # NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(lib.NVMLError):
        _FieldBuffer(lib, [(138, 1)]).read(None)
