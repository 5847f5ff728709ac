"""``commsched trace -o FILE`` never leaves a truncated trace.

Specification: when writing the trace fails part-way (here: the kernel refuses writes past
RLIMIT_FSIZE, as a full disk would), the command exits 2 with a message naming FILE, FILE
keeps its previous content (or does not appear), and no temporary file is left.
"""

from __future__ import annotations

import os

import pytest

from .harness import count_fault, run_forked


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace_run") / "run"
    r = run_forked("reliability.children:write_store", str(d), "40", timeout=120)
    assert r.rc == 0, r.describe()
    return d


@pytest.mark.parametrize("existing", [True, False], ids=["overwrite", "new file"])
def test_a_failed_trace_write_leaves_no_partial_file(run_dir, tmp_path, existing):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "trace.json"
    if existing:
        out.write_text('{"traceEvents": []}\n')
    before = {p: (out_dir / p).read_bytes() for p in os.listdir(out_dir)}
    # The trace must be larger than the limit for the write to fail part-way.
    full = run_forked("cli", ["trace", str(run_dir), "-o", str(tmp_path / "full.json")],
                      timeout=60)
    assert full.rc == 0, full.describe()
    assert os.path.getsize(tmp_path / "full.json") > 32 * 1024
    count_fault("trace output: RLIMIT_FSIZE")
    r = run_forked("cli", ["trace", str(run_dir), "-o", str(out)], cwd=str(out_dir),
                   timeout=60, limits={"fsize": 16 * 1024})
    assert r.rc == 2, r.describe()
    assert str(out) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert {p: (out_dir / p).read_bytes() for p in os.listdir(out_dir)} == before
