"""The GPU self-check's driver, settle protocol and comparison, run on CPU with a fake NVML:
one whose counters move exactly the ring all-reduce payload, and one whose counters lag it
(as NVML's do on H200, where a window read right after synchronize misses bytes)."""

import threading

import pytest
import torch

from commsched.config import Config
from commsched.telemetry import open_recorder
from commsched.telemetry import selfcheck
from commsched.telemetry.nvml import (SCOPE_ALL_LINKS, FakeGpu, FakeLink, FakeNvmlBackend,
                                      GpuSelector)
from commsched.telemetry.selfcheck import (CounterProbe, _print, auto_ops_per_iter, compare,
                                           drive_allreduces, nvlink_allreduce_check,
                                           settle_counters)

WORLD = 2
POLL_S = 0.001          # settle poll interval in these tests (5 ms on GPUs)


class Links:
    """DATA counters of two links sharing the traffic evenly; RAW is DATA + 25%.

    With ``drain_kib`` the counters lag: every counter read makes at most ``drain_kib``
    more of the bytes moved so far visible, so right after an all-reduce they are short and
    only repeated reads catch up. Without it they are exact at once."""

    def __init__(self, drain_kib=None):
        self.lock = threading.Lock()
        self.moved_kib = 0
        self.visible_kib = 0
        self.drain_kib = drain_kib
        self.last_read = None

    def all_reduce(self, x):
        # ring all-reduce payload of one rank: 2 (n-1)/n * bytes, sent and received
        with self.lock:
            self.moved_kib += int(2 * (WORLD - 1) / WORLD * x.numel() * 4) // 1024

    def counter(self, gpu, link, name, read):
        with self.lock:
            if self.drain_kib is None:
                self.visible_kib = self.moved_kib
            elif read != self.last_read:        # one drain per query, not per field
                self.last_read = read
                self.visible_kib = min(self.moved_kib, self.visible_kib + self.drain_kib)
            per_link = self.visible_kib // 2
        return per_link * 5 // 4 if name.startswith("raw") else per_link


