"""``commsched report`` on a synthetic run with hand-computed values (see synthetic.py)."""

import json

import pytest

from commsched.telemetry import load_run, report_main
from commsched.telemetry.analysis import RankData, analyze

from . import synthetic
from .synthetic import MIB, SPEED_MBPS


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return synthetic.build(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def result(run_dir):
    return analyze(load_run(run_dir))


def row(result, rank, k):
    return next(r for r in result["rows"] if (r["rank"], r["iteration"]) == (rank, k))


def test_normal_iteration_values(result):
    r = row(result, 0, 1)
    assert r["iteration_ms"] == pytest.approx(100)
    assert r["comm_ms"] == pytest.approx(40)           # chunks 20..60 back to back
    assert r["exposed_comm_ms"] == pytest.approx(10)   # last end 60 - flush 50
    assert r["compute_ms"] == pytest.approx(90)
    assert r["overlap_pct"] == pytest.approx(75)       # 1 - 10/40
    assert r["bytes"] == 4 * MIB
    assert r["chunk_steps"] == 4
    # all_reduce over 2 ranks: factor 1 -> 4 MiB / 40 ms
    assert r["busbw_gbps"] == pytest.approx(4 * MIB / 40e6)
    # NVLink: 2 x 2048 KiB between the samples after the two step markers
    assert r["nvlink_tx_bytes"] == 4096 * 1024
    assert r["nvlink_tx_gbps"] == pytest.approx(4096 * 1024 / 40e6)
    assert r["nvlink_util"] == pytest.approx(4096 * 1024 / 40e6 / (2 * SPEED_MBPS / 1000))
    assert r["link_tx_bytes"] == {0: 2048 * 1024, 1: 2048 * 1024}


@pytest.mark.parametrize("k, idle, widest, at", [
    (1, 60, 40, 60),        # chunks 20..60 of 100 ms: idle 0..20 and 60..100
    (5, 110, 70, 0),        # chunks 70..110 of 150 ms
    (7, 60, 40, 110),       # chunks 20..110 of 150 ms
    (0, 60, 40, 60)])       # the first iteration, from the run start
def test_link_idle_time_and_widest_gap(result, k, idle, widest, at):
    r = row(result, 0, k)
    assert r["link_idle_ms"] == pytest.approx(idle)
    assert r["widest_gap_ms"] == pytest.approx(widest)
    assert r["widest_gap_at_ms"] == pytest.approx(at)
    # named by the collectives around it, in this iteration or the neighbouring one
    assert (r["widest_gap_after"], r["widest_gap_before"]) == ("g0/bucket0#3", "g0/bucket0#0")


def test_the_last_iterations_widest_gap_has_no_collective_after_it(result):
    r = row(result, 0, 9)
    assert (r["widest_gap_after"], r["widest_gap_before"]) == ("g0/bucket0#3", None)
    s = result["summary"][0]
    assert s["link_idle_ms_median"] == pytest.approx(60)
    assert s["widest_gap_usual"] == {"after": "g0/bucket0#3", "before": "g0/bucket0#0",
                                     "iterations": 9, "of": 10}


@pytest.mark.parametrize("k, unsubmitted, queued", [
    # Each chunk 0 is submitted at b + 10 and issued when it starts: before it, 10 ms not
    # yet submitted and the rest queued; the last gap waits for the next iteration's
    # submission (none after iteration 9).
    (1, 10 + 40, 10),       # gaps 0..20 and 60..100
    (5, 10 + 40, 60),       # gaps 0..70 and 110..150
    (9, 10 + 40, 10)])      # gaps 0..20 and 110..150 (nothing after it)
def test_link_idle_split_on_the_synthetic_run(result, k, unsubmitted, queued):
    r = row(result, 0, k)
    assert r["idle_unsubmitted_ms"] == pytest.approx(unsubmitted)
    assert r["idle_queued_ms"] == pytest.approx(queued)
    assert r["idle_issued_ms"] == 0
    assert unsubmitted + queued == pytest.approx(r["link_idle_ms"])


def test_link_idle_is_split_by_where_the_collective_ending_each_gap_was(tmp_path):
    """One iteration of 100 ms, three collectives (ms after its start):

      collective  submitted  issued  on the device   the gap it ends: unsubmitted/queued/issued
      a           0          5       10-30           0-10:  0 / 5 / 5
      b           40         50      60-70           30-60: 10 / 10 / 10
      c           75         78      80-90           70-80: 5 / 3 / 2
      (none)                                         90-100: 10 / 0 / 0
    """
    from commsched.telemetry.writer import StepMarker
    from .helpers import MS, T0, chunk, iteration, write_run
    times = {"a": (0, 5, 10, 30), "b": (40, 50, 60, 70), "c": (75, 78, 80, 90)}
    msgs = [chunk(key=key, submit=T0 + s * MS, dispatch=T0 + d * MS, start=T0 + a * MS,
                  end=T0 + e * MS) for key, (s, d, a, e) in times.items()]
    msgs += [iteration(first_submit=T0, flush=T0 + 75 * MS, requests=3, chunks=3),
             StepMarker(0, T0 + 100 * MS)]
    write_run(str(tmp_path), 0, msgs, world_size=1)
    [r] = analyze(load_run(str(tmp_path)))["rows"]
    assert r["link_idle_ms"] == pytest.approx(60)
    assert (r["idle_unsubmitted_ms"], r["idle_queued_ms"], r["idle_issued_ms"]) == \
        pytest.approx((25, 18, 17))
    assert r["widest_gap_ms"] == pytest.approx(30)
    assert (r["widest_gap_after"], r["widest_gap_before"]) == ("g0/a#0", "g0/b#0")


def test_first_iteration_starts_at_the_run_start(result):
    r = row(result, 1, 0)
    assert r["iteration_ms"] == pytest.approx(100)
    assert r["nvlink_tx_bytes"] == 4096 * 1024


def test_summary_medians(result):
    s = result["summary"][0]
    assert s["iterations"] == 10
    assert s["iteration_ms_median"] == pytest.approx(100)   # seven 100s, three 150s
    assert s["bytes_total"] == 10 * 4 * MIB
    assert s["nvlink_tx_bytes_total"] == 10 * 4096 * 1024      # 4096 KiB every iteration


def test_outliers_are_found_and_attributed(result):
    got = {(o["rank"], o["iteration"]): o for o in result["outliers"]}
    # median 100, MAD 0 -> floor 1 ms -> threshold 103 ms
    assert sorted(got) == [(r, k) for r in (0, 1) for k in (5, 7, 9)]
    assert got[(0, 5)]["threshold_ms"] == pytest.approx(103)
    assert got[(0, 5)]["cause"] == "application"
    assert got[(0, 7)]["cause"] == "communication library"
    assert got[(0, 9)]["cause"] == "hardware"
    assert any("link 1 carried 0.0%" in e for e in got[(0, 9)]["evidence"])


def test_health_changes_blame_hardware():
    run_rows = {"runs": [{"rank": 0}], "comm_ops": [], "iterations": [], "app_steps": [],
                "nvlink_metrics": [], "intra_node_topo": [], "nvlink_health": [
                    {"rank": 0, "t_ns": 0, "link": 3, "state": 1, "speed_mbps": 26562,
                     "crc_flit": 0, "crc_data": 0, "replay": 5, "recovery": 0},
                    {"rank": 0, "t_ns": 100, "link": 3, "state": 0, "speed_mbps": 26562,
                     "crc_flit": 0, "crc_data": 0, "replay": 9, "recovery": 0}]}

    class Run:
        def rows(self, table, rank=None):
            return run_rows[table]
    changes = RankData.build(Run(), 0).health_changes(10, 90)
    assert changes == ["link 3: state 1 -> 0", "link 3: replay errors +4"]


def test_cli_text(run_dir, capsys):
    assert report_main([run_dir]) == 0
    out = capsys.readouterr().out
    assert "rank 0: per iteration" in out and "rank 1: per iteration" in out
    assert "communication library" in out and "hardware" in out
    assert ("link idle: median 60.00 ms per iteration; meanwhile the collective that ended "
            "it was not yet submitted 50.00 ms, queued in commsched 10.00 ms, issued but not "
            "started on the device 0.00 ms (medians); widest gap median 40.00 ms; in 9 of "
            "10 iterations the widest gap came after g0/bucket0#3 and before g0/bucket0#0"
            in out)


def test_text_says_why_nvlink_reads_zero_only_when_it_carried_nothing(run_dir, tmp_path,
                                                                     capsys):
    assert report_main([run_dir]) == 0
    assert "NVLink sent nothing" not in capsys.readouterr().out
    host_path = synthetic.build(tmp_path, nvlink=False)
    assert report_main([host_path]) == 0
    out = capsys.readouterr().out
    assert out.count("note: NVLink sent nothing while the collectives moved 41.9 MB") == 2
    result = analyze(load_run(host_path))
    assert [s["nvlink_tx_bytes_total"] for s in result["summary"].values()] == [0, 0]


def test_cli_json_and_iteration_range(run_dir, capsys):
    assert report_main([run_dir, "--json", "--iterations", "2:4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({r["iteration"] for r in data["rows"]}) == [2, 3]
    assert set(data["summary"]) == {"0", "1"}
    assert data["definitions"]["exposed_comm_ms"].startswith("communication busy time after")
    assert data["runs"][0]["config"] == {}


def test_cli_plot(run_dir, tmp_path, capsys):
    out = tmp_path / "report.png"
    assert report_main([run_dir, "--plot", str(out), "--rank", "0"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--iterations", "5:2"], "empty range"),
    (["--iterations", "x"], "expected A:B"),
    (["--iterations", "100:200"], "no iterations match"),
])
def test_cli_bad_arguments_exit_2_without_traceback(run_dir, capsys, args, message):
    assert report_main([run_dir] + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_corrupt_store_exits_2(tmp_path, capsys):
    (tmp_path / "rank0.sqlite").write_bytes(b"not sqlite at all" * 100)
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commsched report: error:") and "rank0.sqlite" in err
    assert "Traceback" not in err


def test_without_step_markers_iterations_are_timed_by_lane_flushes(tmp_path):
    from commsched.telemetry.writer import StepMarker
    from .helpers import write_run
    write_run(str(tmp_path), 0, [m for m in synthetic.messages(0)
                                 if not isinstance(m, StepMarker)])
    rows = {r["iteration"]: r for r in analyze(load_run(str(tmp_path)))["rows"]}
    assert rows[0]["iteration_ms"] is None             # no previous flush
    # flush_1 - flush_0 = (b1 + 50) - (b0 + 50) = 100 ms
    assert rows[1]["iteration_ms"] == pytest.approx(100)
    # iteration 5 flushes at b5 + 100: flush_5 - flush_4 = (b4 + 100 + 100) - (b4 + 50) = 150
    assert rows[5]["iteration_ms"] == pytest.approx(150)
    # flush_6 - flush_5 = (b5 + 150 + 50) - (b5 + 100) = 100
    assert rows[6]["iteration_ms"] == pytest.approx(100)
    # NVLink over the comm window [b1+20, b1+60]: enclosing samples b1+1us and b2+1us
    assert rows[1]["nvlink_tx_bytes"] == 4096 * 1024
    assert rows[1]["comm_ms"] == pytest.approx(40)
