"""Compiling a rule's plain Python functions for one backend, and plugging them into a walk.

Each backend compiles the same function objects (the rule body, its span and prepare), so CPU
and CUDA run the same arithmetic in the same order. A function is rebuilt over a namespace in
which the names of the rule's other functions refer to their compiled versions; the backend's
walk templates are instantiated the same way with ``span`` or ``prepare`` bound.
"""

from __future__ import annotations

import types
from typing import Callable

from .layouts import positions
from .rule import Rule
from .variants import with_constant_flags


def _rebuild(function: Callable, namespace: dict, qualname: str) -> Callable:
    clone = types.FunctionType(function.__code__, namespace, function.__name__,
                               function.__defaults__, function.__closure__)
    clone.__qualname__ = qualname
    clone.__module__ = function.__module__
    clone.__doc__ = function.__doc__
    return clone


def bind(rule: Rule, decorate: Callable[[Callable], Callable],
         primitives: dict[str, Callable] | None = None,
         constant_flags: dict[str, bool] | None = None) -> dict[str, Callable]:
    """The rule's functions compiled with ``decorate``, by name, calling each other compiled;
    ``primitives`` replace names the rule imports (``fma``, see ``kernels/arithmetic.py``)
    with the backend's own. Each function reads its own module's other names (a helper
    shared by several rules, ``kernels/rules/caution.py``, lives in a module of its own).
    ``constant_flags``: values of flags in ``Rule.variants``, read as constants
    (``kernels/variants.py``)."""
    functions = rule.functions
    if constant_flags:
        flag_positions = positions(rule.flags)
        functions = tuple(with_constant_flags(f, rule.sources[f.__name__], flag_positions,
                                              constant_flags) for f in functions)
    return bind_functions(f"rule {rule.name!r}", functions, decorate, primitives)


def bind_functions(owner: str, functions, decorate: Callable[[Callable], Callable],
                   primitives: dict[str, Callable] | None = None) -> dict[str, Callable]:
    """:func:`bind` for any plain functions (the storage codec's, ``kernels/coded.py``):
    compiled with ``decorate``, by name, calling each other compiled."""
    compiled: dict[str, Callable] = {}
    namespaces: dict[str, dict] = {}
    for function in functions:
        if function.__name__ in compiled:
            raise TypeError(f"{owner}: two functions are named {function.__name__!r}")
        namespace = namespaces.get(function.__module__)
        if namespace is None:
            namespace = namespaces[function.__module__] = {**function.__globals__,
                                                           **(primitives or {})}
        compiled[function.__name__] = decorate(_rebuild(function, namespace,
                                                        function.__qualname__))
    for namespace in namespaces.values():  # compiled lazily: every call resolves by then
        namespace.update(compiled)
    return compiled


def instantiate(template: Callable, qualname: str, **bound: Callable) -> Callable:
    """A copy of a backend's walk ``template`` with ``bound`` names resolved to compiled rule
    functions. The qualname names the compiled kernel, and with it Numba's cache entry. With
    nothing bound the copy reads its module's own globals (names defined later resolve too)."""
    namespace = {**template.__globals__, **bound} if bound else template.__globals__
    return _rebuild(template, namespace, qualname)
