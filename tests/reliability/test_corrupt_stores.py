"""``commsched report`` / ``commsched trace`` on run directories that are not what they claim.

Specification (store.load_run, report.py, trace.py): a run directory that holds no store, or
whose only ``rank<N>.sqlite`` is not a readable commsched telemetry store (random bytes, a
directory, a FIFO, text, another application's SQLite database, a newer schema, a truncated
file), gives exit status 2 and a one-line message naming the offending file or directory,
with no traceback; ``trace`` then writes no output file. ``load_run`` raises
``TelemetryError`` and nothing else. A run with a readable store beside an unreadable one
is read: the unreadable one is skipped, named in one line on stderr.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3

import pytest

from commsched.telemetry import TelemetryError, load_run

from .harness import (count_fault, count_input, problems_of_clean_failure, run_forked,
                      run_parallel)

SEED = 777
PAGE = 4096


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A real store of a short telemetry run, closed normally, and one left by a killed
    writer (committed pages still in the WAL)."""
    root = tmp_path_factory.mktemp("stores")
    closed, killed = root / "closed", root / "killed"
    for run_dir, close in ((closed, "1"), (killed, "0")):
        r = run_forked("reliability.children:write_store", str(run_dir), "30", close,
                       timeout=120)
        assert r.rc == 0, r.describe()
    assert load_run(str(closed)).iterations and load_run(str(killed)).iterations
    assert os.path.getsize(killed / "rank0.sqlite-wal") > 0
    return {"closed": closed / "rank0.sqlite", "killed": killed / "rank0.sqlite"}


def _sqlite(path, statements):
    conn = sqlite3.connect(path)
    for s in statements:
        conn.execute(s)
    conn.commit()
    conn.close()


def build_bad_runs(root, stores) -> dict:
    """{name: (run_dir, path the message must name)} of run directories to reject."""
    rng = random.Random(SEED)
    runs = {}

    def rank0(name):
        d = root / name
        d.mkdir()
        return d, d / "rank0.sqlite"

    for size in (1, 100, PAGE, 16 * PAGE):
        d, f = rank0(f"random_bytes_{size}")
        f.write_bytes(rng.randbytes(size))
        runs[d.name] = (d, f)
    d, f = rank0("sqlite_header_then_garbage")
    f.write_bytes(b"SQLite format 3\x00" + rng.randbytes(3 * PAGE))
    runs[d.name] = (d, f)
    d, f = rank0("directory_named_rank0")
    f.mkdir()
    (f / "junk").write_bytes(rng.randbytes(64))
    runs[d.name] = (d, f)
    d, f = rank0("fifo_named_rank0")       # opening it for reading would block forever
    os.mkfifo(f)
    runs[d.name] = (d, f)
    d, f = rank0("text_file")
    f.write_text("rank 0 did not write this\n" * 20)
    runs[d.name] = (d, f)
    d, f = rank0("empty_file")
    f.write_bytes(b"")
    runs[d.name] = (d, f)
    d, f = rank0("foreign_schema")
    _sqlite(f, ["CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)",
                "INSERT INTO customers VALUES (1, 'x')"])
    runs[d.name] = (d, f)
    d, f = rank0("foreign_meta")
    _sqlite(f, ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
                "INSERT INTO meta VALUES ('schema', 'someone-else'), ('version', '1')"])
    runs[d.name] = (d, f)
    d, f = rank0("meta_without_tables")
    _sqlite(f, ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
                "INSERT INTO meta VALUES ('schema', 'commsched-telemetry'), ('version', '1')"])
    runs[d.name] = (d, f)
    d, f = rank0("newer_schema")
    shutil.copy(stores["closed"], f)
    _sqlite(f, ["UPDATE meta SET value = '99' WHERE key = 'version'"])
    runs[d.name] = (d, f)
    d, f = rank0("bad_version")
    shutil.copy(stores["closed"], f)
    _sqlite(f, ["UPDATE meta SET value = 'one' WHERE key = 'version'"])
    runs[d.name] = (d, f)
    d = root / "empty_dir"
    d.mkdir()
    runs[d.name] = (d, d)
    t = root / "a_text_file"
    t.write_text("not a directory\n")
    runs[t.name] = (t, t)
    for offset in truncation_offsets(os.path.getsize(stores["closed"]), 8):
        d, f = rank0(f"truncated_at_{offset}")
        f.write_bytes(stores["closed"].read_bytes()[:offset])
        runs[d.name] = (d, f)
    return runs


