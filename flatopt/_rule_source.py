"""A user rule's kernel functions, generated as source (:func:`flatopt.define_optimizer`'s
machinery; ``flatopt/custom.py`` has the contract, ``flatopt/_rule_trial.py`` the trial run,
``flatopt/_rule_class.py`` the optimizer class).

The span, prepare, reduce and finalize functions the backends' walks call, and the mode
passes' spans, are written as Python source from the rule's :class:`Definition` by
``kernels/elementwise.py``'s generator (the built-in rules' too), compiled with ``exec`` and
their source registered with ``linecache``, so that the rule's fingerprint (and with it
Numba's on-disk cache key) and Numba's error messages read them. Every value is read into a
local once before the element loop, as the built-in spans do.
"""

from __future__ import annotations

import __future__
import ast
import dis
import hashlib
import inspect
import linecache
import math
import numbers
import textwrap
import types
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from numba import njit

from .errors import RuleDefinitionError
from .kernels._bind import bind_functions
from .kernels.elementwise import (CALL_LIMIT, PREPARE_ARGUMENTS, SPAN_ARGUMENTS,
                                  compile_function, element_head, parameter_lines,
                                  reduce_lines, stored, tuples)
from .kernels.layouts import positions
from .kernels.rule import Rule
from .schema import Hyperparameter, identifier_of as identifier

GROUP_STEP = "group_step"
"""A name any function may read: its group's step count, advanced at every step whether or
not a parameter has a gradient (pytorch-optimizer's and timm's ``group["step"]``; AdEMAMix's).
Read, it becomes group state of that name (saved with the hyperparameters)."""

TRAIN_MODE = "train_mode"
"""The group value of a rule with mode passes: True while its parameters hold the training
point (``opt.train()``), False after ``opt.eval()`` (schedule-free's name)."""


class Definition(NamedTuple):
    """A rule's parts after :func:`define_optimizer` checked them (what the generator and the
    optimizer class read)."""

    name: str
    update: Callable
    slots: tuple[str, ...]
    hyperparameters: dict[str, Hyperparameter]
    derived: Callable | None
    derived_names: tuple[str, ...]
    per_step: Callable | None
    per_step_values: tuple[str, ...]
    update_reads: tuple[str, ...]
    per_step_reads: tuple[str, ...]
    derived_reads: tuple[str, ...]
    per_parameter: dict[str, Callable]
    """Constants of each parameter by name: ``function(path, shape) -> number``."""
    reduce: Callable | None = None
    """``reduce(param, grad, *state, <values>)``: per-element terms, added up per parameter
    (float64) into the totals ``reduce_values`` names."""
    reduce_values: tuple[str, ...] = ()
    reduce_reads: tuple[str, ...] = ()
    per_tensor: Callable | None = None
    """``per_tensor(<totals and values>)``: each present parameter's ``per_tensor_values``
    from its totals, after the reduce pass and before the update."""
    per_tensor_values: tuple[str, ...] = ()
    per_tensor_reads: tuple[str, ...] = ()
    per_group: Callable | None = None
    """``per_group(<totals and values>)``: each group's ``per_group_values`` from its totals
    (over every parameter of the group with a gradient), once per group and step; those
    named as ``group_state`` are its new values."""
    per_group_values: tuple[str, ...] = ()
    per_group_reads: tuple[str, ...] = ()
    group_state: tuple[str, ...] = ()
    to_eval: Callable | None = None
    """``to_eval(param, *state, <values>)``: an element's move to the point a model is
    evaluated at (schedule-free's average x), by ``opt.eval()``; ``to_train`` moves it
    back. Their values: hyperparameters and derived values."""
    to_eval_reads: tuple[str, ...] = ()
    to_train: Callable | None = None
    to_train_reads: tuple[str, ...] = ()
    from_param: tuple[str, ...] = ()
    """Slots that start at the parameter's value (schedule-free's z), not at zero."""
    reduce_when: str | None = None
    """The switch that turns the reduce and per_tensor passes on (``Rule.reduce_flag``)."""



def fail(name: str, message: str) -> RuleDefinitionError:
    return RuleDefinitionError(f"rule {name!r}: {message}")