def run_check(tmp_path, links, sizes, *, iters=3, ops_per_iter=None, settle=True,
              settle_s=0.5):
    backend = FakeNvmlBackend([FakeGpu(links=[FakeLink(), FakeLink()])],
                              counter_fn=links.counter)
    probe = CounterProbe(backend, GpuSelector(0)).open()
    rec = open_recorder(Config(telemetry_dir=str(tmp_path)), rank=0, world_size=WORLD,
                        device=0, nvml_backend=backend,
                        nvml_period_ms=selfcheck.CHECK_PERIOD_MS)
    planned = drive_allreduces(
        rec, sizes, iters=iters, warmup=2, group_ranks=(0, 1),
        make_tensor=lambda size: torch.ones(size // 4), all_reduce=links.all_reduce,
        synchronize=lambda: None, barrier=lambda: None, ops_per_iter=ops_per_iter,
        read_counters=probe.read if settle else None, settle_s=settle_s, settle_poll_s=POLL_S)
    rec.close()
    return planned, compare(str(tmp_path), 0, WORLD, planned, sizes,
                            probe_latencies_ns=probe.latencies_ns)


def test_windows_hold_exactly_ops_allreduces_each(tmp_path):
    sizes = [64 << 10, 1 << 20]
    planned, out = run_check(tmp_path, Links(), sizes, ops_per_iter=3)
    # step 0 = start, step 1 closes the warm-up of size 1, steps 2-4 its windows,
    # step 5 the warm-up of size 2, steps 6-8 its windows
    assert [p["step"] for p in planned] == [2, 3, 4, 6, 7, 8]
    assert all(p["ops"] == 3 for p in planned)
    assert out["nvml_status"] == "ok" and out["ok"]
    for r in out["results"]:
        assert r["data_tx_bytes"] == r["expected_bytes"] == 3 * r["size"]
        assert r["ratio_tx"] == pytest.approx(1.0) and r["ratio_rx"] == pytest.approx(1.0)
        assert r["raw_tx_bytes"] == pytest.approx(1.25 * 3 * r["size"])
        assert r["link_tx_bytes"] == {0: 3 * r["size"] // 2, 1: 3 * r["size"] // 2}
        # exact counters: settled at the second read, nothing late, sample == settled value
        assert r["settled"] is True and r["late_tx_bytes"] == 0
        assert r["probe_tx_bytes"] == r["data_tx_bytes"] and r["sample_minus_probe_bytes"] == 0
    for s in out["summary"].values():
        assert s["ratio_tx_worst"] == pytest.approx(1.0) and s["unsettled"] == 0
    assert out["probe_reads"] >= 2 * 9 and out["probe_latency_ms_median"] is not None
    assert out["sample_latency_ms_median"] is not None and out["samples"] >= 9


def test_default_ops_per_iter_moves_a_gib_or_many_ops():
    assert auto_ops_per_iter(256 << 20) == 4
    assert auto_ops_per_iter(16 << 20) == 64
    assert auto_ops_per_iter(4 << 30) == 1
    assert auto_ops_per_iter(4 << 10) == selfcheck.MAX_AUTO_OPS


def test_lagging_counters_settle_before_the_boundary_sample(tmp_path):
    # 4 MiB moved per window, 512 KiB of it becomes visible per read: ~8 reads to settle
    links = Links(drain_kib=512)
    planned, out = run_check(tmp_path, links, [1 << 20], iters=4, ops_per_iter=4)
    assert out["ok"], out["summary"]
    for r in out["results"]:
        assert r["data_tx_bytes"] == r["data_rx_bytes"] == r["expected_bytes"] == 4 << 20
        assert r["settled"] is True
        # the first settle read, after every rank synchronized, was still short
        assert r["late_tx_bytes"] > 0
        assert r["sample_minus_probe_bytes"] == 0
    assert all(p["close"]["reads"] > 3 for p in planned)
    s = out["summary"][1 << 20]
    assert s["ratio_tx_median"] == s["ratio_tx_worst"] == pytest.approx(1.0)
    assert s["late_tx_bytes_max"] > 0 and s["unsettled"] == 0


def test_lagging_counters_without_settling_mismatch(tmp_path):
    # the same fake without the settle reads: boundary samples miss bytes, the check fails
    planned, out = run_check(tmp_path, Links(drain_kib=512), [1 << 20], iters=4,
                             ops_per_iter=4, settle=False)
    assert not out["ok"]
    assert all(p["open"] is None and p["close"] is None for p in planned)
    s = out["summary"][1 << 20]
    assert abs(s["ratio_tx_worst"] - 1) > selfcheck.RATIO_TOLERANCE
    assert s["ratio_tx_median"] < 0.9


def test_one_bad_window_fails_even_with_a_good_median(tmp_path):
    planned, out = run_check(tmp_path, Links(), [1 << 20], iters=3, ops_per_iter=2)
    assert out["ok"]
    # claim the middle window ran 2.1 all-reduces: its bytes are then ~5% short
    planned = [dict(p) for p in planned]
    planned[1]["ops"] = 2.1
    out = compare(out["run_dir"], 0, WORLD, planned, [1 << 20])
    s = out["summary"][1 << 20]
    assert s["ratio_tx_median"] == pytest.approx(1.0)
    assert s["ratio_tx_worst"] == pytest.approx(2 / 2.1)
    assert not out["ok"]


class NoAggregateBackend(FakeNvmlBackend):
    """Reads per link only: the aggregate (all-links) scope is unsupported."""

    def read_fields(self, index, fields):
        values = super().read_fields(index, fields)
        return [None if scope == SCOPE_ALL_LINKS else v
                for (_, scope), v in zip(fields, values)]


def test_probe_reads_aggregate_fields_or_sums_links_without_them():
    def gpu():
        return FakeGpu(links=[FakeLink(tx_kib=100, rx_kib=8), FakeLink(tx_kib=200, rx_kib=8),
                              FakeLink(state=0, tx_kib=5, rx_kib=5)])
    probe = CounterProbe(FakeNvmlBackend([gpu()]), GpuSelector(0)).open()
    assert probe.mode == "aggregate"
    assert probe.read() == (2 * 300, 2 * 16)        # the open's test read was read 1
    fallback = CounterProbe(NoAggregateBackend([gpu()]), GpuSelector(0)).open()
    assert fallback.mode == "per-link"
    assert fallback.read() == (2 * 300, 2 * 16)     # inactive link 2 left out
    assert len(fallback.latencies_ns) == 1


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def clock(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_settle_returns_the_first_value_read_twice():
    values = iter([(10, 1), (20, 2), (25, 3), (25, 3), (99, 9)])
    ft = FakeTime()
    s = settle_counters(lambda: next(values), bound_s=0.2, poll_s=0.005, clock=ft.clock,
                        sleep=ft.sleep)
    assert s["settled"] is True and s["value"] == (25, 3) and s["first"] == (10, 1)
    assert s["reads"] == 4 and s["settle_ms"] == pytest.approx(15.0)


def test_settle_needs_equal_tx_and_rx_and_honours_stable():
    values = iter([(5, 1), (5, 2), (5, 2), (5, 2), (5, 2)])
    ft = FakeTime()
    s = settle_counters(lambda: next(values), bound_s=1, poll_s=0.005, stable=3,
                        clock=ft.clock, sleep=ft.sleep)
    assert s["settled"] is True and s["value"] == (5, 2) and s["reads"] == 4


def test_settle_gives_up_at_the_bound():
    ft = FakeTime()
    count = iter(range(1000))
    s = settle_counters(lambda: (next(count), 0), bound_s=0.2, poll_s=0.005,
                        clock=ft.clock, sleep=ft.sleep)
    assert s["settled"] is False and s["settle_ms"] == pytest.approx(200.0)
    assert s["reads"] == 41 and s["value"] == (40, 0)


def test_settle_with_unreadable_counters_does_not_poll():
    ft = FakeTime()
    s = settle_counters(lambda: (None, None), bound_s=0.2, clock=ft.clock, sleep=ft.sleep)
    assert s["settled"] is None and s["reads"] == 1 and ft.t == 0


def test_print_ends_with_the_nvml_sample_latency(tmp_path, capsys):
    _, out = run_check(tmp_path, Links(drain_kib=512), [1 << 20], iters=2, ops_per_iter=4)
    _print(out)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "=> OK" in lines[-2]
    assert lines[-1].lstrip().startswith("NVML sample latency: sampler query (per link)")
    assert "settle read" in lines[-1]


def test_cli_keeps_the_old_command_line_and_adds_options(monkeypatch):
    calls = []

    def fake_check(sizes, iters, **kw):
        calls.append((sizes, iters, kw))
        return {"ok": True}

    monkeypatch.setattr(selfcheck, "nvlink_allreduce_check", fake_check)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    assert selfcheck.main(["--sizes", "16MiB,256MiB", "--iters", "10", "--dir", "D"]) == 0
    sizes, iters, kw = calls[-1]
    assert sizes == [16 << 20, 256 << 20] and iters == 10 and kw["run_dir"] == "D"
    assert kw["ops_per_iter"] is None and kw["settle_ms"] == selfcheck.SETTLE_MS
    assert kw["settle_poll_ms"] == 5 and kw["settle_stable"] == 2 and kw["nvml_per_link"]
    selfcheck.main(["--ops-per-iter", "8", "--settle-ms", "500", "--settle-poll-ms", "2",
                    "--settle-stable", "3", "--sums-only"])
    _, _, kw = calls[-1]
    assert kw["ops_per_iter"] == 8 and kw["settle_ms"] == 500 and kw["settle_poll_ms"] == 2
    assert kw["settle_stable"] == 3 and not kw["nvml_per_link"]


def test_needs_cuda():
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        nvlink_allreduce_check([1 << 20], 1)
