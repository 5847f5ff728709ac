"""The ``commsched`` command and every subcommand that commsched/cli.py lists, fed bad input.

Specification: a wrong command line (unknown subcommand or option, a missing argument, a
value of the wrong type, a path that does not exist, a directory where a file is expected
or the reverse) ends with a non-zero exit status and a message on stderr, never with a
traceback and never by hanging. Subcommands and their options are discovered when the
tests run (``cli._COMMANDS`` and each subcommand's ``--help``), so new ones are covered.

Two layers:
* curated cases that must fail, with the exit status and what the message must name;
* seeded fuzzing of every discovered option with odd values, where the command may succeed
  or fail but must do so cleanly (status 0, 1 or 2; stderr says why; no traceback).

Every case runs as a forked child (harness.run_forked) in its own empty cwd; a handful also
run through the real ``commsched`` console script.
"""

from __future__ import annotations

import difflib
import os
import random
import re
import shutil
import sys
from typing import Dict, List, Sequence

import pytest

from commsched import cli

from .harness import (REPO, Result, clean_env, count_input, problems_of_clean_failure,
                      run_forked, run_parallel, run_subprocess)

SEED = 424242
COMMANDS = list(cli._COMMANDS)
# Keeps `commsched demo` from training when its own argument checks let a value through:
# the configuration check after them fails instead (the curated demo cases run without it).
DEMO_GUARD = {"COMMSCHED_POLICY": "__guard__"}
# Put before the option under test (the last occurrence of an option wins): if a bad value
# gets through, the demo that then runs is small, on one process.
SMALL_DEMO = ["--iters", "1", "--width", "8", "--depth", "1", "--batch", "2",
              "--no-telemetry", "--world-size", "1"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Inputs the cases refer to as {NAME}."""
    root = tmp_path_factory.mktemp("cli_inputs")
    run = root / "run"
    r = run_forked("reliability.children:write_store", str(run), "12", timeout=120)
    assert r.rc == 0, r.describe()
    (root / "adir").mkdir()
    (root / "emptydir").mkdir()
    (root / "text.txt").write_text("just some text\n")
    (root / "random.bin").write_bytes(random.Random(SEED).randbytes(4096))
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "launch", "torchrun_basic.sh"),
                root / "launch.sh")
    (root / "nolaunch.sh").write_text("#!/bin/bash\necho preprocessing only\n")
    return {"RUN": str(run), "DIR": str(root / "adir"), "EMPTYDIR": str(root / "emptydir"),
            "TEXT": str(root / "text.txt"), "BIN": str(root / "random.bin"),
            "SCRIPT": str(root / "launch.sh"), "NOLAUNCH": str(root / "nolaunch.sh"),
            "MISSING": str(root / "does" / "not" / "exist"), "ROOT": str(root)}


def _expand(argv: Sequence[str], paths: Dict[str, str], cwd: str) -> List[str]:
    out = []
    for a in argv:
        for name, value in paths.items():
            a = a.replace("{" + name + "}", value)
        # A launch script may be rewritten in place: every case gets its own copy.
        if a == paths["SCRIPT"]:
            a = shutil.copy(a, os.path.join(cwd, "launch.sh"))
        out.append(a)
    return out


class Case:
    def __init__(self, argv, codes=(2,), mentions=(), env=None, must_fail=True, note=""):
        self.argv, self.codes, self.mentions = list(argv), tuple(codes), tuple(mentions)
        self.env, self.must_fail, self.note = env or {}, must_fail, note

    def __repr__(self):
        return f"commsched {' '.join(map(repr, self.argv))}" + (
            f" [env {self.env}]" if self.env else "") + (f" ({self.note})" if self.note else "")


# --- curated cases that must fail --------------------------------------------------------------

def curated() -> List[Case]:
    C = Case
    cases = [
        C([], mentions=["usage"], note="no command"),
        C(["--version", "extra"], mentions=["unknown command"]),
        C([""], mentions=["unknown command"]),
        C(["DEMO"], mentions=["unknown command"]),
        C(["patch_launch"], mentions=["did you mean 'patch-launch'"]),
        # demo
        C(["demo", "--iters"], mentions=["--iters"]),
        C(["demo", "--iters", "x"], mentions=["--iters"]),
        C(["demo", "--iters", "0"], mentions=["--iters"]),
        C(["demo", "--iters", "-3"], mentions=["--iters"]),
        C(["demo", "--width", "1.5"], mentions=["--width"]),
        C(["demo", "--bucket-mb", "0"], mentions=["--bucket-mb"]),
        C(["demo", "--bucket-mb", "-1"], mentions=["--bucket-mb"]),
        C(["demo", *SMALL_DEMO, "--bucket-mb", "nan"], mentions=["--bucket-mb"]),
        C(["demo", *SMALL_DEMO, "--bucket-mb", "inf"], mentions=["--bucket-mb"]),
        C(["demo", *SMALL_DEMO, "--world-size", "-1"], mentions=["--world-size"]),
        C(["demo", *SMALL_DEMO, "--world-size", "0"], mentions=["--world-size"]),
        C(["demo", "extra"], mentions=["extra"]),
        C(["demo"], env={"COMMSCHED_POLICY": "sideways"}, mentions=["COMMSCHED_POLICY"]),
        # run
        C(["run"], mentions=["usage"]),
        C(["run", "-m"], mentions=["-m"]),
        C(["run", "{MISSING}"], mentions=["{MISSING}"]),
        C(["run", "{DIR}"], mentions=["{DIR}"]),
        C(["run", ""], mentions=["not a file"]),
        C(["run", "-m", "no_such_module_xyz"], mentions=["no_such_module_xyz"]),
        C(["run", "-m", ""], mentions=["-m"]),
        C(["run", "-m", ".relative"], mentions=[".relative"]),
        C(["run", "-m", "no_such_pkg_xyz.sub"], mentions=["no_such_pkg_xyz"]),
        C(["run", "-m", "json"], mentions=["json"], note="a package without __main__"),
        C(["run", "{TEXT}"], env={"COMMSCHED_PARTITION_BYTES": "4MB!"},
          mentions=["COMMSCHED_PARTITION_BYTES"]),
        # env
        C(["env", "extra"], mentions=["extra"]),
        C(["env"], env={"COMMSCHED_CREDIT_BYTES": "-1"}, mentions=["COMMSCHED_CREDIT_BYTES"]),
        C(["env"], env={"COMMSCHED_POLCY": "fifo"}, mentions=["COMMSCHED_POLICY"]),
        # patch-launch
        C(["patch-launch"], mentions=["SCRIPT"]),
        C(["patch-launch", "{MISSING}"], mentions=["{MISSING}"]),
        C(["patch-launch", "{DIR}"], mentions=["{DIR}"]),
        C(["patch-launch", "{NOLAUNCH}"], mentions=["no recognisable launch line"]),
        C(["patch-launch", "{BIN}"], mentions=["no recognisable launch line"]),
        C(["patch-launch", "{TEXT}"], mentions=["no recognisable launch line"]),
        C(["patch-launch", "--set", "FOO=1", "{SCRIPT}"], mentions=["FOO=1"]),
        C(["patch-launch", "--set", "COMMSCHED_X", "{SCRIPT}"], mentions=["COMMSCHED_X"]),
        C(["patch-launch", "--set", "commsched=1", "{SCRIPT}"], mentions=["commsched=1"]),
        C(["patch-launch", "--in-place", "-o", "x.sh", "{SCRIPT}"], mentions=["not allowed"]),
        C(["patch-launch", "-o", "{DIR}", "{SCRIPT}"], codes=(1,), mentions=["{DIR}"]),
        C(["patch-launch", "-o", "{MISSING}", "{SCRIPT}"], codes=(1,),
          mentions=["{MISSING}"]),
        C(["patch-launch", "--in-place", "{MISSING}"], mentions=["{MISSING}"]),
        # report
        C(["report"], mentions=["RUN_DIR"]),
        C(["report", "{MISSING}"], mentions=["{MISSING}"]),
        C(["report", "{TEXT}"], mentions=["{TEXT}"]),
        C(["report", "{EMPTYDIR}"], mentions=["{EMPTYDIR}"]),
        C(["report", "{RUN}", "--iterations", "x"], mentions=["--iterations"]),
        C(["report", "{RUN}", "--iterations", "5:3"], mentions=["--iterations"]),
        C(["report", "{RUN}", "--iterations", "1000:2000"], mentions=["--iterations"]),
        C(["report", "{RUN}", "--rank", "x"], mentions=["--rank"]),
        C(["report", "{RUN}", "--rank", "99"], mentions=["--rank"]),
        C(["report", "{RUN}", "--plot", "{DIR}"], mentions=["{DIR}"]),
        C(["report", "{RUN}", "--plot", "{MISSING}/p.png"], mentions=["{MISSING}"]),
        # trace
        C(["trace"], mentions=["RUN_DIR"]),
        C(["trace", "{MISSING}"], mentions=["{MISSING}"]),
        C(["trace", "{TEXT}"], mentions=["{TEXT}"]),
        C(["trace", "{EMPTYDIR}"], mentions=["{EMPTYDIR}"]),
        C(["trace", "{RUN}", "-o", "{DIR}"], mentions=["{DIR}"]),
        C(["trace", "{RUN}", "-o", "{MISSING}/t.json"], mentions=["{MISSING}"]),
        C(["trace", "{RUN}", "-o", ""], mentions=["cannot write"]),
        C(["trace", "{RUN}", "-o"], mentions=["-o"]),
    ]
    # Every subcommand, present or future: an unknown option must fail.
    # (A subcommand this file does not know may report its missing arguments first.)
    cases += [C([cmd, *BASE.get(cmd, []), "--no-such-option-xyz"],
                mentions=["--no-such-option-xyz"] if cmd in BASE else []) for cmd in COMMANDS]
    # Misspelt subcommands get a suggestion when one name is clearly closest.
    rng = random.Random(SEED)
    for cmd in COMMANDS:
        i = rng.randrange(len(cmd) - 1)
        for typo in {cmd[:i] + cmd[i + 1:], cmd[:i] + cmd[i + 1] + cmd[i] + cmd[i + 2:]}:
            if typo in COMMANDS or typo == cmd:
                continue
            close = difflib.get_close_matches(typo, COMMANDS, n=2)
            hint = [f"did you mean {cmd!r}"] if close[:1] == [cmd] else []
            cases.append(C([typo], mentions=["unknown command", *hint]))
    return cases


def test_every_subcommand_has_cases_that_must_fail():
    covered = {c.argv[0] for c in curated() if c.argv}
    assert set(COMMANDS) <= covered


def _run_case(case: Case, paths: Dict[str, str], tmp_root, k: int) -> List[str]:
    cwd = os.path.join(str(tmp_root), f"c{k}")
    os.makedirs(cwd)
    argv = _expand(case.argv, paths, cwd)
    env = clean_env({k: v for k, v in case.env.items()})
    r = run_forked("cli", argv, env=env, cwd=cwd, timeout=120)
    mentions = [_expand([m], paths, cwd)[0] for m in case.mentions]
    if case.must_fail:
        problems = problems_of_clean_failure(r, mentions, case.codes)
    else:
        problems = _unclean(r)
    if os.path.exists(os.path.join(cwd, "pwned")):
        problems.append("a value was executed (pwned exists)")
    return [f"  {case!r}\n      -> {p}" for p in problems] + (
        [f"      stderr: {r.stderr.strip()[-700:]}"] if problems else [])


def _unclean(r: Result) -> List[str]:
    """Problems of a case that may succeed or fail, as long as it does so cleanly."""
    out = []
    if r.timed_out:
        out.append("hung")
    elif r.rc not in (0, 1, 2):
        out.append(f"exit status {r.rc}")
    if "Traceback" in r.stderr or "Traceback" in r.stdout:
        out.append("printed a traceback")
    if r.rc not in (0, None) and not r.stderr.strip():
        out.append("failed without a message on stderr")
    return out


def test_bad_command_lines_fail_with_a_clear_message(paths, tmp_path):
    cases = curated()
    count_input("cli curated must-fail command lines", len(cases))
    failures = [line for lines in run_parallel(
        lambda item: _run_case(item[1], paths, tmp_path, item[0]), list(enumerate(cases)),
        workers=3) for line in lines]
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)


# --- discovered options, fuzzed ------------------------------------------------------------

_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)(?:[ =]([A-Z][A-Z0-9_.:-]*))?")
ODD_VALUES = ["notanumber", "-1", "0", "", " ", "nan", "inf", "1e999", "9" * 40,
              "\u0663", "\uff11", "{MISSING}", "{DIR}", "{TEXT}", "$(touch pwned)", "-",
              "--", "\u2603" * 3, "a" * 2000]
VALUES_PER_OPTION = 3
CASES_PER_COMMAND = 24
BASE = {"report": ["{RUN}"], "trace": ["{RUN}"], "patch-launch": ["{SCRIPT}"],
        "run": [], "demo": [], "env": []}


def discover_options(cmd: str) -> Dict[str, bool]:
    """Options named in ``commsched CMD --help``: {option: takes a value}."""
    r = run_forked("cli", [cmd, "--help"], timeout=60)
    assert not r.timed_out and "Traceback" not in r.stderr, r.describe()
    options: Dict[str, bool] = {}
    for opt, metavar in _OPTION.findall(r.stdout + r.stderr):
        if opt in ("-h", "--help"):
            continue
        options[opt] = options.get(opt, False) or bool(metavar)
    return options


def fuzz_cases() -> List[Case]:
    rng = random.Random(SEED + 1)
    out = []
    for cmd in COMMANDS:
        cases = []
        options = discover_options(cmd)
        base = BASE.get(cmd, [])
        env = DEMO_GUARD if cmd == "demo" else {}
        for opt, takes_value in sorted(options.items()):
            if takes_value:
                cases.append(Case([cmd, *base, opt], env=env, must_fail=True,
                                  mentions=[opt.lstrip("-")[:3]], note="value missing"))
                for value in rng.sample(ODD_VALUES, VALUES_PER_OPTION):
                    cases.append(Case([cmd, *base, opt, value], env=env, must_fail=False))
            else:
                cases.append(Case([cmd, *base, opt, opt], env=env, must_fail=False))
                cases.append(Case([cmd, *base, opt, rng.choice(ODD_VALUES)], env=env,
                                  must_fail=False))
        # Positional / extra arguments. (`run FILE` and `floor FILE` run FILE as Python:
        # its errors are the script's own, tracebacks included, so no existing file is
        # given to run.)
        values = [v for v in ODD_VALUES
                  if cmd not in ("run", "floor") or v not in ("{DIR}", "{TEXT}")]
        for value in rng.sample(values, VALUES_PER_OPTION):
            cases.append(Case([cmd, value], env=env, must_fail=False))
        missing = [c for c in cases if c.must_fail]      # every option's missing value
        others = [c for c in cases if not c.must_fail]
        out += missing + rng.sample(others, min(len(others), CASES_PER_COMMAND - len(missing)))
    return out


def test_odd_option_values_never_crash_or_hang(paths, tmp_path):
    cases = fuzz_cases()
    count_input("cli fuzzed option values", len(cases))
    assert len(cases) >= 60
    failures = [line for lines in run_parallel(
        lambda item: _run_case(item[1], paths, tmp_path, item[0]), list(enumerate(cases)),
        workers=3) for line in lines]
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)


# --- the console script itself -----------------------------------------------------------------

def test_console_script_fails_cleanly(paths, tmp_path):
    """A few cases through the installed ``commsched`` entry point (a real interpreter)."""
    exe = os.path.join(os.path.dirname(sys.executable), "commsched")
    if not os.path.exists(exe):
        exe = None
    cases = [Case(["rpeort"], mentions=["did you mean 'report'"]),
             Case(["run", "-m", "no_such_module_xyz"], mentions=["no_such_module_xyz"])]
    count_input("cli cases through the console script", len(cases))

    def one(item):
        k, case = item
        cwd = tmp_path / f"s{k}"
        cwd.mkdir()
        argv = _expand(case.argv, paths, str(cwd))
        cmd = [exe, *argv] if exe else [sys.executable, "-m", "commsched", *argv]
        r = run_subprocess(cmd, env=clean_env(), cwd=str(cwd), timeout=120)
        mentions = [_expand([m], paths, str(cwd))[0] for m in case.mentions]
        return [f"  {case!r} -> {p}\n{r.stderr[-600:]}"
                for p in problems_of_clean_failure(r, mentions)]

    failures = [line for lines in run_parallel(one, list(enumerate(cases)), workers=3)
                for line in lines]
    assert not failures, "\n".join(failures)
