"""``commsched trace``: valid Trace Event Format with the expected tracks and values."""

import json
import numbers

import pytest

from commsched.telemetry import trace_main

from . import synthetic
from .helpers import MS, T0
from .synthetic import N_ITERS


def validate_trace_event_format(trace):
    """Checks the Trace Event Format rules Perfetto's JSON importer relies on."""
    assert isinstance(trace, dict)
    assert isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["pid"], int) and not isinstance(e["pid"], bool)
        assert isinstance(e.get("tid", 0), int)
        ph = e["ph"]
        if ph == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index",
                                 "thread_sort_index")
            assert set(e["args"]) <= {"name", "sort_index"} and e["args"]
        elif ph == "X":
            assert isinstance(e["ts"], numbers.Real) and isinstance(e["dur"], numbers.Real)
            assert e["dur"] >= 0 and isinstance(e["tid"], int)
            assert isinstance(e.get("args", {}), dict)
        elif ph == "i":
            assert isinstance(e["ts"], numbers.Real) and e["s"] in ("g", "p", "t")
        elif ph == "C":
            assert isinstance(e["ts"], numbers.Real) and e["args"]
            assert all(isinstance(v, numbers.Real) for v in e["args"].values())
        else:
            pytest.fail(f"unexpected phase {ph!r}")


def slices_nest_per_thread(events):
    """Complete events on one thread must not partially overlap."""
    by_thread = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        stack = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1e-6:
                stack.pop()
            if stack:
                assert end <= stack[-1] + 1e-6, "partially overlapping slices on one thread"
            stack.append(end)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    run_dir = synthetic.build(tmp_path_factory.mktemp("run"))
    out = tmp_path_factory.mktemp("out") / "trace.json"
    assert trace_main([run_dir, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_trace_is_valid_trace_event_format(trace):
    validate_trace_event_format(trace)
    slices_nest_per_thread(trace["traceEvents"])


def test_one_process_per_rank_with_named_tracks(trace):
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and "node1" in names[1]
    threads = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert {"application iterations", "lane g0 iterations", "lane g0 comm #0"} <= threads


def test_one_slice_per_chunk_step_with_its_args(trace):
    comm = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"]
    assert len(comm) == 2 * N_ITERS * 4
    first = min((e for e in comm if e["pid"] == 0), key=lambda e: e["ts"])
    # iteration 0 chunk 0 runs [20, 30] ms after T0, the trace origin (the run start)
    assert first["ts"] == pytest.approx(20_000) and first["dur"] == pytest.approx(10_000)
    assert first["args"]["bytes"] == 1 << 20
    assert (first["args"]["op"], first["args"]["step"]) == ("all_reduce", "all_reduce")
    assert first["args"]["priority"] == 0
    assert first["args"]["busbw_gbps"] == pytest.approx((1 << 20) / 10e6)


def test_chunk_is_credited_with_its_share_of_the_link_bytes(trace):
    # Iteration 1 (b = T0 + 100 ms): between the samples at b + 1 us and b + 55 ms the
    # counters grow 3584 KiB (both links) while chunks [20, 30], [30, 40], [40, 50] and half
    # of [50, 60] run, 1 MiB each: chunk [20, 30] takes 1 / 3.5 of it.
    comm = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"
            and e["pid"] == 0 and e["args"]["iteration"] == 1]
    by_index = {e["name"][-2]: e["args"] for e in comm}
    assert by_index["0"]["nvlink_tx_bytes"] == pytest.approx(3584 * 1024 / 3.5, abs=1)
    assert by_index["0"]["nvlink_expected_bytes"] == 1 << 20       # 1x on 2 ranks
    assert sum(a["nvlink_tx_bytes"] for a in by_index.values()) == pytest.approx(
        4096 * 1024, abs=4)


def test_application_iterations_and_nvlink_counters(trace):
    ev = trace["traceEvents"]
    apps = [e for e in ev if e["ph"] == "X" and e["cat"] == "iteration"
            and e["name"].startswith("iteration") and e["pid"] == 0]
    assert len(apps) == N_ITERS
    assert apps[0]["dur"] == pytest.approx(100_000)
    counters = [e for e in ev if e["ph"] == "C" and e["name"] == "NVLink GB/s" and e["pid"] == 0]
    # iteration 0: between the sample at T0 and the one at T0 + 55 ms: 3584 KiB (both links)
    c0 = min(counters, key=lambda e: e["ts"])
    assert c0["ts"] == 0
    assert c0["args"]["tx"] == pytest.approx(3584 * 1024 / (55 * MS), abs=1e-3)
    per_link = {e["name"] for e in ev if e["ph"] == "C"}
    assert {"NVLink link 0 GB/s", "NVLink link 1 GB/s"} <= per_link
    assert trace["otherData"]["t0_ns"] == T0
    per_iteration = [e for e in ev if e["ph"] == "C" and e["pid"] == 0
                     and e["name"] == "NVLink TX MB per iteration"]
    assert len(per_iteration) == N_ITERS
    assert per_iteration[1]["args"] == pytest.approx({"counted": 4096 * 1024 / 1e6,
                                                      "expected": 4 * (1 << 20) / 1e6})
    assert apps[1]["args"]["nvlink_tx_ratio"] == pytest.approx(1.0)


def test_cli_errors_exit_2(tmp_path, capsys):
    assert trace_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commsched trace: error:") and "Traceback" not in err
