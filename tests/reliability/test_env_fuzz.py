"""Every COMMSCHED_* variable, fed values that must be rejected, and misspelt names.

The variables come from ``commsched.config.ENV_VARS`` when the tests are collected, so a
variable added later is fuzzed without touching this file. Its kind (switch, byte count,
integer, float, choice, path) is read from the ``Config`` field behind it.

Specification (README "Configuration"): an invalid value or an unknown ``COMMSCHED_*`` name
is an error that names the variable; ``python -m commsched.run SCRIPT`` then exits with
status 2 and that one-line message, without a traceback, before the script starts.

All cases (several hundred, from a seeded generator) run in-process through
``Config.from_env(env)``. A stratified sample runs through the launcher in forked children
(harness.run_forked, ~0.1 s each), and a smaller one as real ``python -m commsched.run``
processes (~3.5 s of CPU each, torch's import).
"""

from __future__ import annotations

import difflib
import os
import random
import sys
import typing
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

from commsched import config as config_module
from commsched.config import ENV_VARS, Config, ConfigError, env_fields

from .harness import (clean_env, count_input, problems_of_clean_failure, run_forked,
                      run_parallel, run_subprocess)

SEED = 20261104
FORKED_SAMPLE = 40        # forked launcher children: ~0.1 s each
SUBPROCESS_SAMPLE = 6     # real interpreters: ~3.5 s of CPU each (torch import)

_FIELDS = env_fields()
_HINTS = typing.get_type_hints(Config)


def _literal(var: str):
    """The Literal type of a choice field (unwrapped from Optional), else None."""
    hint = _HINTS[_FIELDS[var].name]
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint if typing.get_origin(hint) is typing.Literal else None


def kind_of(var: str) -> str:
    f = _FIELDS[var]
    t = str(f.type).replace("typing.", "")
    if "bool" in t:
        return "switch"
    if f.name.endswith("_bytes"):
        return "bytes"
    if t == "int":
        return "int"
    if t == "float":
        return "float"
    if f.name.endswith(("_dir", "_path", "_file")):
        return "path"
    if _literal(var) is not None:
        return "choice"
    if "str" in t:
        return "choice"
    return "other"


def choices_of(var: str) -> tuple:
    """The accepted words of a choice variable: its Literal's, else the config module's
    tuple holding its default (POLICIES, DECOMPOSITIONS, ...)."""
    literal = _literal(var)
    if literal is not None:
        return typing.get_args(literal)
    default = _FIELDS[var].default
    for value in vars(config_module).values():
        if isinstance(value, tuple) and default in value and all(
                isinstance(v, str) for v in value):
            return value
    return ()


def valid_value(var: str) -> str:
    kind, f = kind_of(var), _FIELDS[var]
    if kind == "switch":
        return "1"
    if kind == "bytes":
        return "64KiB"
    if kind in ("int", "float"):
        return str(max(f.default, f.metadata.get("min", 0)))
    if kind == "path":
        return "telemetry_run"
    if kind == "choice":
        return f.default if f.default is not None else choices_of(var)[0]
    return str(f.default)


FULLWIDTH = {c: chr(ord(c) + 0xFEE0) for c in "0123456789abcdefghijklmnopqrstuvwxyzMGKiB"}
ARABIC = {str(d): chr(0x0660 + d) for d in range(10)}


def _wide(text: str) -> str:
    return "".join(FULLWIDTH.get(c, c) for c in text)


# Rejected whatever the variable (except a path, where only blank is invalid).
COMMON = [
    ("empty", ""), ("whitespace", " "), ("whitespace", "\t\n "),
    ("whitespace", "\u00a0"), ("whitespace", "\u3000"),
    ("wrong type", "abc"), ("wrong type", "[1, 2]"), ("wrong type", "None"),
    ("wrong type", "{}"), ("wrong type", "true"),
    ("unicode", "\u2603"), ("unicode", "\u00fcn\u00efc\u00f6d\u00e9"),
    ("code", "$(touch pwned)"), ("code", "`touch pwned`"), ("code", "; touch pwned"),
    ("code", "__import__('os').system('touch pwned')"),
]

