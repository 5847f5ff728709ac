"""The report's communication busy time, exposed communication and efficiency against the
floor, computed from the stored rows."""

import json

import pytest

from commsched.floor import save_floor
from commsched.telemetry import load_run, report_main, trace_main
from commsched.telemetry.analysis import analyze
from commsched.telemetry.writer import StepMarker

from . import synthetic
from .helpers import MS, T0, chunk, iteration, write_run


def test_exposed_comm_is_the_busy_time_after_the_end_of_backward(tmp_path):
    """One 100 ms iteration, backward ends (flush) at 50 ms; collectives [40, 60] and
    [80, 90]: busy 30 ms, of it after the flush [50, 60] and [80, 90]: 20 ms (the link
    idle from 60 to 80 ms is not communication)."""
    msgs = [chunk(key="a", start=T0 + 40 * MS, end=T0 + 60 * MS),
            chunk(key="b", start=T0 + 80 * MS, end=T0 + 90 * MS),
            iteration(first_submit=T0 + 30 * MS, flush=T0 + 50 * MS, requests=2, chunks=2),
            StepMarker(0, T0 + 100 * MS)]
    write_run(str(tmp_path), 0, msgs, world_size=2)
    [r] = analyze(load_run(str(tmp_path)))["rows"]
    assert r["comm_ms"] == pytest.approx(30)
    assert r["exposed_comm_ms"] == pytest.approx(20)
    assert r["compute_ms"] == pytest.approx(80)
    assert r["efficiency"] is None                   # no floor known


@pytest.fixture(scope="module")
def run_with_floor(tmp_path_factory):
    """The synthetic run as one launch's subdirectory of a run directory whose floor.json
    says compute only 85 ms, comm only 40 ms."""
    base = tmp_path_factory.mktemp("runs")
    run_dir = synthetic.build(base / "launch0")
    save_floor(str(base), {"source": "test", "compute_only_ms": 85.0, "comm_only_ms": 40.0})
    return run_dir


def test_efficiency_is_the_floor_over_each_iteration(run_with_floor, capsys):
    assert report_main([run_with_floor, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor"]["floor_ms"] == 85.0
    assert report["floor"]["limited_by"] == "compute_only"
    rows = {(r["rank"], r["iteration"]): r for r in report["rows"]}
    assert rows[(0, 1)]["efficiency"] == pytest.approx(85 / 100)
    assert rows[(0, 5)]["efficiency"] == pytest.approx(85 / 150)
    assert report["summary"]["0"]["efficiency_median"] == pytest.approx(0.85)


def test_text_report_states_the_floor_and_the_efficiency(run_with_floor, capsys):
    assert report_main([run_with_floor]) == 0
    out = capsys.readouterr().out
    assert "floor 85.00 ms = max(compute only 85.00, comm only 40.00), limited by compute " \
           "only" in out
    assert "rank 0: efficiency 85.0% (floor / median iteration 100.00 ms)" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("iter "))
    assert "comm busy" in header and "eff%" in header and "exp MB" in header


def test_trace_has_communication_and_efficiency_counters(run_with_floor, tmp_path):
    out = tmp_path / "trace.json"
    assert trace_main([run_with_floor, "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    comm = [e for e in events if e["name"] == "communication ms per iteration"
            and e["pid"] == 0]
    eff = [e for e in events if e["name"] == "efficiency" and e["pid"] == 0]
    assert len(comm) == len(eff) == synthetic.N_ITERS
    assert comm[1]["args"] == pytest.approx({"busy": 40.0, "exposed": 10.0})
    assert eff[1]["args"]["efficiency"] == pytest.approx(0.85)


def test_plot_draws_the_floor(run_with_floor, tmp_path):
    out = tmp_path / "report.png"
    assert report_main([run_with_floor, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
