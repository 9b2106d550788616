"""Your own fused optimizer: :func:`define_optimizer` turns one element-wise update function
into an optimizer class with everything the built-in rules get.

The contract (``docs/guide/custom-rules.md`` has the whole guide):

- ``update(param, grad, *state, <named values>)`` updates one element and returns the new
  ``param`` and the new value of each state slot, in ``state``'s order (just ``param`` for a
  rule without state). It is plain Python that Numba compiles (``math`` functions, ``if``,
  calls to other plain functions of its module by their global name); it sees numbers, never
  arrays, so it cannot index out of bounds. Its parameters after the state are bound **by
  name** to a hyperparameter, a ``derived`` value or a ``per_step`` value.
- ``hyperparameters``: name -> default (a number, or a bool for a switch) or a
  :class:`flatopt.Hyperparameter` (its check, example values, the schema ``version`` that
  added it). They are group values like torch's: read from ``param_groups`` at every step,
  so schedulers and per-group settings work unchanged.
- ``derived(<hyperparameters by name>) -> {name: number}``: scalars computed in Python
  float64 once per group and step, then rounded once to the buffer's dtype (``1 - beta1``
  this way keeps a float32 kernel in float32, as torch computes its scalars in Python).
- ``per_step(step, <hyperparameters or derived by name>)`` with ``per_step_values``: values
  of each parameter's own step count (bias corrections), computed in float64 once per
  parameter and step, then rounded to the buffer's dtype. ``step`` counts the parameter's
  steps with a gradient (1 at its first), as torch's per-parameter ``state["step"]``.

What is made is an ordinary :class:`flatopt.Optimizer` subclass with a :class:`Schema` and a
:class:`kernels.rule.Rule`, registered under ``name``: the CPU serial and parallel walks, CUDA,
reduced-precision storage, ZeRO-1, checkpoints, state dicts, schedulers, clipping, EMA and
Lookahead all take it as they take a built-in rule. The span and prepare functions the walks
call are generated as source (:func:`_span_source`), so that the rule's fingerprint, and with it
Numba's on-disk cache key, covers them and the user's functions.
"""

from __future__ import annotations

import ast
import inspect
import keyword
import linecache
import math
import numbers
import re
import textwrap
import types
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from numba import njit

from . import registry
from .kernels._bind import bind_functions
from .errors import RuleDefinitionError
from .optimizer import Optimizer
from .schema import (MAX_STEP, Column, Hyperparameter, Invalid, Schema, Slot, flag, real,
                     step_count)
from .kernels.rule import Rule

RESERVED = frozenset({"params", "label", "initial_lr", "comm", "device", "stream",
                      "bit_exact", "master_weights", "rounding", "state_dtype", "grad_dtype",
                      "seed", "step", "group_step", "foreach", "fused", "differentiable",
                      "capturable"})
"""Names a hyperparameter or value cannot take: group keys, constructor options, ``step`` (the
per-parameter count ``per_step`` receives) and ``group_step``."""

