"""Compiling a rule's plain Python functions for one backend, and plugging them into a walk.

Each backend compiles the same function objects (the rule body, its span and prepare), so CPU
and CUDA run the same arithmetic in the same order. A function is rebuilt over a namespace in
which the names of the rule's other functions refer to their compiled versions; the backend's
walk templates are instantiated the same way with ``span`` or ``prepare`` bound.
"""

from __future__ import annotations

import types
from typing import Callable

from .rule import Rule


def _rebuild(function: Callable, namespace: dict, qualname: str) -> Callable:
    clone = types.FunctionType(function.__code__, namespace, function.__name__,
                               function.__defaults__, function.__closure__)
    clone.__qualname__ = qualname
    clone.__module__ = function.__module__
    clone.__doc__ = function.__doc__
    return clone


def bind(rule: Rule, decorate: Callable[[Callable], Callable],
         primitives: dict[str, Callable] | None = None) -> dict[str, Callable]:
    """The rule's functions compiled with ``decorate``, by name, calling each other compiled;
    ``primitives`` replace names the rule imports (``fma``, see ``kernels/arithmetic.py``)
    with the backend's own."""
    modules = {function.__module__ for function in rule.functions}
    if len(modules) != 1:
        raise TypeError(f"rule {rule.name!r}: span, prepare and helpers must live in one module, "
                        f"found {sorted(modules)}")
    namespace = {**rule.span.__globals__, **(primitives or {})}
    for function in rule.functions:
        namespace[function.__name__] = decorate(_rebuild(function, namespace,
                                                         function.__qualname__))
    return namespace


def instantiate(template: Callable, qualname: str, **bound: Callable) -> Callable:
    """A copy of a backend's walk ``template`` with ``bound`` names resolved to compiled rule
    functions. The qualname names the compiled kernel, and with it Numba's cache entry. With
    nothing bound the copy reads its module's own globals (names defined later resolve too)."""
    namespace = {**template.__globals__, **bound} if bound else template.__globals__
    return _rebuild(template, namespace, qualname)