def derived_problem(derived: Callable, reads: Sequence[str], values: Mapping[str, Any],
                    names: Sequence[str] | None = None) -> tuple[dict[str, float], str | None]:
    """``derived``'s values for these hyperparameter ``values``, and why they are unusable
    (it raised, gave no dict of finite numbers, or other names than ``names``), or None."""
    try:
        result = derived(*[values[key] for key in reads])
    except Exception as exc:  # a user's function: report what it raised
        return {}, f"derived {derived.__name__}() raised {type(exc).__name__}: {exc}"
    if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in result):
        return {}, f"derived {derived.__name__}() must return a dict of name -> number, " \
                   f"got {result!r}"
    out = {}
    for key, value in result.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value):
            return {}, f"derived value {key!r} must be a finite number, got {value!r}"
        out[key] = float(value)
    if names is not None and tuple(out) != tuple(names):
        return {}, f"derived {derived.__name__}() gave {tuple(out)}, not {tuple(names)}"
    return out, None


def call_derived(name: str, derived: Callable, reads: Sequence[str],
                 values: Mapping[str, Any]) -> dict[str, float]:
    """:func:`derived_problem`'s values, its problem a :class:`RuleDefinitionError`."""
    out, problem = derived_problem(derived, reads, values)
    if problem:
        raise fail(name, problem)
    return out


KERNEL_MODULES = ("math", "cmath", "numpy")
"""Modules whose functions a rule's code may call through their name (``math.sqrt``)."""


def helpers(name: str, roots: Sequence[Callable]) -> tuple[Callable, ...]:
    """The plain functions ``roots`` call by global name, transitively (Numba compiles each
    alongside); the backends' own primitives (``fma``) are left to the backends. Refused:
    a module other than :data:`KERNEL_MODULES` read through its name (its functions would
    be compiled without their source in the rule's fingerprint), a helper called by another
    name, recursion (the kernels inline every call), and ``raise``/``assert`` (a kernel that
    raises halfway leaves a step half-applied)."""
    found: dict[str, Callable] = {}
    calls: dict[str, set[str]] = {}
    pending = list(roots)
    while pending:
        function = pending.pop()
        calls[function.__name__] = set()
        _check_body(name, function)
        for global_name in function.__code__.co_names:
            value = function.__globals__.get(global_name)
            if isinstance(value, types.ModuleType) and value.__name__ not in KERNEL_MODULES:
                raise fail(name, f"{function.__name__}() reads module {value.__name__!r}: "
                                 f"import the functions it calls by name (from "
                                 f"{value.__name__} import f), so that their source is "
                                 "part of the rule")
            value = getattr(value, "py_func", value)  # a function the user jitted already
            if not isinstance(value, types.FunctionType) or \
                    value.__module__ == "flatopt.kernels.arithmetic":
                continue
            if global_name != value.__name__:
                raise fail(name, f"{function.__name__}() calls {value.__name__}() as "
                                 f"{global_name!r}; call helpers by their own name")
            calls[function.__name__].add(value.__name__)
            if value in roots or value.__name__ in found:
                continue
            found[value.__name__] = value
            pending.append(value)
    cycle = _cycle(calls)
    if cycle:
        raise fail(name, f"{' -> '.join(cycle)}: recursion cannot be compiled into a kernel "
                         "(every call is inlined)")
    return tuple(found.values())


