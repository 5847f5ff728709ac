"""Run directories: each launch writes its telemetry into a new directory under
COMMSCHED_TELEMETRY_DIR, named by its start time and the same on every rank; ``commsched
report DIR`` reads the newest and lists the others; a corrupt rank store is skipped and
named, not fatal."""

import os
import re
import shutil
import time
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commsched
import commsched.hooks
from commsched import Config
from commsched.telemetry import load_run, report_main
from commsched.telemetry.store import run_name
from distributed import run_workers

from . import synthetic

NAME = re.compile(r"\d{8}-\d{6}-\d{3}")


def _train(rank, world, telemetry_dir):
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", commsched.CommschedWarning)
        state = commsched.hooks.register(ddp, Config(telemetry_dir=telemetry_dir,
                                                     telemetry_nvml_period_ms=0))
    for _ in range(3):
        ddp(torch.randn(4, 8)).sum().backward()
        commsched.step()
    state.close()


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory, world1):
    """A 2-rank run, then a 1-rank run (this process), into one COMMSCHED_TELEMETRY_DIR."""
    parent = str(tmp_path_factory.mktemp("telemetry"))
    run_workers(_train, 2, parent, timeout=120)
    _train(0, 1, parent)
    return parent


def test_each_launch_writes_a_new_run_directory_named_by_its_start(two_launches):
    runs = sorted(os.listdir(two_launches))
    assert len(runs) == 2 and all(NAME.fullmatch(r) for r in runs), runs
    # The ranks of one launch agreed on its directory: both stores are in the first.
    assert sorted(os.listdir(os.path.join(two_launches, runs[0]))) == [
        "rank0.sqlite", "rank1.sqlite"]
    assert sorted(os.listdir(os.path.join(two_launches, runs[1]))) == ["rank0.sqlite"]


def test_rank_0_says_where_telemetry_was_written(world1, tmp_path, capfd):
    _train(0, 1, str(tmp_path))
    [run] = os.listdir(tmp_path)
    run_dir = os.path.join(tmp_path, run)
    assert capfd.readouterr().err.endswith(
        f"commsched: telemetry written to {run_dir} (commsched report {run_dir})\n")


def test_report_reads_the_newest_run_and_lists_the_others(two_launches, capsys):
    runs = sorted(os.listdir(two_launches))
    assert report_main([two_launches]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"commsched report: {os.path.join(two_launches, runs[1])}\n")
    assert "rank 0/1 on" in out and "rank 1/2" not in out and "rank 0/2" not in out
    assert err == (f"commsched report: read {os.path.join(two_launches, runs[1])}, the newest "
                   f"of 2 runs in {two_launches}; the others: {runs[0]}\n")
    older = load_run(os.path.join(two_launches, runs[0]))
    assert older.ranks == [0, 1] and older.other_runs == []


def test_run_names_sort_by_start_and_never_reuse_a_directory(tmp_path):
    first = run_name(str(tmp_path), now=1_700_000_000.5)
    assert first == time.strftime("%Y%m%d-%H%M%S", time.localtime(1_700_000_000)) + "-500"
    (tmp_path / first).mkdir()
    assert run_name(str(tmp_path), now=1_700_000_000.5) == first + "-2"
    assert run_name(str(tmp_path), now=1_700_000_000.501) > first


@pytest.fixture
def two_ranks_one_corrupt(tmp_path):
    run_dir = synthetic.build(tmp_path / "run")
    with open(os.path.join(run_dir, "rank0.sqlite"), "r+b") as f:
        f.write(b"\x00not a database\x00" * 64)
    return run_dir


def test_a_corrupt_rank_store_is_skipped_and_named(two_ranks_one_corrupt, capsys):
    """commsched report DIR --rank 1, rank 0's store corrupt."""
    assert report_main([two_ranks_one_corrupt, "--rank", "1"]) == 0
    out, err = capsys.readouterr()
    assert "rank 1: per iteration" in out and "rank 0: per iteration" not in out
    store = os.path.join(two_ranks_one_corrupt, "rank0.sqlite")
    assert err.startswith(f"commsched report: skipped {store}: ") and err.count("\n") == 1
    run = load_run(two_ranks_one_corrupt)
    assert run.ranks == [1] and [s.split(":")[0] for s in run.skipped] == [store]


def test_a_run_with_no_readable_store_is_an_error_naming_it(two_ranks_one_corrupt, capsys):
    shutil.copy(os.path.join(two_ranks_one_corrupt, "rank0.sqlite"),
                os.path.join(two_ranks_one_corrupt, "rank1.sqlite"))
    assert report_main([two_ranks_one_corrupt]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"commsched report: error: "
                          f"{os.path.join(two_ranks_one_corrupt, 'rank0.sqlite')}: ")
    assert err.rstrip().endswith("(and 1 more unreadable)") and err.count("\n") == 1
