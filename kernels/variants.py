"""A rule's functions with some of its flags read as constants (``Rule.variants``).

A span that branches on a flag to run different loops (AMSGrad reads and writes one more state
array) holds every loop, and Numba compiles them all, though a configuration runs one: it
inlines each loop's element body into the walk before it can see that a branch is never taken
(its dead-branch pruning only knows constants written in the function itself). Compile time
grows with every inlined copy (Adam's four loops: 2.5 s to compile the step walk, one loop:
0.9 s).

:func:`with_constant_flags` rewrites a function's source so that each ``flags[F.<name>]``
(``F`` being ``positions(rule.flags)``) of the named flags is its value: Python's compiler then
drops the branch not taken, and Numba never sees its loop. The rest of the function is the
same source, so the loop that is kept compiles to the same code.
"""

from __future__ import annotations

import __future__
import ast
import textwrap
import types
from typing import Callable

# the source is compiled under its module's __future__ imports (annotations stay unevaluated)
_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag


class _Fold(ast.NodeTransformer):
    """``x[F.name]`` -> the value of flag ``name``, for the flags in ``values``."""

    def __init__(self, globals_: dict, flag_positions: types.ModuleType,
                 values: dict[str, bool]):
        self.globals, self.flag_positions, self.values = globals_, flag_positions, values
        self.folded = 0

    def visit_Subscript(self, node: ast.Subscript):
        index = node.slice
        if (isinstance(index, ast.Attribute) and isinstance(index.value, ast.Name)
                and index.attr in self.values
                and self.globals.get(index.value.id) is self.flag_positions):
            self.folded += 1
            return ast.copy_location(ast.Constant(bool(self.values[index.attr])), node)
        return self.generic_visit(node)


def with_constant_flags(function: Callable, source: str, flag_positions: types.ModuleType,
                        values: dict[str, bool]) -> Callable:
    """``function``, or, where its ``source`` reads flags of ``values`` through
    ``flag_positions``, a copy compiled from that source with those reads replaced by the
    values (same globals, name, file and line numbers). ``source`` is the text the rule's
    fingerprint was made from (``Rule.sources``), not the file as it may be now."""
    if function.__closure__:
        raise TypeError(f"{function.__qualname__}: a rule function with a closure cannot be "
                        "specialized on its flags")
    fold = _Fold(function.__globals__, flag_positions, values)
    tree = fold.visit(ast.parse(textwrap.dedent(source)))
    if not fold.folded:
        return function
    folded = _compiled(function, tree)
    folded.__qualname__ = function.__qualname__
    return folded


def _compiled(function: Callable, tree: ast.Module) -> Callable:
    """The function ``tree`` (``function``'s rewritten source) defines, compiled as
    ``function`` was: same globals, file, line numbers and ``__future__`` imports. (Calls of
    an imported module's functions may compile to other opcodes than in the module's own
    bytecode, which Numba reads the same.)"""
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    code = compile(ast.fix_missing_locations(tree), function.__code__.co_filename, "exec",
                   flags=function.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    namespace: dict = {}
    exec(code, function.__globals__, namespace)
    return namespace[function.__name__]


class VariantKernels:
    """A rule's kernel per combination of its variant flags' values, made by ``make(values)``
    (``values``: flag name -> value, empty for a rule without variants) the first time a step's
    flags ask for it. Called with a step's flags (a tuple laid out as ``Rule.flags``).

    ``names``: the flags read as constants, ``Rule.variants`` unless given. The reduced-precision
    walks (``kernels/coded.py``) give every flag: their loops are bound by arithmetic, not
    memory, and a flag read in the loop left a branch there that kept it from vectorizing
    at full width (bf16 AdamW 1.3x slower)."""

    def __init__(self, rule, make: Callable[[dict[str, bool]], object],
                 names: tuple[str, ...] | None = None):
        self.rule, self.make = rule, make
        self.names = rule.variants if names is None else tuple(names)
        self.kernels: dict[tuple, object] = {}
        """The kernels made so far, by the variant flags' values."""
        self._by_flags: dict[tuple, object] = {}
        self._positions = [rule.flags._fields.index(name) for name in self.names]

    def __call__(self, flags: tuple):
        kernel = self._by_flags.get(flags)
        if kernel is None:
            variant = tuple(bool(flags[i]) for i in self._positions)
            kernel = self.kernels.get(variant)
            if kernel is None:
                kernel = self.kernels[variant] = self.make(dict(zip(self.names, variant)))
            self._by_flags[flags] = kernel
        return kernel


def suffix(values: dict[str, bool]) -> str:
    """The part of a kernel's name (and Numba cache key) that tells its variant."""
    return "".join(f"_{name}{int(value)}" for name, value in values.items())


def bits(values: dict[str, bool]) -> str:
    """:func:`suffix` for a kernel specialized on every flag of its rule: the values as one bit
    string in the flags' order (a rule's flags are fixed, so the string names the variant, and a
    name stays short whatever the flags are called)."""
    return "_f" + "".join(str(int(value)) for value in values.values()) if values else ""
