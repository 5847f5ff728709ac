"""One reporting convention (commsched/errors.py): errors derive from CommschedError,
warnings from CommschedWarning, notices are one line on stderr from rank 0."""

import subprocess
import sys
import warnings

import commsched
from commsched import notices
from commsched.config import Config, warn_data_parallel_only
from commsched.data_parallel import DataParallelWarning
from commsched.telemetry import TelemetryWarning


def test_every_warning_commsched_issues_is_a_commsched_warning():
    assert issubclass(commsched.CommschedWarning, UserWarning)
    for category in (TelemetryWarning, DataParallelWarning):
        assert issubclass(category, commsched.CommschedWarning), category
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_data_parallel_only(Config(group_bytes=1 << 20), "DDP hook")
    assert [w.category for w in caught] == [commsched.CommschedWarning]


def test_a_notice_is_one_line_on_rank_0_and_nothing_elsewhere():
    code = ("from commsched import notices; "
            "notices.say('one   line\\n  only'); notices.say('second')")
    out = {}
    for rank in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={"RANK": rank, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        out[rank] = proc.stderr
    assert out == {"0": "commsched: one line only\ncommsched: second\n", "1": ""}


def test_the_start_up_line_names_the_settings_away_from_their_defaults(capsys):
    config = Config(enabled=True, partition_bytes=1 << 10, credit_bytes=4 << 10,
                    telemetry_dir="runs/b")
    notices.started("the DDP hook", config, "runs/b/20261128-120000-000")
    notices.started("the DDP hook", Config(enabled=True))
    assert capsys.readouterr().err.splitlines() == [
        f"commsched: on (version {commsched.__version__}): the DDP hook; settings: "
        "COMMSCHED_PARTITION_BYTES=1KiB, COMMSCHED_CREDIT_BYTES=4KiB; "
        "telemetry: runs/b/20261128-120000-000",
        f"commsched: on (version {commsched.__version__}): the DDP hook; settings: defaults"]
