"""ARCHITECTURE.md is the map a newcomer reads first: every file, module, class and function it
names in backticks exists (a rename that forgets the map fails here)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import flatopt

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def modules() -> dict[str, object]:
    """Every module of the package by full name and by its last name (when unique)."""
    found = {"flatopt": flatopt}
    for info in pkgutil.walk_packages(flatopt.__path__, "flatopt."):
        if info.name.endswith("__main__"):   # runs the CLI when imported
            continue
        found[info.name] = importlib.import_module(info.name)
    short: dict[str, list] = {}
    for name, module in list(found.items()):
        short.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    for name, candidates in short.items():
        if len(candidates) == 1 and name not in found:
            found[name] = candidates[0]
    return found


MODULES = modules()
DEFINED = {name: module for module in MODULES.values() for name in vars(module)
           if name[:1].isupper() and isinstance(vars(module)[name], type)}
"""Classes by name, wherever the package defines them (``Rule``, ``FlatBuffer``)."""


def named_paths() -> list[str]:
    paths = []
    for code in CODE.findall(TEXT):
        for token in code.split():
            token = token.strip("(),;:'\"")
            if "/" in token and re.fullmatch(r"[A-Za-z0-9_./<>-]+", token) and "<" not in token:
                first = token.split("/")[0]
                if first in {"checkpoint", "optimizers", "lr_scheduler", "distributed"}:
                    token = "flatopt/" + token   # named inside the package, as its modules are
                elif first not in {"flatopt", "kernels", "tests", "bench", ".ci"}:
                    continue
                last = token.rstrip("/").rsplit("/", 1)[-1]
                if "." in last and last.rsplit(".", 1)[1] not in {"py", "md", "toml", "json",
                                                                  "h5", "txt", "cfg"}:
                    token = token[:token.rindex(".")] + ".py"   # a module's attribute
                paths.append(token.rstrip("/"))
    return sorted(set(paths))


def named_objects() -> list[str]:
    """Dotted names whose first part is a module of the package or a name flatopt exports
    (``loader.Prepared.of``, ``Schema.check_group``, ``flatopt.kernels.backend``)."""
    out = []
    for code in CODE.findall(TEXT):
        for match in DOTTED.finditer(code):
            name = match.group(0)
            head = name.split(".")[0]
            if name.endswith((".py", ".md", ".h5", ".json")) or "/" in code[:match.start()][-1:]:
                continue
            if head in MODULES or head in flatopt.__all__ or head in DEFINED \
                    or (head[:1].isupper() and len(head) > 1):
                out.append(name)
    return sorted(set(out))


def resolve(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in MODULES:
            obj = MODULES[head]
            break
        if cut == 1 and head in flatopt.__all__:
            obj = getattr(flatopt, head)
            break
        if cut == 1 and head in DEFINED:
            obj = getattr(DEFINED[head], head)
            break
    else:
        raise AssertionError(f"{name}: no such module")
    for attribute in parts[cut:]:
        if isinstance(obj, type) and attribute in getattr(obj, "__dataclass_fields__", {}):
            return obj
        if isinstance(obj, type) and attribute in getattr(obj, "__annotations__", {}):
            return obj
        obj = getattr(obj, attribute)
    return obj


def test_the_map_names_things():
    assert len(named_paths()) > 10 and len(named_objects()) > 10


@pytest.mark.parametrize("path", named_paths())
def test_every_file_it_names_exists(path):
    assert (ROOT / path).exists(), f"ARCHITECTURE.md names {path}, which does not exist"


@pytest.mark.parametrize("name", named_objects())
def test_every_module_class_and_function_it_names_exists(name):
    try:
        resolve(name)
    except (AttributeError, AssertionError) as exc:
        pytest.fail(f"ARCHITECTURE.md names `{name}`, which does not exist ({exc})")


def test_a_name_that_does_not_exist_is_caught():
    for wrong in ("reader.open_file", "reader.parse_structure", "Schema.no_such_method"):
        with pytest.raises((AttributeError, AssertionError)):
            resolve(wrong)
