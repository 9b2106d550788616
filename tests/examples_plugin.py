"""The rules of ``examples/`` (AdaBelief, Adan, Lamb, AdaGradNorm, SFSGD, BlocksAdamW: written
with the public API only). In the test
process :func:`registered` registers them for one test and removes them after, so the generic
tests' list of registered optimizers stays flatopt's own; subprocesses import
``examples_register`` (``--plugin examples_register``), which registers them for good."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

from flatopt import registry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODULES = {"AdaBelief": "adabelief", "Adan": "adan", "Lamb": "lamb",
           "AdaGradNorm": "adagrad_norm", "SFSGD": "schedulefree_sgd",
           "BlocksAdamW": "adamw_blocks"}

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def optimizer(name: str) -> type:
    """The example's class, registered (again, after :func:`registered` removed it)."""
    cls = getattr(importlib.import_module(MODULES[name]), name)
    if registry.lookup(name) is not cls:
        registry.register(cls)
    return cls


@contextlib.contextmanager
def registered(*names: str):
    """The examples ``names`` (default: all) registered for the ``with`` block only."""
    names = names or tuple(MODULES)
    try:
        yield [optimizer(name) for name in names]
    finally:
        for name in names:
            registry.unregister(name)
