"""Spans written from an element body: the one generator behind the built-in rules' spans and
a user's rule (``flatopt/_rule_source.py``).

A span reads each value its element body takes into a local once, before the loop, then calls
the body on every element of its segment and stores what it returns::

    def nadam_span(arrays, scalars, columns, flags, k, start, stop, stride):
        _p, _g, _s0, _s1, = arrays
        bias_correction2 = columns[2][k]        # a per-parameter column, at parameter k
        lerp_coefficient = scalars[0]           # a scalar in the buffer's dtype
        maximize = flags[_Flags_positions.maximize]     # a switch (kernels/variants.py
                                                        # can fold it into a constant)
        for i in range(start, stop, stride):
            _p[i], _s0[i], _s1[i] = nadam_rule(_p[i], _g[i], _s0[i], _s1[i], ...)

A built-in body names its values as the fields of its rule's layouts (:func:`element_span`
finds each by name); a user's body takes them packed in flat tuples (``pack``), since CPython
calls a function of more than :data:`CALL_LIMIT` arguments with ``*args``, which Numba cannot
inline. The source is compiled with ``exec`` and registered with ``linecache``;
:func:`source` gives it to the rule's fingerprint (and so to the kernels' cache keys).
"""

from __future__ import annotations

import inspect
import linecache
import sys
from typing import Callable, NamedTuple, Sequence

from .layouts import positions

CALL_LIMIT = 30
"""CPython's STACK_USE_GUIDELINE: a call with more arguments is compiled as ``f(*args)``."""

TUPLE_SIZE = 25
"""Values per flat tuple of a packed call."""

SPAN_ARGUMENTS = "arrays, scalars, columns, flags, k, start, stop, stride"
"""A span's parameters (``kernels/rule.py`` has the contract)."""

_GENERATED: dict[tuple[str, str], str] = {}
"""The source of each function this module made, by (module, qualname)."""


def tuples(count: int) -> list[range]:
    """The positions of ``count`` packed values, a range per flat tuple."""
    return [range(n, min(n + TUPLE_SIZE, count)) for n in range(0, count, TUPLE_SIZE)]


def element_head(header: str, slots: int, values: Sequence[tuple[str, str]],
                 pack: bool, from_param: Sequence[int] = ()) -> tuple[list[str], str]:
    """The start of a walk over one parameter's elements: ``header``, the arrays unpacked,
    each ``(local, expression)`` of ``values`` read once (a local named twice is read once);
    and the element call's arguments (each element ``[i]``, then the locals, or with ``pack``
    the flat tuples holding them). The slots ``from_param`` (positions) are read as the
    parameter's element at the parameter's first step (its step count, column 0, is 1): state
    that starts at the parameter's value. Raises ``TypeError`` for a call of more than
    :data:`CALL_LIMIT` arguments."""
    arrays = ["_p", "_g", *[f"_s{j}" for j in range(slots)]]
    lines = [header, *[f"    {a} = arrays[{j}]" for j, a in enumerate(arrays)]]
    if from_param:
        lines.append("    _first = columns[0][k] == 1")
    read: dict[str, str] = {}
    for local, expression in values:
        if local not in read:
            read[local] = expression
            lines.append(f"    {local} = {expression}")
    names = [local for local, _ in values]
    if pack:
        groups = tuples(len(names))
        for t, group in enumerate(groups):
            lines.append(f"    _t{t} = ({''.join(f'{names[n]}, ' for n in group)})")
        names = [f"_t{t}" for t in range(len(groups))]
    elements = [f"{a}[i]" for a in arrays]
    for j in from_param:
        elements[2 + j] = f"(_p[i] if _first else _s{j}[i])"
    arguments = [*elements, *names]
    if len(arguments) > CALL_LIMIT:
        raise TypeError(f"the element call takes {len(arguments)} arguments, more than "
                        f"{CALL_LIMIT}")
    return lines, ", ".join(arguments)