def truncation_offsets(size: int, n: int, seed: int = SEED) -> list:
    """Fixed offsets (header, first page) and seeded ones, all before the last page: a
    store cut there has lost pages it needs."""
    rng = random.Random(seed)
    fixed = [0, 1, 16, 99, 100, 101, PAGE - 1, PAGE, PAGE + 1, size // 2]
    rand = sorted(rng.randrange(0, size - PAGE) for _ in range(n))
    return sorted(set(o for o in fixed + rand if o < size - PAGE))


def test_load_run_raises_only_telemetry_error_for_every_truncation(stores, tmp_path):
    """In-process, many cut points of a real store: TelemetryError naming the file."""
    data = stores["closed"].read_bytes()
    offsets = truncation_offsets(len(data), 60, seed=SEED + 1)
    count_fault("truncated store (load_run)", len(offsets))
    problems = []
    for offset in offsets:
        d = tmp_path / f"t{offset}"
        d.mkdir()
        (d / "rank0.sqlite").write_bytes(data[:offset])
        try:
            load_run(str(d))
            problems.append(f"cut at {offset}: loaded without an error")
        except TelemetryError as exc:
            if "rank0.sqlite" not in str(exc):
                problems.append(f"cut at {offset}: message does not name the file: {exc}")
        except Exception as exc:
            problems.append(f"cut at {offset}: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems)


def test_report_and_trace_reject_corrupt_and_foreign_run_directories(stores, tmp_path):
    runs = build_bad_runs(tmp_path, stores)
    count_fault("corrupt/foreign run directory (report+trace)", 2 * len(runs))
    count_input("corrupt/foreign run directories", len(runs))

    def check(item):
        name, (run_dir, culprit) = item
        out = []
        for cmd in ("report", "trace"):
            cwd = tmp_path / f"cwd_{cmd}_{name}"
            cwd.mkdir()
            argv = [cmd, str(run_dir)] + (["-o", "trace.json"] if cmd == "trace" else [])
            r = run_forked("cli", argv, cwd=str(cwd), timeout=120)
            problems = problems_of_clean_failure(r, mentions=[str(culprit)])
            if r.stderr.strip().count("\n"):
                problems.append("message is more than one line")
            if name == "directory_named_rank0" and \
                    "directory" not in r.stderr.replace(str(culprit), ""):
                problems.append("does not say the store is a directory")
            if os.listdir(cwd):
                problems.append(f"left {os.listdir(cwd)}")
            out += [f"  {cmd} {name}: {p}\n      stderr: {r.stderr.strip()[-400:]}"
                    for p in problems]
        return out

    failures = [line for lines in run_parallel(check, sorted(runs.items()), workers=3)
                for line in lines]
    assert not failures, "\n".join(failures)


def test_a_corrupt_rank_store_beside_a_good_one_is_skipped_and_named(stores, tmp_path):
    run_dir = tmp_path / "good_rank0_bad_rank1"
    run_dir.mkdir()
    shutil.copy(stores["closed"], run_dir / "rank0.sqlite")
    (run_dir / "rank1.sqlite").write_bytes(random.Random(SEED).randbytes(2 * PAGE))
    count_fault("corrupt store beside a good one (report+trace)", 2)
    for cmd in ("report", "trace"):
        argv = [cmd, str(run_dir)] + (["-o", "trace.json"] if cmd == "trace" else [])
        r = run_forked("cli", argv, cwd=str(tmp_path), timeout=120)
        assert r.rc == 0, r.describe()
        assert r.stderr == (f"commsched {cmd}: skipped {run_dir / 'rank1.sqlite'}: cannot "
                            f"open: file is not a database\n"), r.describe()
    out = run_forked("cli", ["report", str(run_dir)], timeout=120).stdout
    assert "rank 0/2 on" in out and "rank 1/2 on" not in out


def test_a_killed_writers_store_with_a_truncated_wal_reads_or_fails_cleanly(stores, tmp_path):
    """SQLite ignores WAL frames past a cut, so this may read (fewer iterations) or not;
    either way: no traceback, and a report when it reads."""
    src = stores["killed"]
    wal = (src.parent / "rank0.sqlite-wal").read_bytes()
    rng = random.Random(SEED + 2)
    offsets = sorted({0, 32, 100, len(wal) // 2, len(wal) - 1,
                      *(rng.randrange(len(wal)) for _ in range(3))})
    count_fault("truncated WAL of a killed writer", len(offsets))
    failures = []
    for offset in offsets:
        d = tmp_path / f"wal{offset}"
        d.mkdir()
        shutil.copy(src, d / "rank0.sqlite")
        (d / "rank0.sqlite-wal").write_bytes(wal[:offset])
        r = run_forked("cli", ["report", str(d)], cwd=str(d), timeout=120)
        if r.rc == 0:
            ok = "per iteration" in r.stdout
        else:
            ok = not problems_of_clean_failure(r, mentions=["rank0.sqlite"])
        if not ok or "Traceback" in r.stderr:
            failures.append(f"WAL cut at {offset}: {r.describe()}")
    assert not failures, "\n".join(failures)