GROUP_STEP = "group_step"
"""A name any function may read: its group's step count, advanced at every step whether or
not a parameter has a gradient (pytorch-optimizer's and timm's ``group["step"]``; AdEMAMix's).
Read, it becomes group state of that name (saved with the hyperparameters)."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Numba colours its messages

TRIAL_STEPS = 3
"""Steps of the trial run :func:`define_optimizer` makes with the default hyperparameters."""


def finite(value: Any) -> float:
    """A finite real number: the check of a hyperparameter declared by a number."""
    number = real(value)
    if math.isinf(number):
        raise Invalid(f"must be a finite number, got {value!r}")
    return number


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


def define_optimizer(name: str, update: Callable, *, hyperparameters: Mapping[str, Any],
                     state: Sequence[str] | Mapping[str, Slot] = (),
                     derived: Callable | None = None, per_step: Callable | None = None,
                     per_step_values: Sequence[str] = (), version: int = 1,
                     int8_state: bool = False, doc: str | None = None,
                     sources: Mapping[str, str] | None = None) -> type[Optimizer]:
    """An optimizer class stepping every element with ``update`` (see the module docstring),
    registered under ``name`` (a built-in name is refused; defining a name again replaces
    the earlier definition, as re-running a notebook cell would).

    ``state``: the slot names, or name -> :class:`flatopt.Slot` (``Slot(nonnegative=True)``
    for a second moment, which 8-bit storage then keeps unsigned). ``int8_state=True`` allows
    ``state_dtype="int8"`` (bitsandbytes' blockwise format: only for moment-like slots).
    ``version``: the schema version saved in checkpoints; a hyperparameter added later says
    ``Hyperparameter(default, check, since=2)`` and older files load with its default.
    ``sources``: the source of functions made at run time (:func:`flatopt.chain`).

    Raises :class:`RuleDefinitionError` for every mistake it can see before an optimizer
    exists: it checks the names and signatures, compiles the functions with Numba and runs
    ``update`` for a few steps on sample values with the default hyperparameters (a body
    that Numba cannot compile, or that gives NaN or an infinity from finite inputs, fails
    here).
    """
    definition = _checked(name, update, hyperparameters, state, derived, per_step,
                          per_step_values, sources or {})
    slots = _slots(name, state)
    shapes = _trial(definition)
    rule = _rule(definition, sources or {}, shapes)
    record = NamedTuple(f"{_identifier(name)}ParamState",
                        [("step", int), *[(slot, np.ndarray) for slot in definition.slots]])
    try:
        schema = Schema(name=name, rule=rule, hyperparameters=definition.hyperparameters,
                        columns={"step": Column("int64", MAX_STEP, marker=True)},
                        slots=slots, record=record, version=version, int8_state=int8_state)
    except TypeError as exc:
        raise RuleDefinitionError(f"rule {name!r}: {exc}") from None
    cls = _optimizer_class(definition, schema, rule, doc)
    existing = registry.lookup(name)
    if existing is not None and not getattr(existing, "user_defined", False):
        raise RuleDefinitionError(f"rule {name!r}: a built-in optimizer has that name "
                                  f"({existing.__module__}.{existing.__qualname__})")
    registry.unregister(name)
    registry.register(cls)
    return cls


# ----------------------------------------------------------------------------- checks
def _fail(name: str, message: str) -> RuleDefinitionError:
    return RuleDefinitionError(f"rule {name!r}: {message}")


def _identifier(name: str) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return cleaned if cleaned[:1].isalpha() else f"rule_{cleaned}"


def _plain_function(name: str, function: Any, what: str, sources: Mapping[str, str]) -> None:
    if not isinstance(function, types.FunctionType):
        raise _fail(name, f"{what} must be a plain Python function (def), got "
                          f"{type(function).__name__} {function!r}")
    if function.__name__ == "<lambda>" or not function.__name__.isidentifier():
        raise _fail(name, f"{what} must be defined with def (a lambda has no name to call it "
                          "by)")
    code = function.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or code.co_kwonlyargcount \
            or function.__defaults__ or code.co_posonlyargcount:
        raise _fail(name, f"{what} {function.__name__}() takes plain positional parameters "
                          "only (no defaults, *args, **kwargs or keyword-only ones)")
    if function.__closure__:
        raise _fail(name, f"{what} {function.__name__}() reads variables of an enclosing "
                          "function; define it at module level")
    if function.__name__ not in sources:
        try:
            inspect.getsource(function)
        except (OSError, TypeError):
            raise _fail(name, f"{what} {function.__name__}() has no source file to read "
                              "(define it in a module or a notebook cell)") from None


def _parameters(function: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _hyperparameter(name: str, key: Any, value: Any) -> Hyperparameter:
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
        raise _fail(name, f"hyperparameter name {key!r} must be a Python identifier")
    if key in RESERVED or key.startswith("_"):
        raise _fail(name, f"hyperparameter name {key!r} is reserved (group keys, "
                          "constructor options, 'step', names starting with '_')")
    if isinstance(value, Hyperparameter):
        hyper = value
    elif isinstance(value, (bool, np.bool_)):
        hyper = Hyperparameter(bool(value), flag, (bool(value), not value))
    elif isinstance(value, numbers.Real):
        hyper = Hyperparameter(float(value), finite, (float(value),))
    else:
        raise _fail(name, f"hyperparameter {key!r}: the default must be a number, a bool or "
                          f"a flatopt.Hyperparameter, got {type(value).__name__} {value!r}")
    if hyper.state:
        raise _fail(name, f"hyperparameter {key!r}: group state (state=True) is for "
                          "built-in rules")
    try:
        default = hyper.check(hyper.default)
    except Invalid as exc:
        raise _fail(name, f"hyperparameter {key!r}: its default {exc}") from None
    if not isinstance(default, (bool, float, int)) or isinstance(default, np.generic):
        raise _fail(name, f"hyperparameter {key!r}: its check must give a number or a bool, "
                          f"gave {default!r}")
    examples = hyper.examples or (hyper.default,)
    return Hyperparameter(hyper.default, _user_check(hyper.check), examples, hyper.since)


def _user_check(check: Callable) -> Callable:
    """A user's check, reporting a ``ValueError`` it raises as the value's problem."""
    if check in (flag, finite, real) or getattr(check, "__module__", "") == "flatopt.schema":
        return check

    def checked(value: Any) -> Any:
        try:
            return check(value)
        except Invalid:
            raise
        except (ValueError, TypeError) as exc:
            raise Invalid(str(exc)) from None
    checked.__name__ = getattr(check, "__name__", "check")
    return checked


def _slots(name: str, state: Sequence[str] | Mapping[str, Slot]) -> dict[str, Slot]:
    if isinstance(state, str):
        raise _fail(name, f"state must be a sequence of names, got the string {state!r}")
    items = state.items() if isinstance(state, Mapping) else [(s, Slot()) for s in state]
    slots: dict[str, Slot] = {}
    for slot, declared in items:
        if not isinstance(slot, str) or not slot.isidentifier() or keyword.iskeyword(slot) \
                or slot == "step" or slot.startswith("_"):
            raise _fail(name, f"state slot name {slot!r} must be an identifier other than "
                              "'step', not starting with '_'")
        if slot in slots:
            raise _fail(name, f"state slot {slot!r} is named twice")
        if not isinstance(declared, Slot) or declared.shape is not None \
                or declared.initial is not None or declared.when is not None:
            raise _fail(name, f"state slot {slot!r}: give a flatopt.Slot() (nonnegative= "
                              "only: slots start at zero and are parallel to the parameters)")
        slots[slot] = declared
    return slots


def _checked(name, update, hyperparameters, state, derived, per_step, per_step_values,
             sources) -> Definition:
    if not isinstance(name, str) or not name or "\x00" in name or name != name.strip():
        raise RuleDefinitionError(f"a rule's name must be a non-empty string without NUL or "
                                  f"surrounding spaces, got {name!r}")
    _plain_function(name, update, "update", sources)
    slots = tuple(_slots(name, state))
    if not isinstance(hyperparameters, Mapping):
        raise _fail(name, "hyperparameters must be a mapping of name -> default")
    hypers = {key: _hyperparameter(name, key, value) for key, value in hyperparameters.items()}
    update_parameters = _parameters(update)
    fixed = 2 + len(slots)
    if len(update_parameters) < fixed:
        raise _fail(name, f"update {update.__name__}{inspect.signature(update)} must take "
                          f"the parameter, the gradient and its {len(slots)} state slot(s) "
                          f"{slots} first")
    derived_names: tuple[str, ...] = ()
    derived_reads: tuple[str, ...] = ()
    if derived is not None:
        _plain_function(name, derived, "derived", sources)
        derived_reads = _parameters(derived)
        _known(name, "derived", derived_reads, hypers)
        values = _call_derived(name, derived, derived_reads,
                               {k: h.default for k, h in hypers.items()})
        derived_names = tuple(values)
        for key in derived_names:
            if key in hypers or key in RESERVED or not key.isidentifier() \
                    or keyword.iskeyword(key) or key.startswith("_"):
                raise _fail(name, f"derived value {key!r} clashes with a hyperparameter or "
                                  "a reserved name, or is not an identifier")
    per_step_values = tuple(per_step_values)
    per_step_reads: tuple[str, ...] = ()
    if (per_step is None) != (not per_step_values):
        raise _fail(name, "per_step and per_step_values go together (the function and the "
                          "names of the values it returns)")
    if per_step is not None:
        _plain_function(name, per_step, "per_step", sources)
        parameters = _parameters(per_step)
        if not parameters or parameters[0] != "step":
            raise _fail(name, f"per_step {per_step.__name__}() must take 'step' first")
        per_step_reads = parameters[1:]
        _known(name, "per_step", per_step_reads, hypers, derived_names)
        for key in per_step_values:
            if not isinstance(key, str) or key in hypers or key in derived_names \
                    or key in RESERVED or not key.isidentifier() or key.startswith("_") \
                    or per_step_values.count(key) > 1:
                raise _fail(name, f"per_step value {key!r} clashes with another name or is "
                                  "not an identifier")
    update_reads = update_parameters[fixed:]
    _known(name, "update", update_reads, hypers, derived_names, per_step_values)
    for position, parameter in enumerate(update_parameters[:fixed]):
        if parameter in hypers or parameter in derived_names or parameter in per_step_values:
            raise _fail(name, f"update's parameter {position + 1} ({parameter!r}) is an "
                              "element (parameter, gradient or state), but its name is a "
                              "hyperparameter's or value's")
    read = set(update_reads) | set(per_step_reads) | set(derived_reads)
    unread = [key for key in hypers if key not in read]
    if unread:
        raise _fail(name, f"hyperparameter(s) {unread} are read by no function (update, "
                          "per_step or derived): a setting that changes nothing")
    unused = [key for key in (*derived_names, *per_step_values)
              if key not in update_reads and key not in per_step_reads]
    if unused:
        raise _fail(name, f"value(s) {unused} are computed but update never reads them")
    _check_writes(name, update, update_parameters, slots, sources)
    if GROUP_STEP in read:
        hypers[GROUP_STEP] = Hyperparameter(0, step_count, (0,), state=True)
    return Definition(name, update, slots, hypers, derived, derived_names, per_step,
                      per_step_values, update_reads, per_step_reads, derived_reads)


def _known(name: str, what: str, reads: Sequence[str], hypers: Mapping, *others) -> None:
    known = set(hypers).union(*others) | {GROUP_STEP}
    unknown = [key for key in reads if key not in known]
    if unknown:
        raise _fail(name, f"{what} reads {unknown}, which are no hyperparameter"
                          f"{', derived value' if others else ''}"
                          f"{' or per_step value' if len(others) > 1 else ''} "
                          f"(known: {sorted(known)})")
    flags = [key for key in reads if key in hypers and hypers[key].is_flag]
    if what == "derived" and flags:
        raise _fail(name, f"derived reads switches {flags}; derived values are numbers, "
                          "read switches in update or per_step")


def _call_derived(name: str, derived: Callable, reads: Sequence[str],
                  values: Mapping[str, Any]) -> dict[str, float]:
    try:
        result = derived(*[values[key] for key in reads])
    except Exception as exc:  # a user's function: report what it raised, typed
        raise _fail(name, f"derived {derived.__name__}() raised {type(exc).__name__}: "
                          f"{exc}") from exc
    if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in result):
        raise _fail(name, f"derived {derived.__name__}() must return a dict of name -> "
                          f"number, got {result!r}")
    out = {}
    for key, value in result.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise _fail(name, f"derived value {key!r} must be a number, got {value!r}")
        out[key] = float(value)
    return out


def _check_writes(name: str, update: Callable, parameters: Sequence[str],
                  slots: Sequence[str], sources: Mapping[str, str]) -> None:
    """Every state slot (and the parameter) is assigned somewhere in ``update``: a slot it
    never writes would stay zero and only cost memory."""
    source = sources.get(update.__name__) or inspect.getsource(update)
    tree = ast.parse(textwrap.dedent(source))
    assigned = {node.id for node in ast.walk(tree)
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    element_names = [parameters[0], *parameters[2:2 + len(slots)]]
    never = [n for n in element_names if n not in assigned]
    if never:
        raise _fail(name, f"update {update.__name__}() never assigns {never} (the parameter "
                          "and every state slot must get a new value)")


# ----------------------------------------------------------------------------- generation
def _helpers(name: str, roots: Sequence[Callable]) -> tuple[Callable, ...]:
    """The plain functions ``roots`` call by global name, transitively (Numba compiles each
    alongside); the backends' own primitives (``fma``) are left to the backends."""
    found: dict[str, Callable] = {}
    pending = list(roots)
    while pending:
        function = pending.pop()
        for global_name in function.__code__.co_names:
            value = function.__globals__.get(global_name)
            value = getattr(value, "py_func", value)  # a function the user jitted already
            if not isinstance(value, types.FunctionType) or \
                    value.__module__ == "flatopt.kernels.arithmetic" or \
                    value in roots or value.__name__ in found:
                continue
            if global_name != value.__name__:
                raise _fail(name, f"{function.__name__}() calls {value.__name__}() as "
                                  f"{global_name!r}; call helpers by their own name")
            found[value.__name__] = value
            pending.append(value)
    return tuple(found.values())


def _register_source(filename: str, source: str) -> None:
    """Make ``source`` readable by ``inspect.getsource`` (and Numba's error messages) under
    ``filename``: ``linecache`` keeps entries whose modification time is None."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)


def compile_source(source: str, function_name: str, filename: str,
                   namespace: dict) -> Callable:
    """The function ``source`` defines, its source registered for ``inspect``."""
    _register_source(filename, source)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[function_name]


def _span_source(d: Definition, key: str, scalars: Sequence[str],
                 columns: Sequence[str], flags: Sequence[str], returns_tuple: bool) -> str:
    """The span: the values read into locals once, then ``update`` over the elements."""
    arrays = ["_p", "_g", *[f"_s{j}" for j in range(len(d.slots))]]
    lines = [f"def {key}_span(arrays, scalars, columns, flags, k, start, stop, stride):",
             f"    {', '.join(arrays)}, = arrays"]
    local = {}
    for j, value in enumerate(scalars):
        local[value] = f"_h{j}"
        lines.append(f"    _h{j} = scalars[{j}]")
    for j, value in enumerate(columns):
        if j == 0:
            continue  # the step count: per_step's, not update's
        local[value] = f"_c{j}"
        lines.append(f"    _c{j} = columns[{j}][k]")
    for j, value in enumerate(flags):
        local[value] = f"_f{j}"
        lines.append(f"    _f{j} = flags[{j}]")
    elements = [f"{a}[i]" for a in arrays]
    call = f"{d.update.__name__}({', '.join(elements + [local[v] for v in d.update_reads])})"
    targets = "".join(f"{a}[i], " for a in [arrays[0], *arrays[2:]])
    targets = targets if returns_tuple else targets[:-2]
    lines += ["    for i in range(start, stop, stride):", f"        {targets} = {call}", ""]
    return "\n".join(lines)


def _prepare_source(d: Definition, key: str, prepare_scalars: Sequence[str],
                    flags: Sequence[str], returns_tuple: bool) -> str:
    """The prepare: each present parameter's step count, then its ``per_step`` values."""
    lines = [f"def {key}_prepare(present, columns, scalars, flags, start, stop, stride):",
             "    _steps = columns[0]"]
    local = {}
    for j, value in enumerate(d.per_step_values):
        lines.append(f"    _c{j + 1} = columns[{j + 1}]")
    for j, value in enumerate(prepare_scalars):
        local[value] = f"_h{j}"
        lines.append(f"    _h{j} = scalars[{j}]")
    for j, value in enumerate(flags):
        local[value] = f"_f{j}"
        lines.append(f"    _f{j} = flags[{j}]")
    lines += ["    for k in range(start, stop, stride):",
              "        if present[k] != 0:",
              "            _steps[k] += 1"]
    if d.per_step is not None:
        targets = "".join(f"_c{j + 1}[k], " for j in range(len(d.per_step_values)))
        targets = targets if returns_tuple else targets[:-2]
        arguments = ", ".join(["_steps[k]", *[local[v] for v in d.per_step_reads]])
        lines.append(f"            {targets} = {d.per_step.__name__}({arguments})")
    lines.append("")
    return "\n".join(lines)


def _layouts(d: Definition):
    """The kernel argument layouts: scalars (what ``update`` reads that is a number, in the
    buffer's dtype), prepare scalars (``per_step``'s numbers, float64), flags (every
    switch), columns (the step count, then the per_step values)."""
    flags = tuple(k for k, h in d.hyperparameters.items() if h.is_flag)
    scalars = tuple(v for v in d.update_reads
                    if v not in flags and v not in d.per_step_values)
    prepare = tuple(v for v in d.per_step_reads if v not in flags)
    return scalars, prepare, flags


def _layout(name: str, fields: Sequence[str], kind: type) -> type:
    return NamedTuple(name, [(f, kind) for f in fields])


def _rule(d: Definition, sources: Mapping[str, str], shapes: tuple[bool, bool]) -> Rule:
    """The kernel rule; ``shapes``: whether update and per_step return tuples (a single
    value may come bare), as the trial run found."""
    key = f"user_{_identifier(d.name)}"
    scalars, prepare, flags = _layouts(d)
    columns = ("step", *d.per_step_values)
    namespace: dict = {d.update.__name__: d.update}
    if d.per_step is not None:
        namespace[d.per_step.__name__] = d.per_step
    span_source = _span_source(d, key, scalars, columns, flags, shapes[0])
    prepare_source = _prepare_source(d, key, prepare, flags, shapes[1])
    filename = f"<flatopt rule {d.name!r}>"
    span = compile_source(span_source, f"{key}_span", filename + " span", dict(namespace))
    prepare_function = compile_source(prepare_source, f"{key}_prepare",
                                      filename + " prepare", dict(namespace))
    for function in (span, prepare_function):
        function.__module__ = f"flatopt.custom.{key}"
    roots = [d.update, *filter(None, [d.per_step])]
    helpers = (*roots, *_helpers(d.name, roots))
    clashes = {h.__name__ for h in helpers} & {span.__name__, prepare_function.__name__}
    if clashes:
        raise _fail(d.name, f"function name(s) {sorted(clashes)} are the generated walk's "
                            "own; rename them")
    try:
        return Rule(name=key, span=span, prepare=prepare_function, helpers=helpers,
                    slots=d.slots,
                    columns={"step": "int64", **{v: "param" for v in d.per_step_values}},
                    scalars=_layout(f"{key}_Scalars", scalars, float),
                    prepare_scalars=_layout(f"{key}_PrepareScalars", prepare, float),
                    flags=_layout(f"{key}_Flags", flags, bool),
                    generated={**sources, span.__name__: span_source,
                             prepare_function.__name__: prepare_source})
    except TypeError as exc:
        raise _fail(d.name, str(exc)) from None


# ----------------------------------------------------------------------------- trial run
def _trial(d: Definition) -> tuple[bool, bool]:
    """Compile ``update`` and ``per_step`` with Numba (float64, uncached) and run them for
    :data:`TRIAL_STEPS` steps on sample elements with the default hyperparameters: a typing
    error, a wrong number of results or a non-finite result from finite inputs fails here,
    naming the function, before any optimizer exists. Returns whether update and per_step
    return tuples."""
    functions = [d.update, *filter(None, [d.per_step])]
    try:
        compiled = bind_functions(f"rule {d.name!r}", (*functions, *_helpers(d.name, functions)),
                                  njit(error_model="numpy"))
    except TypeError as exc:
        raise _fail(d.name, str(exc)) from None
    defaults = {k: h.default for k, h in d.hyperparameters.items()}
    values = dict(defaults)
    if d.derived is not None:
        values.update(_call_derived(d.name, d.derived, d.derived_reads, defaults))
    rng = np.random.default_rng(0)
    params = np.concatenate([rng.standard_normal(6), [0.0, 1.0]])
    grads = np.concatenate([rng.standard_normal(6), [0.0, 0.0]])
    state = np.zeros((len(d.slots), params.size))
    shapes = [True, True]
    for step in range(1, TRIAL_STEPS + 1):
        values[GROUP_STEP] = step
        if d.per_step is not None:
            result = _run(d, compiled, d.per_step, [np.int64(step)] +
                          [values[v] for v in d.per_step_reads])
            shapes[1] = isinstance(result, tuple)
            result = result if shapes[1] else (result,)
            if len(result) != len(d.per_step_values):
                raise _fail(d.name, f"per_step {d.per_step.__name__}() returned "
                                    f"{len(result)} value(s), per_step_values names "
                                    f"{len(d.per_step_values)}")
            values.update(zip(d.per_step_values, map(float, result)))
            bad = [v for v in d.per_step_values if not math.isfinite(values[v])]
            if bad:
                raise _fail(d.name, f"per_step gives non-finite {bad} at step {step} with "
                                    f"the default hyperparameters")
        for i in range(params.size):
            before = (params[i], grads[i], *state[:, i])
            result = _run(d, compiled, d.update,
                          [*before, *[values[v] for v in d.update_reads]])
            shapes[0] = isinstance(result, tuple)
            result = result if shapes[0] else (result,)
            if len(result) != 1 + len(d.slots):
                raise _fail(d.name, f"update {d.update.__name__}() returned {len(result)} "
                                    f"value(s); it must return the parameter and its "
                                    f"{len(d.slots)} state slot(s) {d.slots}")
            if not all(isinstance(r, (float, int, np.floating)) for r in result):
                raise _fail(d.name, f"update {d.update.__name__}() must return numbers, "
                                    f"got {result!r}")
            if not all(math.isfinite(r) for r in result):
                names = ("param", *d.slots)
                raise _fail(d.name, f"update {d.update.__name__}() gives a non-finite "
                                    f"{dict(zip(names, result))} from finite inputs "
                                    f"{dict(zip(('param', 'grad', *d.slots), before))} at "
                                    f"step {step} with the default hyperparameters")
            params[i], state[:, i] = result[0], result[1:]
    return shapes[0], shapes[1]


def _run(d: Definition, compiled: Mapping[str, Callable], function: Callable,
         arguments: list) -> Any:
    try:
        return compiled[function.__name__](*arguments)
    except Exception as exc:  # Numba's typing errors and whatever the body raises
        first = _ANSI.sub("", str(exc)).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:6])
        raise _fail(d.name, f"{function.__name__}() does not compile or run with Numba: "
                            f"{type(exc).__name__}: {detail}") from None