def stored(slots: int) -> str:
    """The element targets a body's results are stored in: the parameter, then each slot."""
    return ", ".join(f"{a}[i]" for a in ["_p", *[f"_s{j}" for j in range(slots)]])


class Off(NamedTuple):
    """What a body leaves alone while a switch of :func:`element_span`'s ``branches`` is off:
    slots (named as the body's parameters) it does not read, and slots whose result it does
    not store."""

    unread: tuple[str, ...] = ()
    unwritten: tuple[str, ...] = ()


def element_span(name: str, body: Callable, slots: int, scalars: type,
                 columns: type | None = None, flags: type | None = None,
                 branches: dict[str, Off] | None = None) -> Callable:
    """A built-in rule's span ``name`` calling ``body(param, grad, *slots, <values>)`` on
    every element and storing ``(param, *slots)`` it returns. Each value is found by the
    body's parameter name among the fields of the rule's layouts: a scalar, a column (read
    at the span's parameter ``k``) or a flag. Compiled over the body's module, where the
    backends bind the body's compiled version.

    ``branches``: switches (a flag, or a column: on where it is not 0) that choose the loop,
    in nesting order, each with what the body leaves alone while it is off (:class:`Off`).
    The span runs one loop per combination of their values, passing each to the body as a
    constant; an unread slot gets the gradient's element in its place and an unwritten one's
    result is dropped, so its array is not touched at all: a loop over fewer arrays stays
    within LLVM's alias-check limit and vectorizes (AMSGrad's ``max_exp_avg_sq``)."""
    branches = branches or {}
    values = _found(body, 2 + slots, _layouts(body.__globals__, scalars, columns, flags))
    conditions = {local: expression if expression.startswith("flags") else f"{expression} != 0"
                  for local, expression in values if local in branches}
    if set(conditions) != set(branches):
        raise TypeError(f"{name}: branches {sorted(set(branches) - set(conditions))} are not "
                        f"among the values {body.__name__}() reads")
    lines, _ = element_head(f"def {name}({SPAN_ARGUMENTS}):", slots,
                            [v for v in values if v[0] not in branches], pack=False)
    slot_names = tuple(inspect.signature(body).parameters)[2:2 + slots]
    strays = sorted({s for off in branches.values() for s in (*off.unread, *off.unwritten)}
                    - set(slot_names))
    if strays:  # a misspelt slot would leave its array touched without a word
        raise TypeError(f"{name}: branches name {strays}, not slots of {body.__name__}() "
                        f"{list(slot_names)}")

    def loops(switches: list[str], setting: dict[str, bool], indent: str) -> list[str]:
        if switches:
            switch, rest = switches[0], switches[1:]
            return [f"{indent}if {conditions[switch]}:",
                    *loops(rest, {**setting, switch: True}, indent + "    "),
                    f"{indent}else:", *loops(rest, {**setting, switch: False}, indent + "    ")]
        off = [branches[switch] for switch, on in setting.items() if not on]
        unread = {s for o in off for s in o.unread}
        unwritten = {s for o in off for s in o.unwritten}
        elements = ["_p[i]", "_g[i]", *["_g[i]" if slot in unread else f"_s{j}[i]"
                                        for j, slot in enumerate(slot_names)]]
        arguments = [*elements, *[str(setting[local]) if local in setting else local
                                  for local, _ in values]]
        targets = ["_p[i]", *["_" if slot in unwritten else f"_s{j}[i]"
                              for j, slot in enumerate(slot_names)]]
        return [f"{indent}for i in range(start, stop, stride):",
                f"{indent}    {', '.join(targets)} = {body.__name__}({', '.join(arguments)})"]

    lines += [*loops(list(branches), {}, "    "), ""]
    span = compile_function("\n".join(lines), name, body.__globals__, body.__module__)
    span.branches, span.slot_names = dict(branches), slot_names  # (what the tests check)
    return span


