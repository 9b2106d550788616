"""The documentation (README.md and every page under docs/).

- Every ```python block is a complete program and runs: each in a fresh namespace, in a
  temporary working directory (blocks save files), in this process, so under the suite's Numba
  settings (tests/conftest.py: a fresh cache, the CUDA simulator). A block that needs hardware
  this machine lacks is named in NEEDS and skipped, saying why.
- What a test can read in the pages agrees with the code: the API page's defaults are the
  optimizers', every registered optimizer has its row and its rule, the tests page names every
  test file, the extras table is pyproject.toml's, the reference documents every public name,
  every page is in the site's navigation, and every relative link leads to a file.
- `mkdocs build --strict` passes (a broken link, anchor, page or docstring is a warning, and
  --strict fails on any); skipped, saying why, where the `docs` extra is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import linecache
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import flatopt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NEEDS = {"import cupy": "needs CuPy and a GPU"}
"""A marker in a block's code, and why a block with it cannot run here."""


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, number on the page from 1, code) of every python block."""
    return [(name(page), number, code) for page in PAGES
            for number, code in enumerate(BLOCK.findall(page.read_text()), start=1)]


BLOCKS = python_blocks()


def needs(code: str) -> str | None:
    return next((why for marker, why in NEEDS.items() if marker in code), None)


def test_the_documents_have_blocks_and_only_the_gpu_one_cannot_run_here():
    pages = {page for page, _, _ in BLOCKS}
    assert len(BLOCKS) >= 15 and "README.md" in pages and len(pages) >= 10
    assert [page for page, _, code in BLOCKS if needs(code)] == ["docs/guide/gpu.md"]


@pytest.mark.parametrize("page, number, code",
                         [pytest.param(*block, id=f"{block[0]}#{block[1]}") for block in BLOCKS])
def test_every_python_block_runs_as_a_complete_program(page, number, code, tmp_path,
                                                       monkeypatch):
    reason = needs(code)
    if reason:
        pytest.skip(f"{page} python block {number} {reason}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}   # nothing given: every name is the block's own
    filename = f"{page} python block {number}"
    # its source readable as a file's or a notebook cell's (a user rule's functions need it)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    registered = set(flatopt.registry.names())
    try:
        exec(compile(code, filename, "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"{page} python block {number} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        linecache.cache.pop(filename, None)
        for name in set(flatopt.registry.names()) - registered:  # a block's own rules
            flatopt.registry.unregister(name)


# --- the tables and lists a test can read ---------------------------------------------------

def table_rows(page: Path) -> list[list[str]]:
    """The cells of every table row of ``page`` (header and separator rows included)."""
    rows = []
    for line in page.read_text().splitlines():
        if line.startswith("| "):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
            rows.append([cell.strip() for cell in cells])
    return rows


def optimizer_rows() -> dict[str, str]:
    """The API page's signature cell of each optimizer, by class name."""
    rows = {}
    for cells in table_rows(DOCS / "guide" / "api.md"):
        match = re.fullmatch(r"`(\w+)\((.*)\)`", cells[0])
        if match and match.group(1) in flatopt.registry.names():
            rows[match.group(1)] = match.group(2)
    return rows


def written_default(text: str):
    if text == "inf":
        return math.inf
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text   # an expression such as `(None, 1e-3)` parses; a name stays text


def keyword_defaults(signature: str) -> dict[str, str]:
    """``name=value`` pairs of a signature as the page writes it (values may be tuples)."""
    found, depth, current = {}, 0, ""
    for char in signature + ",":
        if char == "," and depth == 0:
            if "=" in current:
                key, value = current.split("=", 1)
                found[key.strip()] = value.strip()
            current = ""
            continue
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        current += char
    return found


def actual_default(cls, key: str):
    hyperparameters = cls.schema.hyperparameters
    if key in hyperparameters:
        return hyperparameters[key].default
    return inspect.signature(cls).parameters[key].default


def test_the_api_page_has_every_optimizer_with_its_defaults():
    rows = optimizer_rows()
    assert set(rows) == set(flatopt.registry.names())
    wrong = []
    for cls_name, signature in rows.items():
        cls = getattr(flatopt, cls_name)
        for key, text in keyword_defaults(signature).items():
            if key == "..." or text == "...":
                continue
            expected = written_default(text)
            try:
                actual = actual_default(cls, key)
            except KeyError:
                wrong.append(f"{cls_name}: no argument {key}")
                continue
            if isinstance(actual, tuple):
                actual = tuple(actual)
            if actual != expected and not (isinstance(expected, str) and expected == repr(actual)):
                wrong.append(f"{cls_name}({key}={text}): the optimizer's default is {actual!r}")
    assert not wrong, "docs/guide/api.md:\n" + "\n".join(wrong)


def test_the_api_page_check_catches_a_wrong_default():
    cls = flatopt.SGD
    assert actual_default(cls, "lr") != written_default("1e-2")
    assert actual_default(cls, "lr") == written_default("1e-3")
    assert keyword_defaults("params, lr=1e-3, betas=(0.9, 0.999), *, maximize=False") == {
        "lr": "1e-3", "betas": "(0.9, 0.999)", "maximize": "False"}


def test_the_update_rules_page_has_every_optimizer():
    text = (DOCS / "guide" / "update-rules.md").read_text()
    rules = {cells[0] for cells in table_rows(DOCS / "guide" / "update-rules.md")}
    named = {part.strip() for cell in rules for part in cell.split("/")}
    assert set(flatopt.registry.names()) <= named, set(flatopt.registry.names()) - named
    assert "caution=True" in text


def test_the_tests_page_names_every_test_file():
    text = (DOCS / "guide" / "tests.md").read_text()
    named = set(re.findall(r"`(test_[\w*]+\.py)`", text))
    files = sorted(path.name for path in (ROOT / "tests").glob("test_*.py"))
    unnamed = [file for file in files
               if not any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\w*"), file)
                          for pattern in named)]
    assert not unnamed, f"docs/guide/tests.md does not name {unnamed}"


def test_the_extras_table_is_pyprojects():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    rows = table_rows(DOCS / "getting-started.md")
    listed = {cells[0].strip("`") for cells in rows if cells[0].startswith("`")}
    assert listed == set(extras)


def test_the_reference_documents_every_public_name():
    text = "".join(page.read_text() for page in (DOCS / "reference").glob("*.md"))
    documented = set(re.findall(r"^::: flatopt(?:\.checkpoint)?\.(\w+)$", text, re.M))
    assert set(flatopt.__all__) - {"__version__"} <= documented


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:"):]
    entries = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert entries == pages


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_relative_link_leads_to_a_file(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{name(page)} links to {broken}, which do not exist"


# --- the site -----------------------------------------------------------------------------

MKDOCS_MISSING = [module for module in ("mkdocs", "material", "mkdocstrings",
                                        "mkdocstrings_handlers")
                  if importlib.util.find_spec(module) is None]
"""What `mkdocs build` needs (mkdocstrings_handlers: mkdocstrings-python's handler)."""


@pytest.mark.skipif(bool(MKDOCS_MISSING),
                    reason=f"the docs extra is not installed ({', '.join(MKDOCS_MISSING)} "
                           "missing): pip install -e '.[docs]'")
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}   # Material's banner about MkDocs 2
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert done.returncode == 0 and not warnings, output
    assert (tmp_path / "site" / "reference" / "optimizers" / "index.html").is_file()
    html = (tmp_path / "site" / "reference" / "optimizers" / "index.html").read_text()
    assert "For each parameter with a gradient" in html   # the docstrings were rendered