def _cycle(calls: Mapping[str, set[str]]) -> list[str] | None:
    """A call cycle (names, the first repeated last), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for callee in sorted(calls.get(node, ())):
            found = visit(callee, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(calls):
        found = visit(start, [])
        if found:
            return found
    return None


def _check_body(name: str, function: Callable) -> None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return  # generated (a chain's) or unreadable: the trial compile speaks for it
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.Assert)):
            raise fail(name, f"{function.__name__}() raises (line {node.lineno} of its "
                             "source): a kernel cannot stop halfway through a buffer; give "
                             "a value instead (NaN, for the non-finite checks to catch)")


def frozen_globals(functions: Sequence[Callable]) -> str:
    """The values of the global constants ``functions`` read (numbers, strings, tuples,
    arrays), which Numba compiles in as constants: written into the rule's generated source,
    so that a changed value changes the fingerprint (and the kernels' cache key)."""
    seen = {}
    for function in functions:
        for global_name in function.__code__.co_names:
            if global_name not in function.__globals__:
                continue
            value = function.__globals__[global_name]
            if isinstance(value, np.ndarray):
                seen[global_name] = (f"array {value.dtype} {value.shape} "
                                     f"{hashlib.sha256(value.tobytes()).hexdigest()[:16]}")
            elif isinstance(value, (numbers.Number, str, bytes, tuple, type(None))):
                seen[global_name] = repr(value)
    return "".join(f"# global {k} = {v}\n" for k, v in sorted(seen.items()))


VALUES = "flatopt_values"
"""The parameters that replace an update's named values in its bound copy
(``flatopt_values0``, ``flatopt_values1``, ...: one flat tuple each, as
:func:`kernels.elementwise.element_head` packs them)."""


def bound_source(source: str, name: str, fixed: int, reads: Sequence[str],
                 takes_grad: bool = True) -> str:
    """An element function's source (``update``, ``reduce``, ``to_eval``) as
    ``name(<elements>, flatopt_values0, ...)``: its named values read from flat tuples at the
    top of the same body, so that the walk's call has a few arguments however many values
    the rule reads. A function without the gradient (``takes_grad=False``: the mode passes)
    gets an unused ``flatopt_grad`` after the parameter, as the walks pass every element."""
    tree = ast.parse(textwrap.dedent(source))
    function = tree.body[0]
    function.name = name
    function.decorator_list = []
    groups = tuples(len(reads))
    elements = function.args.args[:fixed]
    if not takes_grad:
        elements = [elements[0], ast.arg("flatopt_grad"), *elements[1:]]
    function.args.args = [*elements, *[ast.arg(f"{VALUES}{t}") for t in range(len(groups))]]
    unpack = [ast.parse(f"{reads[n]} = {VALUES}{t}[{n - group.start}]").body[0]
              for t, group in enumerate(groups) for n in group]
    function.body = [*unpack, *function.body]
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _element_head(d: Definition, header: str, reads: Sequence[str], scalars: Sequence[str],
                  columns: Sequence[str], flags: Sequence[str]) -> tuple[list[str], str]:
    """The start of a walk over one parameter's elements (the span, the reduce), as
    :func:`kernels.elementwise.element_head` writes the built-in spans': each value
    ``reads`` names read once, packed into flat tuples."""
    where = {**{v: f"scalars[{j}]" for j, v in enumerate(scalars)},
             **{v: f"columns[{j}][k]" for j, v in enumerate(columns) if j > 0},
             **{v: f"flags[{FLAG_POSITIONS}.{v}]" for v in flags}}
    try:
        return element_head(header, len(d.slots), [(f"_v_{v}", where[v]) for v in reads],
                            pack=True, from_param=[d.slots.index(s) for s in d.from_param
                                                   if columns])
    except TypeError:
        raise fail(d.name, f"{len(d.slots)} state slots are more than a call can take") \
            from None


def span_source(d: Definition, key: str, scalars: Sequence[str],
                columns: Sequence[str], flags: Sequence[str], returns_tuple: bool) -> str:
    """The span: the bound update (:func:`bound_source`) over the elements."""
    lines, arguments = _element_head(d, f"def {key}_span({SPAN_ARGUMENTS}):", d.update_reads,
                                     scalars, columns, flags)
    targets = stored(len(d.slots)) + ("," if returns_tuple else "")
    lines += ["    for i in range(start, stop, stride):",
              f"        {targets} = {key}_update({arguments})", ""]
    return "\n".join(lines)


def reduce_source(d: Definition, key: str, scalars: Sequence[str], columns: Sequence[str],
                  flags: Sequence[str], returns_tuple: bool) -> str:
    """The reduce: the bound ``reduce`` over the elements, its terms added in float64 (the
    backend adds the segments' partial sums in chunk order: the same totals at any thread
    count or world size)."""
    lines, arguments = _element_head(d, f"def {key}_reduce({SPAN_ARGUMENTS}):",
                                     d.reduce_reads, scalars, columns, flags)
    return "\n".join(reduce_lines(lines, f"{key}_reduce_terms", arguments,
                                  len(d.reduce_values), returns_tuple))


def _parameter_values(reads: Sequence[str], known: Mapping[str, str], prepare_scalars,
                      columns, flags) -> list[tuple[str, str]]:
    """The ``(local, expression)`` of each value a per-parameter function reads: a prepare
    scalar or a flag (read once), a column at parameter ``k`` (``known``: more by name)."""
    where = {**{v: f"columns[{j}][k]" for j, v in enumerate(columns) if j > 0},
             **{v: f"scalars[{j}]" for j, v in enumerate(prepare_scalars)},
             **{v: f"flags[{FLAG_POSITIONS}.{v}]" for v in flags}, **known}
    return [(f"_v_{v}", where[v]) for v in reads]  # (a user's names may be k, i, sums...)


def finalize_source(d: Definition, key: str, prepare_scalars: Sequence[str],
                    columns: Sequence[str], flags: Sequence[str], returns_tuple: bool) -> str:
    """The finalize: ``per_tensor`` of each present parameter's totals (``sums[k, j]``),
    stored in its columns for the update to read."""
    if len(d.per_tensor_reads) > CALL_LIMIT:
        raise fail(d.name, f"per_tensor reads {len(d.per_tensor_reads)} values, more than a "
                           f"call can take ({CALL_LIMIT})")
    values = _parameter_values(d.per_tensor_reads,
                               {v: f"sums[k, {j}]" for j, v in enumerate(d.reduce_values)},
                               prepare_scalars, columns, flags)
    return "\n".join(parameter_lines(
        f"def {key}_finalize({PREPARE_ARGUMENTS}, sums):", f"{key}_per_tensor",
        [columns.index(v) for v in d.per_tensor_values], values, returns_tuple))


def prepare_source(d: Definition, key: str, prepare_scalars: Sequence[str],
                   columns: Sequence[str], flags: Sequence[str], returns_tuple: bool) -> str:
    """The prepare: each present parameter's step count, then its ``per_step`` values (which
    may read the parameter's ``per_parameter`` constants: then per parameter, else once per
    distinct step count)."""
    values = _parameter_values(d.per_step_reads, {}, prepare_scalars, columns, flags)
    return "\n".join(parameter_lines(
        f"def {key}_prepare({PREPARE_ARGUMENTS}):",
        f"{key}_per_step" if d.per_step is not None else None,
        [columns.index(v) for v in d.per_step_values], values, returns_tuple, step="_last"))


FLAG_POSITIONS = "_flag_positions"
"""The name the generated walks read a switch through (``flags[_flag_positions.<name>]``):
bound to ``positions`` of the rule's flags, the form ``kernels/variants.py`` folds into a
constant, so a walk is compiled per combination of the switches' values a step uses."""


def _unique(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def layouts(d: Definition):
    """The kernel argument layouts: scalars (the numbers ``update`` and ``reduce`` read, in
    the buffer's dtype), prepare scalars (the numbers ``per_step`` and ``per_tensor`` read,
    float64), flags (every switch); the columns are the step count, then :func:`columns`."""
    flags = tuple(k for k, h in d.hyperparameters.items() if h.is_flag)
    columns = rule_columns(d)
    scalars = tuple(v for v in _unique((*d.update_reads, *d.reduce_reads))
                    if v not in flags and v not in columns)
    prepare = tuple(v for v in _unique((*d.per_step_reads, *d.per_tensor_reads))
                    if v not in flags and v not in columns and v not in d.reduce_values)
    return scalars, prepare, flags


def rule_columns(d: Definition) -> tuple[str, ...]:
    """The per-parameter columns after the step count: per_step's values, per_tensor's, the
    per_parameter constants."""
    return (*d.per_step_values, *d.per_tensor_values, *d.per_parameter)


def _layout(name: str, fields: Sequence[str], kind: type) -> type:
    return NamedTuple(name, [(f, kind) for f in fields])


KEY_LENGTH = 40
"""Characters of a rule's name kept in its kernels' names (Numba names cache files after
them; the fingerprint that follows keeps them apart)."""


def user_source(name: str, function: Callable, sources: Mapping[str, str],
                what: str = "") -> str:
    """The source of a user's function (from ``sources`` for one made at run time), checked to
    be that function's: its file edited after the function was defined would give other
    lines at its line number, and a kernel compiled from the source would run them."""
    if function.__name__ in sources:
        return sources[function.__name__]
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        raise fail(name, f"{what} {function.__name__}() has no source file to read (define "
                         "it in a module or a notebook cell)".strip()) from None
    try:
        tree = ast.parse(textwrap.dedent(text)).body[0]
    except (SyntaxError, IndexError):
        tree = None
    code = function.__code__
    if not isinstance(tree, ast.FunctionDef) or tree.name != function.__name__ or \
            [a.arg for a in tree.args.args] != list(code.co_varnames[:code.co_argcount]) or \
            not _same_code(text, code):
        raise fail(name, f"{function.__name__}()'s file {code.co_filename} changed since it "
                         "was defined (its lines there are not the function's): import its "
                         "module again (importlib.reload) before defining the rule")
    return text


def _same_code(text: str, code: types.CodeType) -> bool:
    """Whether ``text`` compiles to ``code``'s bytecode, names and constants (an edit inside
    the function's body, its signature unchanged, shows here)."""
    flags = code.co_flags & __future__.annotations.compiler_flag
    compiled = compile(textwrap.dedent(text), code.co_filename, "exec", flags=flags,
                       dont_inherit=True)
    made = [c for c in compiled.co_consts
            if isinstance(c, types.CodeType) and c.co_name == code.co_name]
    return bool(made) and _instructions(made[0]) == _instructions(code)


_SAME_OPS = {"LOAD_METHOD": "LOAD_ATTR"}
_NO_OPS = {"PRECALL", "CACHE", "NOP", "RESUME", "EXTENDED_ARG"}


def _instructions(code: types.CodeType) -> list:
    """``code``'s instructions as what they do: a call of a module's function may compile to
    other opcodes from a module's AST (pytest's) than from its text, and jump offsets move
    with them."""
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    return [(_SAME_OPS.get(i.opname, i.opname), None if i.opcode in jumps else i.argval)
            for i in dis.get_instructions(code) if i.opname not in _NO_OPS]


def fresh_source(functions: Sequence[Callable]) -> None:
    """Forget ``linecache``'s copy of the files that define ``functions`` where they changed
    since it was read (a rule defined again after its file was edited)."""
    for function in functions:
        linecache.checkcache(function.__code__.co_filename)


class Shapes(NamedTuple):
    """Whether each of a rule's functions returns a tuple (one value may come bare), as the
    trial run found."""

    update: bool = True
    per_step: bool = True
    reduce: bool = True
    per_tensor: bool = True
    per_group: bool = True
    to_eval: bool = True
    to_train: bool = True


def _renamed(function: Callable, name: str) -> Callable:
    """``function`` under ``name`` (the generated walks call it by a name no generated local
    can shadow), over its own module's globals."""
    renamed = types.FunctionType(function.__code__, function.__globals__, name)
    renamed.__module__ = function.__module__
    return renamed


def make_rule(d: Definition, sources: Mapping[str, str], shapes: Shapes) -> Rule:
    """The kernel rule, its walks generated as source for these ``shapes``."""
    key = f"user_{identifier(d.name)[:KEY_LENGTH]}"
    scalars, prepare, flags = layouts(d)
    flag_layout = _layout(f"{key}_Flags", flags, bool)
    columns = ("step", *rule_columns(d))
    elementwise = [d.update, *filter(None, [d.reduce])]
    scalar_functions = [f for f in (d.per_step, d.per_tensor, d.per_group) if f is not None]
    found = helpers(d.name, [*elementwise, *scalar_functions])
    namespace: dict = {}  # per_step, per_tensor and per_group under their generated names
    generated = dict(sources)
    for role, function in (("per_step", d.per_step), ("per_tensor", d.per_tensor),
                           ("per_group", d.per_group)):
        if function is not None:
            renamed = namespace[f"{key}_{role}"] = _renamed(function, f"{key}_{role}")
            if function.__name__ in sources:
                generated[renamed.__name__] = sources[function.__name__]
    fresh_source([*elementwise, *scalar_functions, *found])

    def source_of(function: Callable) -> str:
        return user_source(d.name, function, sources)

    frozen = frozen_globals([*elementwise, *scalar_functions, *found])
    texts = {f"{key}_span": span_source(d, key, scalars, columns, flags, shapes.update),
             f"{key}_prepare": prepare_source(d, key, prepare, columns, flags,
                                              shapes.per_step),
             f"{key}_update": frozen + bound_source(source_of(d.update), f"{key}_update",
                                                    2 + len(d.slots), d.update_reads)}
    if d.reduce is not None:
        texts[f"{key}_reduce"] = reduce_source(d, key, scalars, columns, flags, shapes.reduce)
        if d.per_tensor is not None:  # (per_group's totals go to the optimizer's combine)
            texts[f"{key}_finalize"] = finalize_source(d, key, prepare, columns, flags,
                                                       shapes.per_tensor)
        texts[f"{key}_reduce_terms"] = bound_source(source_of(d.reduce), f"{key}_reduce_terms",
                                                    2 + len(d.slots), d.reduce_reads)
    user_side = (f"{key}_update", f"{key}_reduce_terms")  # compiled over the user's globals
    made = {name: compile_function(text, name,  # each filed under a module of its own
                                   dict(d.update.__globals__ if name in user_side else namespace,
                                        **{FLAG_POSITIONS: positions(flag_layout)}),
                                   f"flatopt.custom.{name}")
            for name, text in texts.items()}
    clashes = {h.__name__ for h in found} & {*texts, *namespace}
    if clashes:
        raise fail(d.name, f"function name(s) {sorted(clashes)} are the generated walk's "
                           "own; rename them")
    generated.update(texts)
    helper_functions = (made[f"{key}_update"],
                        *filter(None, [made.get(f"{key}_reduce_terms")]),
                        *namespace.values(), *found)
    try:
        return Rule(name=key, span=made[f"{key}_span"], prepare=made[f"{key}_prepare"],
                    helpers=helper_functions, slots=d.slots,
                    columns={"step": "int64", **{v: "param" for v in columns[1:]}},
                    scalars=_layout(f"{key}_Scalars", scalars, float),
                    prepare_scalars=_layout(f"{key}_PrepareScalars", prepare, float),
                    flags=flag_layout, variants=flags,
                    reduce=made.get(f"{key}_reduce"), finalize=made.get(f"{key}_finalize"),
                    reductions=d.reduce_values, global_reductions=d.per_group is not None,
                    reduce_flag=d.reduce_when,
                    generated=generated, origin=d.update.__module__)
    except TypeError as exc:
        raise fail(d.name, str(exc)) from None


def mode_rule(d: Definition, which: str, sources: Mapping[str, str],
              returns_tuple: bool) -> Rule:
    """The tool rule of ``opt.eval()`` (``which`` "to_eval") or ``opt.train()``
    ("to_train"): a span calling the user's function on every element of a parameter with
    state (``Optimizer._map_state``), its scalars and flags the values it reads."""
    function, reads = ((d.to_eval, d.to_eval_reads) if which == "to_eval"
                       else (d.to_train, d.to_train_reads))
    key = f"user_{identifier(d.name)[:KEY_LENGTH]}_{which}"
    flags = tuple(v for v in reads if d.hyperparameters.get(v) is not None
                  and d.hyperparameters[v].is_flag)
    scalars = tuple(v for v in reads if v not in flags)
    found = helpers(d.name, [function])
    lines, arguments = _element_head(d, f"def {key}_span({SPAN_ARGUMENTS}):", reads, scalars,
                                     (), flags)
    targets = stored(len(d.slots)) + ("," if returns_tuple else "")
    lines += ["    for i in range(start, stop, stride):",
              f"        {targets} = {key}_body({arguments})", ""]
    texts = {f"{key}_span": "\n".join(lines),
             f"{key}_prepare": f"def {key}_prepare({PREPARE_ARGUMENTS}):\n    pass\n",
             f"{key}_body": frozen_globals([function, *found]) + bound_source(
                 user_source(d.name, function, sources),
                 f"{key}_body", 1 + len(d.slots), reads, takes_grad=False)}
    flag_layout = _layout(f"{key}_Flags", flags, bool)
    made = {name: compile_function(text, name, dict(function.__globals__ if
                                                    name.endswith("_body") else {},
                                                    **{FLAG_POSITIONS: positions(flag_layout)}),
                                   f"flatopt.custom.{name}")
            for name, text in texts.items()}
    return Rule(name=key, span=made[f"{key}_span"], prepare=made[f"{key}_prepare"],
                helpers=(made[f"{key}_body"], *found), slots=d.slots, columns={},
                scalars=_layout(f"{key}_Scalars", scalars, float),
                flags=flag_layout, generated={**sources, **texts},
                origin=d.update.__module__)


def compiled_per_group(d: Definition) -> Callable:
    """``per_group`` and its helpers compiled by Numba with NumPy's error model (a division
    by zero gives an infinity, never an exception halfway through a step), called from
    Python once per group and step."""
    return bind_functions(f"rule {d.name!r}", (d.per_group, *helpers(d.name, [d.per_group])),
                          njit(error_model="numpy"))[d.per_group.__name__]