def reduce_lines(lines: list[str], function: str, arguments: str, count: int,
                 returns_tuple: bool, counts: bool = False) -> list[str]:
    """A reduce's loop after its head (:func:`element_head`): ``function``'s ``count`` terms
    of each element added up and returned as float64 totals. ``counts``: the terms are
    conditions or whole numbers, added as integers (an if-less sum that vectorizes; a float
    add of a condition stays a branch per element) and exact in any order."""
    terms = [f"_r{j}" for j in range(count)]
    lines = [*lines, *[f"    _a{j} = {'0' if counts else '0.0'}" for j in range(count)],
             "    for i in range(start, stop, stride):",
             f"        {', '.join(terms)}{',' if returns_tuple else ''} = "
             f"{function}({arguments})",
             *[f"        _a{j} += {f'_r{j}' if counts else f'float(_r{j})'}"
               for j in range(count)],
             f"    return ({''.join(f'float(_a{j}), ' for j in range(count))})", ""]
    return lines


def element_reduce(name: str, body: Callable, slots: int, count: int, scalars: type,
                   columns: type | None = None, flags: type | None = None,
                   counts: bool = False) -> Callable:
    """A built-in rule's reduce ``name``: ``body(param, grad, *slots, <values>)``'s
    ``count`` terms added up over the segment (:func:`reduce_lines`), its values found as
    :func:`element_span` finds them."""
    values = _found(body, 2 + slots, _layouts(body.__globals__, scalars, columns, flags))
    lines, arguments = element_head(f"def {name}({SPAN_ARGUMENTS}):", slots, values,
                                    pack=False)
    return compile_function("\n".join(reduce_lines(lines, body.__name__, arguments, count,
                                                   True, counts)),
                            name, body.__globals__, body.__module__)


PREPARE_ARGUMENTS = "present, columns, scalars, flags, start, stop, stride"
"""A prepare's parameters (``kernels/rule.py`` has the contract)."""


def parameter_lines(header: str, function: str | None, outputs: Sequence[int],
                    values: Sequence[tuple[str, str]], returns_tuple: bool,
                    step: str | None = None) -> list[str]:
    """The source of a walk over the present parameters (a prepare, a finalize):
    ``function(<step>, <values>)``'s results stored in the columns ``outputs`` at each
    present parameter ``k``. With ``step`` (a prepare), each step count (column 0) is
    advanced first and ``step`` is the expression of the count ``function`` gets
    (``_last``, or ``float(_last)``). A value whose expression reads parameter ``k``
    (``columns[j][k]``, ``sums[k, j]``) is read per parameter; without one, the results are
    computed once per distinct step count in a run (parameters usually share it: the same
    values, computed once)."""
    lines = [header]
    if step is not None:
        lines.append("    _steps = columns[0]")
    lines += [f"    _o{j} = columns[{column}]" for j, column in enumerate(outputs)]
    per_parameter = step is None or any("[k" in expression for _, expression in values)
    lines += [f"    {local} = {expression}" for local, expression in dict(values).items()
              if "[k" not in expression]
    lines += ["    _last = -1",
              "    for k in range(start, stop, stride):",
              "        if present[k] != 0:"]
    if step is not None:
        lines.append("            _steps[k] += 1")
    if function is None:
        return lines + [""]
    results = [f"_r{j}" for j in range(len(outputs))]
    arguments = ", ".join([*([step] if step is not None else []),
                           *[expression if "[k" in expression else local
                             for local, expression in values]])
    call = f"{', '.join(results)}{',' if returns_tuple else ''} = {function}({arguments})"
    if per_parameter:
        lines += ["            _last = _steps[k]"] if step is not None else []
        lines.append(f"            {call}")
    else:
        lines += ["            if _steps[k] != _last:",
                  "                _last = _steps[k]", f"                {call}"]
    lines += [f"            _o{j}[k] = _r{j}" for j in range(len(outputs))]
    return lines + [""]


