"""NVLink bytes per iteration when samples and iterations do not line up.

A rank whose host runs more than an iteration ahead of its GPU takes its NVLink samples at
host events, which fall inside the device's communication of some other iteration. The
counters are read from a physical model here: every collective moves its ring share
(2(n-1)/n of its bytes; 1x on 2 ranks) evenly over its device interval, so the bytes that
each iteration put on the links are known exactly, and the report must find them.

Device timeline of iteration k (b_k = T0 + k * 100 ms), 2 ranks, 2 links::

    0        20                          90      100
    |  fwd   |  bwd: 7 all-reduces of 10 ms      |
                              ^ sample at b_k + 55 (the host asked for it at its end of
                                iteration k + 1, 150 ms ahead of the device)

Iteration k's all-reduces carry (1 + k % 3) MiB each, so neighbouring iterations differ.
"""

import pytest

from commsched.telemetry import load_run
from commsched.telemetry.analysis import analyze
from commsched.telemetry.nvml import GpuInfo, LinkInfo
from commsched.telemetry.sampler import CounterSample, NvmlStatus
from commsched.telemetry.writer import StepMarker

from .helpers import MS, T0, chunk, iteration, write_run

MIB = 1 << 20
ITERS = 8
PERIOD_MS = 100
HOST_AHEAD_MS = 150
CHUNKS = 7


def payload(k):
    return (1 + k % 3) * MIB


def spans(k):
    """(start, end, bytes) of iteration k's all-reduces on the device."""
    b = T0 + k * PERIOD_MS * MS
    return [(b + (20 + 10 * i) * MS, b + (30 + 10 * i) * MS, payload(k)) for i in range(CHUNKS)]


def all_spans():
    return [s for k in range(ITERS) for s in spans(k)]


def sent_bytes(t):
    """Bytes on the rank's links by time t: each all-reduce's 1x share, evenly over its
    interval (a ring all-reduce on 2 ranks sends its whole payload once)."""
    total = 0.0
    for start, end, nbytes in all_spans():
        total += nbytes * min(max((t - start) / (end - start), 0.0), 1.0)
    return total


def sample(t):
    kib = int(sent_bytes(t)) // 1024
    half = kib // 2
    per = {0: (half, half, None, None), 1: (kib - half, kib - half, None, None),
           -1: (kib, kib, None, None)}
    return CounterSample(t, 1000, per)


def messages(step_markers):
    links = [LinkInfo(l, 1, 6, 26562, "switch", None) for l in range(2)]
    msgs = [NvmlStatus("ok", "2 active links", "580.00",
                       GpuInfo(0, "Fake", "GPU-0", "0000:10:00.0"), links),
            sample(T0)]
    for k in range(ITERS):
        b = T0 + k * PERIOD_MS * MS
        for i, (start, end, nbytes) in enumerate(spans(k)):
            msgs.append(chunk(iteration=k, key=f"bucket{i}", nbytes=nbytes, start=start,
                              end=end, submit=start - HOST_AHEAD_MS * MS,
                              dispatch=start - HOST_AHEAD_MS * MS, priority=i))
        flush = b + (90 - HOST_AHEAD_MS) * MS
        msgs.append(iteration(iteration=k, first_submit=b + (20 - HOST_AHEAD_MS) * MS,
                              flush=max(flush, T0 + k * MS + MS // 5), requests=CHUNKS,
                              chunks=CHUNKS,
                              nbytes=CHUNKS * payload(k)))
        if step_markers:
            # the application's step, on the host, and the sample it asked for just after
            t_step = max(b + (PERIOD_MS - HOST_AHEAD_MS) * MS, T0 + k * MS + MS // 2)
            msgs += [StepMarker(k, t_step), sample(t_step + MS)]
        msgs.append(sample(b + 55 * MS))
    msgs.append(sample(T0 + (ITERS * PERIOD_MS + 50) * MS))
    return msgs


@pytest.fixture(params=[False, True], ids=["no_step_markers", "step_markers"])
def report(request, tmp_path):
    write_run(str(tmp_path), 0, messages(step_markers=request.param), world_size=2)
    return analyze(load_run(str(tmp_path)))


def test_each_iteration_gets_the_bytes_its_collectives_put_on_the_links(report):
    rows = report["rows"]
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    for r in rows:
        k = r["iteration"]
        sent = CHUNKS * payload(k)          # 1x the payload on 2 ranks
        assert r["nvlink_tx_bytes"] == pytest.approx(sent, rel=1e-3), k
        assert r["nvlink_rx_bytes"] == pytest.approx(sent, rel=1e-3), k
        assert sum(r["link_tx_bytes"].values()) == pytest.approx(sent, rel=1e-3), k


def test_the_run_total_is_what_the_links_carried(report):
    counted = sum(r["nvlink_tx_bytes"] for r in report["rows"])
    assert counted == pytest.approx(sum(n for _, _, n in all_spans()), rel=1e-3)
    assert report["summary"][0]["nvlink_tx_bytes_total"] == pytest.approx(counted)