BY_KIND = {
    "switch": [
        ("wrong type", "2"), ("negative", "-1"), ("wrong type", "yes"),
        ("wrong type", "on"), ("wrong type", "01"), ("wrong type", "1.0"),
        ("wrong type", "0x1"), ("unicode", ARABIC["1"]), ("unicode", _wide("1")),
        ("huge", "1" + "0" * 30), ("wrong type", "1 1"),
    ],
    "int": [
        ("negative", "-1"), ("negative", "-99999"), ("wrong type", "1.5"),
        ("wrong type", "1e3"), ("wrong type", "0x10"), ("wrong type", "12abc"),
        ("wrong type", "12 34"), ("wrong type", "--1"),
        ("unicode", ARABIC["1"] + ARABIC["2"]), ("unicode", _wide("12")),
        ("huge", "9" * 30), ("huge", "9" * 5000),
    ],
    "bytes": [
        ("negative", "-1"), ("negative", "-4MiB"), ("negative", "-inf"),
        ("wrong type", "4.5MiB"), ("wrong type", "4 MiB MiB"), ("wrong type", "4XiB"),
        ("wrong type", "MiB"), ("wrong type", "4MiB4"), ("wrong type", "0x10"),
        ("wrong type", "1e6"), ("huge", "2TiB"), ("huge", "1025GiB"), ("huge", "9" * 30),
        ("huge", "9" * 5000), ("unicode", _wide("4") + "MiB"), ("unicode", "4" + _wide("M") + "iB"),
        ("unicode", ARABIC["4"] + "KiB"), ("unicode", "4\u03bcB"),
    ],
    "float": [
        ("negative", "-1"), ("negative", "-0.5"), ("wrong type", "nan"),
        ("wrong type", "1,5"), ("wrong type", "1.2.3"), ("unicode", ARABIC["1"]),
        ("unicode", _wide("10")), ("huge", "9" * 400),
    ],
    "choice": [("wrong type", "1"), ("wrong type", "not-a-choice"), ("huge", "x" * 5000)],
    "path": [],
    "other": [],
}

# Metacharacters, code and odd characters in a path: accepted, kept as written.
PATH_DATA = ["$(touch pwned)", "`touch pwned`", "; touch pwned", "| touch pwned",
             "$HOME", "~", "${IFS}x", "%s%n", "{0.__class__}", "runs/\u00fcn\u00efc\u00f6d\u00e9",
             "a b", "--help", "-rf", "run\\dir", "\u2603"]


def _choice_variants(var: str) -> List[tuple]:
    out = []
    for word in choices_of(var):
        out += [("wrong type", word[:-1]), ("wrong type", word + "x"),
                ("wrong type", word + ","), ("wrong type", " ".join(word)),
                ("unicode", _wide(word)), ("unicode", word[:-1] + "\u00f6")]
    words = choices_of(var)
    if len(words) >= 2:
        out.append(("wrong type", ",".join(words[:2])))
    return out


@dataclass
class Case:
    env: Dict[str, str]
    bad: str                 # the variable the error must name
    category: str
    suggestion: Optional[str] = None     # expected "did you mean" for a misspelt name

    def __str__(self):
        return f"{self.category}: {self.env!r}"[:300]


def _typos(name: str, rng: random.Random) -> List[str]:
    """Misspellings of ``name`` that stay in the COMMSCHED_ namespace."""
    prefix = "COMMSCHED_"
    if name == "COMMSCHED":
        return ["COMMSCHED_", "COMMSCHED_1", "COMMSCHED_ON"]
    tail = name[len(prefix):]
    out = set()
    i = rng.randrange(len(tail))
    out.add(tail[:i] + tail[i + 1:])                                 # a letter dropped
    i = rng.randrange(len(tail) - 1)
    out.add(tail[:i] + tail[i + 1] + tail[i] + tail[i + 2:])        # two swapped
    i = rng.randrange(len(tail))
    out.add(tail[:i] + tail[i] + tail[i:])                           # a letter doubled
    out.add(tail.replace("_", "", 1))                                # an underscore lost
    out.add(tail + "S")
    return [prefix + t for t in sorted(out) if t and prefix + t not in ENV_VARS]


