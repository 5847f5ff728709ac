"""Rewrite a Megatron-LM launch script so that training runs under ``commsched.run``.

``commsched patch-launch SCRIPT`` finds the line that starts training (``torchrun ...
pretrain_gpt.py``, ``python -m torch.distributed.run ...``, ``srun ... python -u ...``, the
same inside ``CMD="..."`` or a here-document given to ``sbatch``) and inserts
``-m commsched.run`` right before the entry point::

    torchrun $DISTRIBUTED_ARGS pretrain_gpt.py --num-layers 24
    torchrun $DISTRIBUTED_ARGS -m commsched.run pretrain_gpt.py --num-layers 24

The shell is never interpreted. A small tokenizer reads words with their offsets in the
original text (quotes, ``$(...)``, ``${...}``, backslash-newline, comments, heredocs), so the
rewrite is a pure insertion and every other byte (comments, CRLF, trailing blanks) stays.
Standard library only: this file also runs as ``python megatron_patches/launch_script.py``.

Settings (``--set VAR=VALUE``) go into one marked block of ``export`` lines after the
shebang. A rerun keeps the settings an earlier run exported unless told to drop them
(``--unset VAR``, ``--reset``), and every setting is checked as ``Config.from_env()`` will
check it when the job starts (where commsched is importable): a misspelt name or a bad
value stops the patch, not the job on the cluster.

Example::

    patched = patch_script(open("train.sh").read(), {"COMMSCHED": "1"})
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shlex
import stat
import sys
import tempfile
from typing import NamedTuple

try:
    from commsched.errors import CommschedError
except ImportError:     # run as a file where commsched is not importable
    CommschedError = Exception

__all__ = ["LaunchPatchError", "patch_script", "main", "SHAPES"]

INSERT = "-m commsched.run "
SHAPES = """\
  torchrun [ARGS] SCRIPT.py ...   |   torchrun [ARGS] -m MODULE ...
  python -m torch.distributed.run|launch [ARGS] SCRIPT.py|-m MODULE ...
  [srun|mpirun ...] python [FLAGS] SCRIPT.py ...  (plain python: under srun/mpirun/mpiexec,
      or a pretrain_*/train*/finetune* script)
  torchrun [ARGS] "$SCRIPT_VARIABLE" ...  (the entry point in a quoted variable)
  wrapped in env/uv run/nohup/exec/... or a variable ($PROFILE_CMD python ...), continued
  with backslashes, inside a quoted assignment (CMD="...") or a bash -c / sh -c / eval
  string, or in a here-document given to sbatch/bash/sh"""

_SETTING_NAME = re.compile(r"^COMMSCHED(_[A-Z0-9_]+)?$")
_BLOCK_BEGIN = "# commsched: begin (exported by commsched patch-launch; rerun it to change)"
_BLOCK_END = "# commsched: end"
_BLOCK_RE = re.compile(r"^# commsched: begin[^\n]*\n.*?^# commsched: end[^\n]*\n?", re.M | re.S)

_LAUNCHER = re.compile(r"(?:\S*/)?(torchrun|python(?:\d+(?:\.\d+)?)?)")
# Commands that run another command given later on their line; their own options are
# skipped by looking for the first launcher word instead of parsing each wrapper's flags.
_WRAPPERS = {"srun", "mpirun", "mpiexec", "uv", "conda", "env", "nohup", "time", "exec",
             "command", "numactl", "taskset", "stdbuf", "timeout", "nice", "ionice"}
_RANK_LAUNCHERS = {"srun", "mpirun", "mpiexec"}
_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{"}
_SHELLS = {"bash", "sh", "zsh", "dash"}
# Plain `python x.py` is also how preprocessing tools are run; rewrite it only when the
# name says training (or a rank launcher starts it), so tools/preprocess_data.py stays.
_TRAINING_NAME = re.compile(r"(?:pretrain|train|finetune)[\w.-]*\.py")
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^]]*\])?\+?=")
_REDIRECT = re.compile(r"&>>?|<<<|<<-|<<|<>|<&|>&|>>|>\||<|>")
_BREAK = set(" \t\r\n|&;()<>")
_PATCHED = object()  # sentinel: this launch command already runs commsched.run


class LaunchPatchError(CommschedError, ValueError):
    """The script cannot be patched; the message says why."""


class Word(NamedTuple):
    value: str  # quotes removed, expansions kept verbatim ("$MEGATRON/pretrain_bert.py")
    start: int  # offsets of the raw word in the scanned text
    end: int
    quoted: bool = False  # the whole word is one quoted string: never split by the shell


# --- tokenizer ------------------------------------------------------------------------

def _find(text: str, sub: str, i: int) -> int:
    """text.find, but len(text) when absent: an unterminated quote runs to the end."""
    j = text.find(sub, i)
    return len(text) if j < 0 else j


def _continuation(text: str, i: int) -> int:
    """Length of a backslash-newline at i (CRLF too), which the shell deletes; else 0."""
    return 2 if text.startswith("\\\n", i) else 3 if text.startswith("\\\r\n", i) else 0


def _opens(text: str, i: int) -> bool:
    return text[i] in "'\"`" or text[i:i + 2] in ("$(", "${", "<(", ">(")


def _skip(text: str, i: int) -> int:
    """Index after the quote, $(...), ${...} or <(...) opening at i; nesting respected."""
    c = text[i]
    if c == "'":
        return _find(text, "'", i + 1) + 1
    if c in "\"`":
        i += 1
        while i < len(text) and text[i] != c:
            if text[i] == "\\":
                i += 2
            elif c == '"' and text[i:i + 2] in ("$(", "${"):
                i = _skip(text, i)
            else:
                i += 1
        return min(i + 1, len(text))
    open_, close = text[i + 1], "}" if text[i + 1] == "{" else ")"
    depth, i = 1, i + 2
    while i < len(text) and depth:
        if text[i] == "\\":
            i += 2
        elif _opens(text, i) and text[i] not in "<>":
            i = _skip(text, i)
        else:
            depth += (text[i] == open_) - (text[i] == close)
            i += 1
    return min(i, len(text))


def _read_word(text: str, i: int) -> Word:
    start, parts, quotes = i, [], 0
    while i < len(text):
        c = text[i]
        if _continuation(text, i):
            i += _continuation(text, i)
        elif c == "\\":
            parts.append(text[i + 1:i + 2])
            i += 2
        elif _opens(text, i):
            j = _skip(text, i)
            # Quotes are removed from the value; expansions are kept as written.
            parts.append(text[i + 1:j - 1] if c in "'\"" else text[i:j])
            quotes += c in "'\""
            i = j
        elif c in _BREAK:
            break
        else:
            parts.append(c)
            i += 1
    end = min(i, len(text))
    return Word("".join(parts), start, end,
                quotes == 1 and text[start] in "'\"" and _skip(text, start) == end)


def _skip_heredoc(text: str, i: int, delimiter: str, strip_tabs: bool) -> tuple[int, int]:
    """(end of the body, index after its delimiter line) for a body starting at i."""
    while i < len(text):
        eol = text.find("\n", i)
        eol = len(text) if eol < 0 else eol
        line = text[i:eol].rstrip("\r")
        if (line.lstrip("\t") if strip_tabs else line) == delimiter:
            return i, eol + 1
        i = eol + 1
    return len(text), len(text)


# Commands whose here-document is a script they run (`sbatch <<EOF`, `bash <<'EOF'`).
_SCRIPT_READERS = {"sbatch", "bash", "sh", "zsh", "dash"}


def _scan(text: str) -> tuple[list[list[Word]], list[tuple[int, int]]]:
    """Split shell text into simple commands (lists of words), without redirections; and
    the (start, end) of here-documents given to a command that runs them as a script."""
    commands, words, heredocs, bodies, i = [], [], [], [], 0
    while i < len(text):
        c = text[i]
        if c in " \t\r":
            i += 1
        elif _continuation(text, i):
            i += _continuation(text, i)
        elif c == "\n" or c in "|&;()" and not text.startswith("&>", i):
            commands.append(words)
            words, i = [], i + 1
            if c == "\n":  # heredoc bodies are data, not commands, unless run as a script
                for delimiter, strip_tabs, runs in heredocs:
                    start = i
                    end, i = _skip_heredoc(text, i, delimiter, strip_tabs)
                    if runs:
                        bodies.append((start, end))
                heredocs = []
        elif c == "#":  # a word cannot start here, so this is a comment
            i = _find(text, "\n", i)
        elif c in "<>&" and text[i + 1:i + 2] != "(":
            op = _REDIRECT.match(text, i).group()
            if words and words[-1].end == i and words[-1].value.isdigit():
                words.pop()  # `2>&1`: the 2 is a file descriptor, not an argument
            i += len(op)
            while text[i:i + 1] in (" ", "\t"):
                i += 1
            target = _read_word(text, i)
            i = target.end
            if op in ("<<", "<<-"):
                runs = bool(words) and _base(words[0]) in _SCRIPT_READERS
                heredocs.append((target.value, op == "<<-", runs))
        else:
            word = _read_word(text, i)
            words.append(word)
            i = word.end
    commands.append(words)
    return [w for w in commands if w], bodies


# --- recognising launch commands ---------------------------------------------------------

def _clean(value: str) -> str:
    return value.strip("\"'")  # quotes that were escaped inside a CMD="..." string


def _base(word: Word) -> str:
    return _clean(word.value).rsplit("/", 1)[-1]


def _is_launcher(word: Word) -> bool:
    return _LAUNCHER.fullmatch(_clean(word.value)) is not None


_EXPANSION = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[^}]*\})")


def _is_expansion(word: Word) -> bool:
    """The word is one parameter expansion (`$X`, `${X}`, `${X[@]}`, quoted or not)."""
    return _EXPANSION.fullmatch(word.value) is not None


# torchrun options that take the next word as their value (unless written OPTION=VALUE).
_TORCHRUN_VALUES = {
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank",
    "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id",
    "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--master-addr", "--master_addr",
    "--master-port", "--master_port", "--local-addr", "--local_addr", "--max-restarts",
    "--max_restarts", "--monitor-interval", "--monitor_interval", "--start-method",
    "--start_method", "--role", "--log-dir", "--log_dir", "-r", "--redirects", "-t", "--tee",
    "--local-ranks-filter", "--local_ranks_filter", "--logs-specs", "--logs_specs"}


def _launcher_entry(args: list[Word]):
    """Entry point after torchrun / torch.distributed.{run,launch}: a *.py or its -m flag."""
    for k, word in enumerate(args):
        value = _clean(word.value)
        if value in ("-m", "--module"):
            # torchrun's -m is a flag ("the script is a module"), so `-m commsched.run`
            # goes before it and commsched.run receives `-m MODULE ARGS`.
            module = _clean(args[k + 1].value) if k + 1 < len(args) else ""
            return _PATCHED if module == "commsched.run" else word
        if value in ("--no-python", "--no_python"):
            return None  # the entry point is an executable, not Python
        if value.endswith(".py") and not value.startswith("-"):
            return word
    # No SCRIPT.py: the entry point may be held in a variable, `"$PRETRAIN_SCRIPT_PATH"`.
    # Only a quoted one is a single word; an unquoted `$ARGS` or `${ARGS[@]}` is taken for
    # launcher options, which scripts keep in such variables.
    k = 0
    while k < len(args):
        word, value = args[k], _clean(args[k].value)
        if value.startswith("-"):
            k += 2 if value in _TORCHRUN_VALUES else 1
        elif _is_expansion(word) and not word.quoted:
            k += 1
        else:
            return word if word.quoted and _is_expansion(word) else None
    return None


def _entry(words: list[Word]):
    """The word to insert before, _PATCHED, or None when this command starts no training."""
    i = 0
    while i < len(words) and (words[i].value in _KEYWORDS or _ASSIGN.match(words[i].value)):
        i += 1
    # Only a command that *invokes* a launcher counts: `echo torchrun x.py` does not. A
    # leading expansion is a command prefix kept in a variable (`${PROFILE_CMD} python`).
    if i == len(words) or not (_is_launcher(words[i]) or _base(words[i]) in _WRAPPERS
                               or _is_expansion(words[i])):
        return None
    under_rank_launcher = False
    while i < len(words) and not _is_launcher(words[i]):
        under_rank_launcher |= _base(words[i]) in _RANK_LAUNCHERS
        i += 1
    if i == len(words):
        return None
    args = words[i + 1:]
    if _base(words[i]) == "torchrun":
        return _launcher_entry(args)
    j = 0  # python: skip interpreter flags up to the script or -m
    while j < len(args) and _clean(args[j].value).startswith("-"):
        flag = _clean(args[j].value)
        if flag == "-m":
            module = _clean(args[j + 1].value) if j + 1 < len(args) else ""
            if module == "commsched.run":
                return _PATCHED
            if module in ("torch.distributed.run", "torch.distributed.launch"):
                return _launcher_entry(args[j + 2:])
            return None  # `python -m pip ...`: not a training launch
        if flag.startswith("-c"):
            return None
        j += 2 if flag in ("-W", "-X") else 1
    if j < len(args):
        script = _clean(args[j].value)
        name = script.rsplit("/", 1)[-1]
        if script.endswith(".py") and (under_rank_launcher or _TRAINING_NAME.fullmatch(name)):
            return args[j]
    return None


def _quoted_body(text: str, word: Word):
    """(start, end) of the string inside NAME="..." / '...' (or a bare quoted word)."""
    raw = text[word.start:word.end]
    m = _ASSIGN.match(raw)
    s = m.end() if m else 0
    if len(raw) - s < 2 or raw[s] not in "'\"":
        return None
    return (word.start + s + 1, word.end - 1) if _skip(raw, s) == len(raw) else None


def _find_launches(text: str, base: int = 0) -> tuple[list[int], int]:
    """Offsets (into the whole script) to insert at, and how many launches are patched."""
    inserts, patched = [], 0
    commands, bodies = _scan(text)
    for start, end in bodies:
        more, done = _find_launches(text[start:end], base + start)
        inserts += more
        patched += done
    for words in commands:
        entry = _entry(words)
        if entry is _PATCHED:
            patched += 1
        elif entry is not None:
            inserts.append(base + entry.start)
        # Commands kept in strings: CMD="torchrun ...", bash -c "...", eval "...".
        for k, word in enumerate(words):
            runs_string = k > 0 and (
                words[k - 1].value == "-c"
                and any(_base(w) in _SHELLS for w in words[:k - 1])
                or words[k - 1].value == "eval")
            body = _quoted_body(text, word) if runs_string or _ASSIGN.match(word.value) else None
            if body:
                more, done = _find_launches(text[body[0]:body[1]], base + body[0])
                inserts += more
                patched += done
    return inserts, patched


# --- the export block and the patch ------------------------------------------------------

def _export_block(settings: dict[str, str], newline: str) -> str:
    lines = [_BLOCK_BEGIN]
    for name, value in settings.items():
        lines.append(f"export {name}={shlex.quote(str(value))}")
    return newline.join(lines + [_BLOCK_END, ""])


def _exported(text: str) -> dict[str, str]:
    """The settings the block of an earlier run exports, in order ({} without a block)."""
    found = _BLOCK_RE.search(text)
    settings: dict[str, str] = {}
    for line in found.group(0).splitlines()[1:-1] if found else ():
        words = shlex.split(line.rstrip("\r"))
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            settings[name] = value
    return settings


def _check_settings(settings: dict[str, str]) -> None:
    """Names and values as ``Config.from_env()`` checks them when the job starts, where
    commsched can be imported (run as a file without it: names by pattern only)."""
    for name in settings:
        if not isinstance(name, str) or not _SETTING_NAME.match(name):
            raise LaunchPatchError(
                f"setting {name!r}: name must match {_SETTING_NAME.pattern}")
    try:
        from commsched.config import Config, ConfigError
    except ImportError:
        return
    try:
        Config.from_env(settings)
    except ConfigError as e:
        raise LaunchPatchError(f"setting {e}") from None


def _put_export_block(text: str, block: str | None) -> str:
    """Replace an earlier block (None: remove it), or insert after the shebang and leading
    comments/blanks.

    Blank lines are skipped too: sbatch reads #SBATCH lines only up to the first command,
    and those may be separated by blank lines. The launch line is never a comment, so the
    offset always lands at the start of a line.
    """
    if _BLOCK_RE.search(text):
        return _BLOCK_RE.sub(lambda _: block or "", text, count=1)
    if block is None:
        return text
    offset = 0
    for line in text.splitlines(keepends=True):
        if line.strip() and not line.lstrip().startswith("#"):
            break
        offset += len(line)
    return text[:offset] + block + text[offset:]


def patch_script(text: str, settings: dict[str, str] | None = None, *,
                 unset: tuple[str, ...] = (), reset: bool = False) -> str:
    """Return ``text`` with ``-m commsched.run`` inserted before each training entry point.

    ``settings`` (``{"COMMSCHED": "1"}``) go into one marked ``export`` block after the
    shebang and leading comments, together with what the block of an earlier run exports,
    less the names in ``unset`` (each must be exported there), or without it with ``reset``.
    Patching a patched script with nothing to change changes nothing. Raises
    LaunchPatchError when no launch command is recognised, or a setting is not one
    ``Config.from_env()`` accepts (the message names it).

    Example::

        patch_script("torchrun $A pretrain_gpt.py\\n")  # 'torchrun $A -m commsched.run pretrain_gpt.py\\n'
    """
    newline = "\r\n" if re.match(r"[^\n]*\r\n", text) else "\n"
    earlier = _exported(text)
    merged = {} if reset else dict(earlier)
    for name in unset:
        if name not in earlier:
            raise LaunchPatchError(
                f"--unset {name}: not exported by an earlier run (exported: "
                f"{', '.join(earlier) or 'nothing'})")
        merged.pop(name, None)
    merged.update(settings or {})
    rewrite = list(merged.items()) != list(earlier.items())
    if rewrite:
        _check_settings(merged)
    inserts, patched = _find_launches(text)
    if not inserts and not patched:
        raise LaunchPatchError(f"no recognisable launch line; recognised shapes:\n{SHAPES}")
    for offset in sorted(set(inserts), reverse=True):
        text = text[:offset] + INSERT + text[offset:]
    if not rewrite:
        return text
    return _put_export_block(text, _export_block(merged, newline) if merged else None)


# --- command line ------------------------------------------------------------------------

def _setting(arg: str) -> tuple[str, str]:
    name, sep, value = arg.partition("=")
    if not sep or not _SETTING_NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"{arg!r}: expected VAR=VALUE with VAR matching {_SETTING_NAME.pattern}")
    return name, value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commsched patch-launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make a Megatron-LM launch script start training under commsched.run.",
        epilog=f"recognised launch shapes:\n{SHAPES}\n\nexit codes:\n"
               "  0  written, or (--check) diff printed / already patched\n"
               "  1  the output could not be written\n"
               "  2  bad arguments or settings, unreadable SCRIPT, or no recognisable launch "
               "line")
    parser.add_argument("script", metavar="SCRIPT", help="the launch shell script")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-o", "--output", metavar="OUT", help="write here (default: stdout)")
    where.add_argument("--in-place", action="store_true", help="rewrite SCRIPT itself")
    parser.add_argument("--check", action="store_true",
                        help="print a unified diff of the change; write nothing "
                             "(overrides -o/--in-place)")
    parser.add_argument("--set", metavar="VAR=VALUE", action="append", type=_setting,
                        default=[], help="export a COMMSCHED* variable (repeatable); the "
                                         "ones an earlier run exported stay")
    parser.add_argument("--unset", metavar="VAR", action="append", default=[],
                        help="drop a variable an earlier run exported (repeatable)")
    parser.add_argument("--reset", action="store_true",
                        help="drop every variable an earlier run exported")
    return parser


def _write_atomic(path: str, data: bytes, mode: int) -> None:
    """Temp file in the target's directory, fsync, rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    """Body of ``commsched patch-launch``; returns the exit code (see --help)."""
    args = _parser().parse_args(argv)
    try:
        with open(args.script, "rb") as f:
            source_mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            # surrogateescape: any byte, valid UTF-8 or not, is written back unchanged.
            text = f.read().decode("utf-8", "surrogateescape")
    except OSError as e:
        _err(f"cannot read {args.script}: {e.strerror or e}")
        return 2
    try:
        patched = patch_script(text, dict(args.set), unset=tuple(args.unset),
                               reset=args.reset)
    except LaunchPatchError as e:
        _err(f"{args.script}: {e}")
        return 2
    if args.check:
        diff = "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in difflib.unified_diff(text.splitlines(True), patched.splitlines(True),
                                             f"a/{args.script}", f"b/{args.script}"))
        _write_stdout(diff)
        if not diff:
            _err(f"{args.script}: already patched, nothing to change")
        return 0
    data = patched.encode("utf-8", "surrogateescape")
    if not (args.in_place or args.output):
        _write_stdout(patched)
        return 0
    target = os.path.realpath(args.script if args.in_place else args.output)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else source_mode
        _write_atomic(target, data, mode)
    except OSError as e:
        _err(f"cannot write {target}: {e.strerror or e}")
        return 1
    return 0


def _err(msg: str) -> None:
    print(f"commsched patch-launch: {msg}", file=sys.stderr)


def _write_stdout(text: str) -> None:
    out = getattr(sys.stdout, "buffer", None)
    if out is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()  # keep order with anything already written as text
    out.write(text.encode("utf-8", "surrogateescape"))
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
