"""The package's import graph, read statically from the source, function-level imports
and ``TYPE_CHECKING`` blocks included: no module imports itself through others, and the
scheduler core (``commsched.scheduler`` and everything it imports) imports no instrument:
telemetry, the simulator, the tuner, or the adapter builder that wires them."""

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")
# source folder -> the package it installs as (setup.py's package_dir)
PACKAGES = {"commsched": "commsched", "hooks": "commsched.hooks",
            "megatron_patches": "commsched.megatron_patches"}
INSTRUMENTS = ("commsched.telemetry", "commsched.sim", "commsched.autotune",
               "commsched.adapter")


def _modules():
    """module name -> (path, is a package's __init__)."""
    found = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for name in files:
                if name.endswith(".py"):
                    module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    found[module] = (os.path.join(dirpath, name), name == "__init__.py")
    return found


def _imports(module, path, is_package, known):
    """The package modules ``module`` imports."""
    tree = ast.parse(open(path).read())
    base = module if is_package else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                origin = ".".join(parts[:len(parts) - node.level + 1])
                origin = f"{origin}.{node.module}" if node.module else origin
            else:
                origin = node.module
            # ``from pkg import module`` reaches the module; ``from pkg import name`` the
            # module that defines it
            names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _graph():
    known = _modules()
    return {m: _imports(m, path, pkg, known) for m, (path, pkg) in known.items()}


def _closure(graph, start):
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_no_module_imports_itself_through_others():
    graph = _graph()
    cycles = []
    for module in sorted(graph):
        for other in graph[module]:
            if module in _closure(graph, other) and not other.startswith(module + "."):
                cycles.append((module, other))
    # A package's __init__ importing its own submodules is how packages load, not a circle.
    cycles = [(a, b) for a, b in cycles
              if not (b.startswith(a + ".") or a.startswith(b + "."))]
    assert not cycles, cycles


def test_the_scheduler_core_imports_no_instrument():
    graph = _graph()
    core = _closure(graph, "commsched.scheduler")
    assert "commsched.lane" in core and "commsched.completion" in core   # (it is read)
    assert not [m for m in core if m.startswith(INSTRUMENTS)], sorted(core)


def test_no_class_over_400_lines_and_no_module_over_900():
    """Small enough to read whole: a class that outgrows this owns too much."""
    too_long = []
    for module, (path, _) in _modules().items():
        source = open(path).read()
        if source.count("\n") > 900:
            too_long.append((module, source.count("\n")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                too_long.append((f"{module}.{node.name}", node.end_lineno - node.lineno + 1))
    assert not too_long, too_long
