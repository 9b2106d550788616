"""A griffe extension for the API reference (mkdocs.yml loads it; it is not part of the site).

- ``flatopt.kernels`` is installed from ``kernels/`` (``package-dir`` in pyproject.toml), outside
  ``flatopt/``, where griffe's static analysis does not look for it: without it, the names
  ``flatopt`` re-exports from there (``set_parallel_policy``, ``get_parallel_policy``) cannot be
  resolved. The extension attaches ``kernels/`` to the loaded ``flatopt`` package as its
  ``kernels`` subpackage, through griffe's public ``visit``.
- The docstrings are written for Python's ``help()`` with a few Sphinx habits: roles
  (``:class:`Adam```) and ``::`` before a literal block. The extension renders the role as the
  code it names and the ``::`` as ``:`` (the indented block after it is already a code block in
  Markdown); the source is not changed.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
LITERAL = re.compile(r"::$", re.M)


class FlatoptDocs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name == "flatopt" and "kernels" not in pkg.members:
            attach(pkg, "kernels", KERNELS, loader)

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = LITERAL.sub(":", ROLE.sub(r"`\1`", obj.docstring.value))


def visit(name: str, path: Path, parent: griffe.Module,
          loader: griffe.GriffeLoader) -> griffe.Module:
    return griffe.visit(name, path, path.read_text(encoding="utf-8"), parent=parent,
                        extensions=loader.extensions, docstring_parser=loader.docstring_parser,
                        docstring_options=loader.docstring_options,
                        lines_collection=loader.lines_collection,
                        modules_collection=loader.modules_collection)


def attach(parent: griffe.Module, name: str, directory: Path,
           loader: griffe.GriffeLoader) -> None:
    """``directory`` (a package) as the subpackage ``name`` of ``parent``, with its modules."""
    package = visit(name, directory / "__init__.py", parent, loader)
    parent.set_member(name, package)
    for path in sorted(directory.iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            package.set_member(path.stem, visit(path.stem, path, package, loader))
        elif path.is_dir() and (path / "__init__.py").is_file():
            attach(package, path.name, path, loader)