def generate_cases(var: str) -> List[Case]:
    """The deterministic cases of one variable (a few dozen)."""
    rng = random.Random(f"{SEED}:{var}")
    kind = kind_of(var)
    f = _FIELDS[var]
    values: List[tuple] = []
    if kind == "path":
        values = [c for c in COMMON if c[0] in ("empty", "whitespace")]
    else:
        values = list(COMMON) + BY_KIND[kind]
        if kind == "choice":
            # "None" is a fine spelling of the choice "none": keep only non-choices.
            words = choices_of(var)
            values = [c for c in values if c[1].strip().lower() not in words]
            values += _choice_variants(var)
        if kind in ("int", "float") and f.metadata.get("min", 0) >= 1:
            values.append(("zero where invalid", str(f.metadata["min"] - 1)))
    # Seeded variations: padding keeps an invalid value invalid; random junk always holds
    # a character no parser accepts.
    for _ in range(6):
        category, value = rng.choice(values)
        values.append((category,
                       rng.choice([" ", "\t", ""]) + value + rng.choice([" ", "\n", ""])))
    if kind != "path":
        pool = "abcXYZ019-_.,:+~ \u00e9\u2603\u00b5"
        for _ in range(6):
            junk = "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))
            pos = rng.randint(0, len(junk))
            values.append(("random junk", junk[:pos] + rng.choice("!#%&*()\u2603") + junk[pos:]))
    cases = [Case({var: v}, var, c) for c, v in values]
    # The same values next to valid settings of every other variable: the error must name
    # the bad one, and nothing else may have been applied.
    others = {v: valid_value(v) for v in ENV_VARS if v != var}
    for category, value in rng.sample(values, 3):
        cases.append(Case({**others, var: value}, var, category + " among valid"))
    for typo in _typos(var, rng):
        cases.append(Case({typo: valid_value(var)}, typo, "misspelt name", suggestion=var))
    return cases


def _unambiguous(typo: str, intended: str) -> bool:
    """Whether ``intended`` is strictly the closest known name to ``typo``."""
    ratio = {v: difflib.SequenceMatcher(None, typo, v).ratio() for v in ENV_VARS}
    best = max(ratio.values())
    return ratio[intended] == best and sum(r == best for r in ratio.values()) == 1


def check_in_process(case: Case) -> Optional[str]:
    """None when ``Config.from_env(case.env)`` rejects it properly, else what went wrong."""
    try:
        config = Config.from_env(case.env)
    except ConfigError as exc:
        msg = str(exc)
        if case.bad not in msg:
            return f"message does not name {case.bad}: {msg[:200]}"
        if "\n" in msg:
            return f"message is not one line: {msg[:200]!r}"
        if case.suggestion is not None:
            if "did you mean" not in msg:
                return f"no suggestion for a misspelt name: {msg[:200]}"
            if _unambiguous(case.bad, case.suggestion) and \
                    f"did you mean {case.suggestion}" not in msg:
                return f"suggests something else than {case.suggestion}: {msg[:200]}"
        return None
    except Exception as exc:
        return f"raised {type(exc).__name__} instead of ConfigError: {str(exc)[:200]}"
    return f"accepted: {_short(config, case)}"


def _short(config: Config, case: Case) -> str:
    f = _FIELDS.get(case.bad)
    return f"{f.name}={getattr(config, f.name)!r}"[:120] if f else repr(config)[:120]


ALL_VARS = list(ENV_VARS)


def test_every_variable_is_fuzzed():
    cases = {v: generate_cases(v) for v in ALL_VARS}
    assert set(cases) == set(ENV_VARS)
    for var, cs in cases.items():
        assert len(cs) >= 15, (var, len(cs))
    assert sum(map(len, cases.values())) >= 300


@pytest.mark.parametrize("var", ALL_VARS)
def test_invalid_values_and_misspelt_names_are_rejected_naming_the_variable(var):
    cases = generate_cases(var)
    count_input(f"env values ({var})", len(cases))
    failures = [f"  {c}\n      -> {problem}" for c in cases
                if (problem := check_in_process(c)) is not None]
    assert not failures, (f"{len(failures)} of {len(cases)} cases for {var} "
                          f"({kind_of(var)}) not rejected properly:\n" + "\n".join(failures))


