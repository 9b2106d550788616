"""The README is the short front page: what flatopt is, the quick start's two commands, one
complete example, the features and links into docs/ (the rest of the documentation).

Its python block runs with every other page's (tests/test_docs.py, which also checks that its
relative links lead to files); here: its length and shape, that its commands are the ones CI
and the getting-started page use, that the test times it quotes are the tests page's, and that
it links to every page of the guide."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def commands(text: str) -> list[str]:
    block = SH_BLOCK.search(section(text, "Quick start")).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_readme_is_a_short_front_page():
    assert len(README.splitlines()) <= 300
    titles = re.findall(r"^## (.+)$", README, re.M)
    assert titles == ["Quick start", "A complete example", "Documentation"]
    assert len(re.findall(r"^```python$", README, re.M)) == 1   # one complete example
    assert README.count("\n- **") >= 6                          # the feature list


def test_the_quick_start_is_the_two_commands_ci_and_getting_started_run():
    demo, tests = commands(README)
    assert demo == ("python3 -m venv .venv && .venv/bin/pip install -e . && "
                    ".venv/bin/python -m flatopt.demo")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert ci == tests  # CI runs the README's command, extras included
    assert commands((DOCS / "getting-started.md").read_text()) == [demo, tests]


def minutes(text: str) -> int:
    """``21 min 11 s`` (or ``21 minutes``) to whole minutes, rounded."""
    match = re.search(r"(\d+) min(?:utes)?(?: (\d+) s)?", text)
    return round(int(match.group(1)) + int(match.group(2) or 0) / 60)


def test_the_test_times_it_quotes_are_the_tests_pages():
    rows = {}
    for line in (DOCS / "guide" / "tests.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`.venv/bin/python -m pytest"):
            rows["fast" if "not slow" in cells[0] else "full"] = minutes(cells[2])
    quick = section(README, "Quick start")
    full = re.search(r"\(all of them: ([^,]+),", quick).group(1)
    fast = re.search(r"ran in (\d+ minutes)", quick).group(1)
    assert minutes(full) == rows["full"] and minutes(fast) == rows["fast"]
    date = re.search(r"measured (\d{4}-\d\d-\d\d)", quick).group(1)
    assert f"Measured on {date}" in (DOCS / "guide" / "tests.md").read_text()
    assert section(README, "Quick start").replace("docs/guide/", "guide/") == \
        section((DOCS / "getting-started.md").read_text(), "Quick start")


def test_it_links_to_every_page_of_the_documentation():
    linked = set(re.findall(r"\]\((docs/[\w/.-]+\.md)\)", README))
    pages = {page.relative_to(ROOT).as_posix() for page in DOCS.rglob("*.md")
             if page.parent.name != "reference" or page.name == "index.md"}
    assert pages - {"docs/architecture.md"} <= linked, pages - linked
    assert "(ARCHITECTURE.md)" in README