def element_prepare(name: str, per_step: Callable | None, outputs: Sequence[str],
                    prepare_scalars: type | None, columns: type,
                    flags: type | None = None) -> Callable:
    """A built-in rule's prepare ``name``: each present parameter's ``step`` column advanced;
    with ``per_step(t, <values>)``, its results (a tuple, in float64 as torch forms such
    scalars in Python, ``t`` the step count as a float) stored, in the buffer's dtype, in the
    columns ``outputs`` names. Its values are found by name among the prepare scalars, the
    flags and the columns: a column is read at each parameter (then the results are computed
    per parameter), and may be among ``outputs`` too (NAdam's ``mu_product``)."""
    if columns._fields[0] != "step":
        raise TypeError(f"{name}: the step count must be the first column")
    values = _found(per_step, 1, _layouts(per_step.__globals__, prepare_scalars, columns,
                                          flags)) if per_step else []
    lines = parameter_lines(f"def {name}({PREPARE_ARGUMENTS}):",
                            per_step.__name__ if per_step else None,
                            [columns._fields.index(o) for o in outputs], values, True,
                            step="float(_last)")
    module = per_step.__module__ if per_step else columns.__module__
    namespace = per_step.__globals__ if per_step else vars(sys.modules[module])
    return compile_function("\n".join(lines), name, namespace, module)


def _layouts(namespace: dict, scalars: type | None, columns: type | None,
             flags: type | None):
    """Where :func:`_found` looks for a generated function's values: ``(layout, array, at
    parameter k, flag positions)``. Flags are read by name through their positions bound in
    ``namespace`` (``flags[_Flags_positions.maximize]``), the form ``kernels/variants.py``
    turns into a constant."""
    held = None
    if flags is not None:
        held = f"_{flags.__name__}_positions"
        if namespace.setdefault(held, positions(flags)) is not positions(flags):
            raise TypeError(f"{held} names another layout's positions in "
                            f"{namespace.get('__name__')}")
    return ((scalars, "scalars", False, None), (columns, "columns", True, None),
            (flags, "flags", False, held))


def _found(function: Callable, fixed: int, layouts) -> list[tuple[str, str]]:
    """``(name, expression)`` of each parameter of ``function`` after the first ``fixed``:
    where the one of ``layouts`` (:func:`_layouts`) with a field of that name holds it
    (``scalars[2]``, ``columns[1][k]``, ``flags[_Flags_positions.maximize]``)."""
    values = []
    for value in tuple(inspect.signature(function).parameters)[fixed:]:
        found = [f"{kind}[{f'{held}.{value}' if held else layout._fields.index(value)}]"
                 f"{'[k]' if at_k else ''}"
                 for layout, kind, at_k, held in layouts
                 if layout is not None and value in layout._fields]
        if len(found) != 1:
            raise TypeError(f"{function.__name__}(): its parameter {value!r} is in "
                            f"{'no' if not found else 'more than one'} of the rule's layouts "
                            f"({', '.join(kind for _, kind, _, _ in layouts)})")
        values.append((value, found[0]))
    return values


def register_source(filename: str, source: str) -> None:
    """Make ``source`` readable by ``inspect.getsource`` (and Numba's error messages) under
    ``filename``: ``linecache`` keeps entries whose modification time is None."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def compile_function(text: str, name: str, namespace: dict, module: str) -> Callable:
    """The function ``text`` defines, compiled over ``namespace`` (a copy is taken when it is
    not a module's own globals), filed under ``module``; its source registered."""
    filename = f"<flatopt generated {module}.{name}>"
    register_source(filename, text)
    exec(compile(text, filename, "exec"), namespace)
    function = namespace[name]
    function.__module__ = module
    _GENERATED[(module, function.__qualname__)] = text
    return function


def source(function: Callable) -> str:
    """A function's source: what this module generated for it, else its file's."""
    made = _GENERATED.get((function.__module__, function.__qualname__))
    return made if made is not None else inspect.getsource(function)