@pytest.mark.parametrize("var", [v for v in ALL_VARS if kind_of(v) == "path"])
def test_path_values_with_metacharacters_are_kept_literally(var):
    count_input("env path values (data)", len(PATH_DATA))
    for value in PATH_DATA:
        config = Config.from_env({var: value})
        assert getattr(config, _FIELDS[var].name) == value


SCRIPT = """\
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "STARTED"), "w").close()
"""


def sample(size: int, salt: str) -> List[Case]:
    """A stratified sample: one case of each category (misspelt name, among valid, huge,
    code, ...), then every variable once (rotating through categories), then random."""
    rng = random.Random(f"{SEED}:{salt}")
    by_var = {v: generate_cases(v) for v in ALL_VARS}
    rest = [c for cs in by_var.values() for c in cs]
    chosen: List[Case] = []
    for pick in ("misspelt name", "among valid", "huge", "code", "unicode", "negative",
                 "zero where invalid", "empty", "random junk"):
        pool = [c for c in rest if pick in c.category]
        if pick == "huge":      # the most extreme one: a 5000-digit count
            pool = [c for c in pool if len(c.env[c.bad]) == max(len(d.env[d.bad]) for d in pool)]
        if pool:
            chosen.append(rng.choice(pool))
    for i, var in enumerate(ALL_VARS):
        plain = [c for c in by_var[var] if c.suggestion is None and "among" not in c.category]
        categories = sorted({c.category for c in plain})
        wanted = categories[(i + len(salt)) % len(categories)]
        chosen.append(rng.choice([c for c in plain if c.category == wanted]))
    pool = [c for c in rest if c not in chosen]
    chosen += rng.sample(pool, max(0, min(len(pool), size - len(chosen))))
    return chosen[:size]


def _launch_problems(tmp_path, k: int, case: Case, launch) -> List[str]:
    """Run the launcher on a script that marks its start; what is wrong with the result."""
    work = tmp_path / f"case{k}"
    work.mkdir()
    script = work / "train.py"
    script.write_text(SCRIPT)
    cwd = work / "cwd"
    cwd.mkdir()
    env = clean_env({"COMMSCHED": "1", "COMMSCHED_TELEMETRY_DIR": "telemetry_run"})
    env.update(case.env)
    r = launch(str(script), env, str(cwd))
    problems = problems_of_clean_failure(r, mentions=[case.bad])
    if (work / "STARTED").exists():
        problems.append("the script started")
    if os.listdir(cwd):
        problems.append(f"created {os.listdir(cwd)} in the cwd")
    return [f"  {case}\n      -> {p}" for p in problems] + (
        [f"      stderr: {r.stderr.strip()[-600:]}"] if problems else [])


def test_launcher_rejects_a_sample_before_the_script_starts(tmp_path):
    """``commsched.run`` in forked children (the launcher's code, its own process):
    exit 2, the variable named on stderr, no traceback, the script never started, nothing
    created in the cwd."""
    cases = sample(FORKED_SAMPLE, "forked")
    count_input("env cases through the launcher (forked)", len(cases))

    def launch(script, env, cwd):
        return run_forked("run", [script], env=env, cwd=cwd, timeout=60)

    failures = [line for lines in run_parallel(
        lambda item: _launch_problems(tmp_path, *item, launch), list(enumerate(cases)),
        workers=3) for line in lines]
    assert not failures, "\n".join(failures)


def test_python_m_commsched_run_rejects_a_sample_before_the_script_starts(tmp_path):
    """The same through real ``python -m commsched.run script.py`` processes."""
    cases = sample(SUBPROCESS_SAMPLE, "subprocess")
    count_input("env cases through python -m commsched.run", len(cases))

    def launch(script, env, cwd):
        return run_subprocess([sys.executable, "-m", "commsched.run", script], env=env,
                              cwd=cwd, timeout=120)

    failures = [line for lines in run_parallel(
        lambda item: _launch_problems(tmp_path, *item, launch), list(enumerate(cases)),
        workers=3) for line in lines]
    assert not failures, "\n".join(failures)
