"""The package's layering, checked statically over its source (issue 19): no import cycle
among its modules; imports inside functions only for the optional backends (numba-cuda,
mpi4py); no private name imported from another module; no private attribute of an optimizer
touched outside ``flatopt/optimizer.py`` (the optimizer's internal interface is its named,
documented methods); no module over 600 lines and no function over 70."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (("flatopt", "flatopt"), ("kernels", "flatopt.kernels"))  # source dir, package

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 70
MAX_FUNCTION_IMPORTS = 5
LAZY_ALLOWED = {"flatopt.kernels.cuda"}
"""Package modules that may be imported inside a function: they import numba-cuda, an
optional backend (mpi4py is imported by no module of the package at its top)."""

PRIVATE_REACH = re.compile(
    r"\b(?:opt|optimizer|self\.opt|self\._opt|self\.optimizer|twin|owner|sharding)\._[a-z]\w*"
    r"|getattr\((?:opt|optimizer|self\.opt|self\._opt), [\"']_[a-z]")
"""An optimizer's (or its sharding's) underscore attribute reached from outside its module."""


def _modules() -> dict[str, Path]:
    found = {}
    for directory, package in PACKAGES:
        base = ROOT / directory
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _targets(module: str, node: ast.AST) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for an import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    if node.level:
        parts = module.split(".")
        package = parts if MODULES[module].name == "__init__.py" else parts[:-1]
        package = package[:len(package) - (node.level - 1)]
        target = ".".join(package + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append((sub, None) if sub in MODULES else (target, alias.name))
    return out


def _imports():
    """(module, target, name, inside a function, under TYPE_CHECKING, line) of every import
    of a package module."""
    found = []

    def visit(module, node, in_function, type_checking):
        for child in ast.iter_child_nodes(node):
            function = in_function or isinstance(child, (ast.FunctionDef,
                                                         ast.AsyncFunctionDef))
            checking = type_checking or (isinstance(child, ast.If)
                                         and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target, name in _targets(module, child):
                    if target == "flatopt" or target.startswith("flatopt."):
                        found.append((module, target, name, function, checking,
                                      child.lineno))
            visit(module, child, function, checking)

    for module, tree in TREES.items():
        visit(module, tree, False, False)
    return found


IMPORTS = _imports()


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module, target, _, function, checking, _ in IMPORTS:
        if not function and not checking and target in MODULES and target != module:
            graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in graph:
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def test_the_checks_see_the_package():
    assert "flatopt.optimizer" in MODULES and "flatopt.kernels.cpu" in MODULES
    assert len(IMPORTS) > 50


def test_no_import_cycle():
    assert _cycles() == []


def test_imports_inside_functions_are_the_optional_backends_only():
    inner = [(module, target, line) for module, target, _, function, _, line in IMPORTS
             if function]
    assert [item for item in inner if item[1] not in LAZY_ALLOWED] == []
    assert len(inner) <= MAX_FUNCTION_IMPORTS, inner


def test_no_private_name_imported_from_another_module():
    """A private *module* (``from . import _stepping``) is fine; an underscore function,
    class or value taken from another module is not."""
    private = [(module, target, name) for module, target, name, _, _, _ in IMPORTS
               if name and name.startswith("_") and not name.startswith("__")
               and target != module]
    assert private == []


def test_no_private_optimizer_attribute_outside_the_optimizer():
    reaches = []
    for module, path in MODULES.items():
        if module in ("flatopt.optimizer", "flatopt.distributed._sharding"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in PRIVATE_REACH.finditer(line):
                reaches.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert reaches == []


def test_the_private_reach_check_catches_reaches():
    for line in ("opt._plans = None", "self.opt._kernels.step()", "x = optimizer._device",
                 "getattr(opt, '_sharding', None)", "opt.sharding._sync_shards()"):
        assert PRIVATE_REACH.search(line), line
    for line in ("opt.sharding", "self._opt_count", "opt.__class__"):
        assert not PRIVATE_REACH.search(line), line


def test_no_module_over_600_lines():
    big = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    assert {module: n for module, n in big.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_over_70_lines():
    long = [(module, node.name, node.end_lineno - node.lineno + 1)
            for module, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("module", ["flatopt._stepping", "flatopt.training",
                                    "flatopt.distributed._sharding", "flatopt._device"])
def test_kernels_are_reached_through_the_backend_dispatch(module):
    """The optimizer's neighbours take kernels from ``flatopt.kernels.backend(name)`` (or the
    optimizer's device), not from a backend module."""
    direct = [target for source, target, _, _, _, _ in IMPORTS
              if source == module and target in ("flatopt.kernels.cpu", "flatopt.kernels.cuda")]
    assert direct == []


def test_no_branches_on_where_the_buffers_live():
    """The device is an object chosen once (``flatopt._device.resolve``): nothing asks
    whether there is one."""
    branches = [f"{path.relative_to(ROOT)}:{number}"
                for path in MODULES.values()
                for number, line in enumerate(path.read_text().splitlines(), start=1)
                if re.search(r"_device is (not )?None", line)]
    assert branches == []