# ----------------------------------------------------------------------------- the class
def _optimizer_class(d: Definition, schema: Schema, rule: Rule,
                     doc: str | None) -> type[Optimizer]:
    scalars, prepare, flags = _layouts(d)

    def values(settings: Mapping[str, Any]) -> dict[str, Any]:
        if d.derived is None:
            return settings
        derived = _call_derived(d.name, d.derived, d.derived_reads, settings)
        return {**settings, **derived}

    def kernel_scalars(self, settings, dtype):
        known = values(settings)
        return rule.scalars(*[known[v] for v in scalars])

    def prepare_scalars(self, settings):
        known = values(settings)
        return rule.prepare_scalars(*[known[v] for v in prepare])

    def kernel_flags(self, settings):
        return rule.flags(*[settings[v] for v in flags])

    def before_step(self, settings):
        if GROUP_STEP not in d.hyperparameters:
            return None
        return [{GROUP_STEP: s[GROUP_STEP] + 1} for s in settings]

    parameters = [inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=h.default)
        for k, h in d.hyperparameters.items() if not h.state]
    namespace = {
        "schema": schema, "user_defined": True, "kernel_scalars": kernel_scalars,
        "prepare_scalars": prepare_scalars, "kernel_flags": kernel_flags,
        "before_step": before_step,
        "__doc__": doc or (f"{d.name}: a user-defined rule stepping every element with "
                           f"{d.update.__name__}()."),
        "__module__": d.update.__module__,
    }
    def __init__(self, params, **hyperparameters):
        Optimizer.__init__(self, params, **hyperparameters)
    __init__.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    namespace["__init__"] = __init__
    return type(_identifier(d.name), (Optimizer,), namespace)


__all__ = ["define_optimizer", "finite", "RuleDefinitionError"]
