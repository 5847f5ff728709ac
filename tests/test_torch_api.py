"""commsched calls no torch.distributed function that torch marks deprecated: such a call
warns (FutureWarning) in every rank's process, where pytest's warning filters do not
reach, and torch attributes the warning to its own wrapper, not to the caller. Read
statically from the source of the packages, as test_layering.py reads imports."""

import ast
import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from test_layering import PACKAGES, ROOT

# How the source names torch.distributed and its c10d module.
_MODULES = {"dist": dist, "torch.distributed": dist, "c10d": c10d,
            "distributed_c10d": c10d, "torch.distributed.distributed_c10d": c10d}


def _deprecated(module, name):
    return getattr(getattr(module, name, None), "__deprecated__", None)


def _calls(path):
    """(line, module text, function name) of each call of ``<module>.<name>(...)`` and of
    each name imported from torch.distributed."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in _MODULES:
                yield node.lineno, owner, node.func.attr
        elif isinstance(node, ast.ImportFrom) and node.module in _MODULES:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def test_no_deprecated_torch_distributed_calls():
    found = []
    for folder in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    found += [f"{os.path.relpath(path, ROOT)}:{line}: {owner}.{attr}: "
                              f"{_deprecated(_MODULES[owner], attr)}"
                              for line, owner, attr in _calls(path)
                              if _deprecated(_MODULES[owner], attr)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_deprecated_call(tmp_path):
    # The check itself: the names commsched once called are flagged, their current
    # names are not.
    source = tmp_path / "sample.py"
    source.write_text("import torch.distributed as dist\n"
                      "dist.all_gather_into_tensor(out, inp)\n"
                      "dist.all_gather_single(out, inp)\n")
    flagged = [attr for _, owner, attr in _calls(str(source))
               if _deprecated(_MODULES[owner], attr)]
    assert flagged == ["all_gather_into_tensor"]
