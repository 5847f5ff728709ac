"""``commsched report``'s part of the step split: the tail from the collectives' device
timestamps, the step above compute only with a floor.json, and every other part named as
needing ``commsched floor``."""

import json

import pytest

from commsched.floor import save_floor
from commsched.telemetry import report_main

from . import synthetic


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """The synthetic run (median iteration 100 ms) alone, and under a directory whose
    floor.json says compute only 85 ms and holds a ``commsched floor`` split."""
    alone = synthetic.build(tmp_path_factory.mktemp("alone") / "launch0")
    base = tmp_path_factory.mktemp("runs")
    with_floor = synthetic.build(base / "launch0")
    save_floor(str(base), {"source": "test", "compute_only_ms": 85.0, "comm_only_ms": 40.0,
                           "split_verdict": "of 24.0 ms above compute: 9.0 exposed"})
    return alone, with_floor


def report(run_dir, capsys, *extra):
    assert report_main([run_dir, *extra]) == 0
    return capsys.readouterr().out


def test_the_tail_is_the_exposed_communication_and_the_rest_needs_floor(run_dirs, capsys):
    r = json.loads(report(run_dirs[1], capsys, "--json"))
    split, summary = r["split"]["0"], r["summary"]["0"]
    assert split["tail_ms"] == pytest.approx(summary["exposed_comm_ms_median"])
    assert split["above_ms"] == pytest.approx(summary["iteration_ms_median"] - 85.0)
    for part in ("exposed_ms", "slowed_ms", "own_ms", "host_ms", "rest_ms"):
        assert split[part] is None
        assert "commsched floor" in split["not_measured"][part]
    assert "tail_ms" not in split["not_measured"]


def test_the_text_names_what_is_measured_and_what_needs_floor(run_dirs, capsys):
    out = report(run_dirs[1], capsys)
    assert "rank 0: 15.00 ms above compute only (median iteration less floor.json's " \
           "compute only); the tail (communication after the device ended the backward) " in out
    assert "own device work and host: not measured: telemetry times the collectives" in out
    assert "commsched floor's split of its hook launch: of 24.0 ms above compute" in out
    out = report(run_dirs[0], capsys)
    assert "rank 0: above compute only: needs floor.json's compute only" in out
    assert "commsched floor's split" not in out
