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
- Per-tensor totals (LAMB's trust ratio, a cautious update's kept fraction):
  ``reduce(param, grad, *state, <values>)`` gives one term per name of ``reduce_values``
  for each element, from the values before this step's update; the terms are added up per
  parameter in float64 (the same totals at any thread count or world size), then
  ``per_tensor(<totals and values by name>)`` turns each parameter's totals into the
  values ``per_tensor_values`` names, computed in float64 and rounded to the buffer's
  dtype, which ``update`` reads by name. The two come together. ``reduce_when`` names a
  switch that turns both passes on (a cautious option: off, a step is one pass, and
  ``update`` must not read per_tensor's values).
- Per-group totals (AdaGrad-Norm's accumulated squared gradient norm, D-Adaptation's and
  Prodigy's estimates): ``reduce`` as above, then ``per_group(<totals and values by
  name>)`` instead of ``per_tensor``, once per group and step with the totals over every
  parameter of the group that has a gradient (over all its buffers, and all ranks under
  ZeRO-1), compiled by Numba (float64, NumPy's error model). It returns the values
  ``per_group_values`` names, which ``update`` reads; those named as ``group_state``
  (name -> initial number: values kept in the group, saved and restored with it) are that
  state's new values.
- Modes: ``to_eval(param, *state, <values>)`` and ``to_train(...)``, each returning the
  parameter and every slot, run over the parameters with state by ``opt.eval()`` and
  ``opt.train()`` (schedule-free's x and y); a group in eval mode refuses a step
  (``ModeError``). They read hyperparameters and derived values; the buffers stay plain.

What is made is an ordinary :class:`flatopt.Optimizer` subclass with a :class:`Schema` and a
:class:`kernels.rule.Rule`, registered under ``name``: the CPU serial and parallel walks, CUDA,
reduced-precision storage, ZeRO-1, checkpoints, state dicts, schedulers, clipping, EMA and
Lookahead all take it as they take a built-in rule. The span and prepare functions the walks
call are generated as source (``flatopt/_rule_source.py``), so that the rule's fingerprint,
and with it Numba's on-disk cache key, covers them and the user's functions.
"""

from __future__ import annotations

import ast
import inspect
import keyword
import math
import numbers
import textwrap
import types
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from . import registry
from .errors import RuleDefinitionError
from .optimizer import Optimizer
from .schema import (STEP_COUNT, Hyperparameter, Invalid, Schema, Slot, flag, non_negative,
                     real, step_count, switch)
from ._rule_class import optimizer_class
from ._rule_source import (GROUP_STEP, TRAIN_MODE, Definition, call_derived, fail,
                           fresh_source, make_rule, mode_rule, user_source)
from ._rule_trial import trial_run

RESERVED = frozenset({"params", "label", "initial_lr", "comm", "device", "stream",
                      "bit_exact", "master_weights", "rounding", "state_dtype", "grad_dtype",
                      "seed", "step", "group_step", "foreach", "fused", "differentiable",
                      "capturable", "betas", "momentum_decay", "train_mode"})
"""Names a hyperparameter or value cannot take: group keys, constructor options, ``step`` (the
per-parameter count ``per_step`` receives), ``group_step``, and ``betas`` (a tuple in torch's
groups, which schedulers cycle as one). Names starting with ``_`` or ``flatopt_`` are the
generated code's."""

NON_NEGATIVE = ("lr", "eps", "weight_decay")
"""Hyperparameters declared by a number that must also be >= 0, as torch checks them in every
optimizer (a ``Hyperparameter`` with a check of its own overrides)."""


def finite(value: Any) -> float:
    """A finite real number: the check of a hyperparameter declared by a number."""
    number = real(value)
    if math.isinf(number):
        raise Invalid(f"must be a finite number, got {value!r}")
    return number


def define_optimizer(name: str, update: Callable, *, hyperparameters: Mapping[str, Any],
                     state: Sequence[str] | Mapping[str, Slot] = (),
                     derived: Callable | None = None, per_step: Callable | None = None,
                     per_step_values: Sequence[str] = (),
                     per_parameter: Mapping[str, Callable[[str, tuple], float]] | None = None,
                     reduce: Callable | None = None, reduce_values: Sequence[str] = (),
                     per_tensor: Callable | None = None,
                     per_tensor_values: Sequence[str] = (), per_group: Callable | None = None,
                     per_group_values: Sequence[str] = (),
                     group_state: Mapping[str, float] | None = None,
                     to_eval: Callable | None = None, to_train: Callable | None = None,
                     from_param: Sequence[str] = (), reduce_when: str | None = None,
                     version: int = 1,
                     int8_state: bool = False, doc: str | None = None,
                     sources: Mapping[str, str] | None = None) -> type[Optimizer]:
    """An optimizer class stepping every element with ``update`` (see the module docstring),
    registered under ``name`` (a built-in name is refused; defining a name again replaces
    the earlier definition, as re-running a notebook cell would).

    ``state``: the slot names, or name -> :class:`flatopt.Slot` (``Slot(nonnegative=True)``
    for a second moment, which 8-bit storage then keeps unsigned). ``int8_state=True`` allows
    ``state_dtype="int8"`` (bitsandbytes' blockwise format: only for moment-like slots).
    ``from_param``: slots that start at the parameter's value at its first step
    (schedule-free's ``z``, Prodigy's ``p0``) instead of zero. ``version``: the schema version saved in checkpoints; a hyperparameter added later says
    ``Hyperparameter(default, check, since=2)`` and older files load with its default.
    ``per_parameter``: name -> ``function(path, shape)``, a number per parameter computed
    when it is added (a mask, a scale by shape) that ``update`` and ``per_step`` may read;
    a function that raises or gives no finite number refuses the parameter (``ParamError``)
    before anything changes. ``sources``: the source of functions made at run time
    (:func:`flatopt.chain`).

    ``reduce``, ``per_tensor``, ``reduce_when``, ``per_group``, ``group_state``: totals over
    a tensor's or a group's elements; ``to_eval``, ``to_train``: ``opt.eval()`` and
    ``opt.train()`` (the module docstring).

    Raises :class:`RuleDefinitionError` for every mistake it can see before an optimizer
    exists: it checks the names and signatures, compiles the functions with Numba and runs
    ``update`` for a few steps on sample values with the default hyperparameters (a body
    that Numba cannot compile, or that gives NaN or an infinity from finite inputs, fails
    here).
    """
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**31:
        raise RuleDefinitionError(f"rule {name!r}: version must be a whole number >= 1, got "
                                  f"{version!r}")
    fresh_source([f for f in (update, derived, per_step, reduce, per_tensor, per_group,
                              to_eval, to_train) if isinstance(f, types.FunctionType)])
    definition = _checked(name, update, hyperparameters, state, derived, per_step,
                          per_step_values, per_parameter, sources or {},
                          (reduce, reduce_values, per_tensor, per_tensor_values, per_group,
                           per_group_values), group_state, (to_eval, to_train))
    definition = definition._replace(from_param=_from_param(name, from_param, definition.slots),
                                     reduce_when=_reduce_when(name, reduce_when, definition))
    slots = _slots(name, state)
    shapes = trial_run(definition)
    rule = make_rule(definition, sources or {}, shapes)
    modes = None if to_eval is None else (
        mode_rule(definition, "to_eval", sources or {}, shapes.to_eval),
        mode_rule(definition, "to_train", sources or {}, shapes.to_train))
    try:
        schema = Schema(name=name, rule=rule, hyperparameters=definition.hyperparameters,
                        columns={"step": STEP_COUNT},
                        slots=slots, version=version, int8_state=int8_state,
                        reduced_precision=modes is None)  # (the mode passes: plain buffers)
    except TypeError as exc:
        raise RuleDefinitionError(f"rule {name!r}: {exc}") from None
    cls = optimizer_class(definition, schema, rule, doc, modes)
    registry.unregister(name)
    registry.register(cls)
    return cls


# ----------------------------------------------------------------------------- checks
def _plain_function(name: str, function: Any, what: str, sources: Mapping[str, str]) -> None:
    if not isinstance(function, types.FunctionType):
        raise fail(name, f"{what} must be a plain Python function (def), got "
                          f"{type(function).__name__} {function!r}")
    if function.__name__ == "<lambda>" or not function.__name__.isidentifier():
        raise fail(name, f"{what} must be defined with def (a lambda has no name to call it "
                          "by)")
    code = function.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or code.co_kwonlyargcount \
            or function.__defaults__ or code.co_posonlyargcount:
        raise fail(name, f"{what} {function.__name__}() takes plain positional parameters "
                          "only (no defaults, *args, **kwargs or keyword-only ones)")
    if function.__closure__:
        raise fail(name, f"{what} {function.__name__}() reads variables of an enclosing "
                          "function; define it at module level")
    user_source(name, function, sources, what)


def _parameters(function: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _hyperparameter(name: str, key: Any, value: Any) -> Hyperparameter:
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
        raise fail(name, f"hyperparameter name {key!r} must be a Python identifier")
    if _reserved(key):
        raise fail(name, f"hyperparameter name {key!r} is reserved (group keys, "
                         "constructor options, 'step', 'betas', names starting with '_' or "
                         "'flatopt_')")
    if isinstance(value, Hyperparameter):
        hyper = value
    elif isinstance(value, (bool, np.bool_)):
        hyper = switch(value)
    elif isinstance(value, numbers.Real):
        check = non_negative if key in NON_NEGATIVE else finite
        hyper = Hyperparameter(float(value), check, (float(value),))
    else:
        raise fail(name, f"hyperparameter {key!r}: the default must be a number, a bool or "
                          f"a flatopt.Hyperparameter, got {type(value).__name__} {value!r}")
    if hyper.state:
        raise fail(name, f"hyperparameter {key!r}: group state (state=True) is for "
                          "built-in rules")
    try:
        default = hyper.check(hyper.default)
    except Invalid as exc:
        raise fail(name, f"hyperparameter {key!r}: its default {exc}") from None
    if not isinstance(default, (bool, float, int)) or isinstance(default, np.generic):
        raise fail(name, f"hyperparameter {key!r}: its check must give a number or a bool, "
                          f"gave {default!r}")
    if isinstance(hyper.since, bool) or not isinstance(hyper.since, int) or hyper.since < 1:
        raise fail(name, f"hyperparameter {key!r}: since must be a schema version >= 1, got "
                         f"{hyper.since!r}")
    examples = hyper.examples or (hyper.default,)
    return Hyperparameter(hyper.default, _user_check(hyper.check, isinstance(default, bool)),
                          examples, hyper.since)


def _reserved(key: str) -> bool:
    return key in RESERVED or key.startswith(("_", "flatopt_"))


def _user_check(check: Callable, switch: bool) -> Callable:
    """A user's check, reporting a ``ValueError`` it raises as the value's problem, and a
    value it gives that is not a number (a bool for a ``switch``) as one too."""
    if check in (flag, finite, real) or getattr(check, "__module__", "") == "flatopt.schema":
        return check

    def checked(value: Any) -> Any:
        try:
            result = check(value)
        except Invalid:
            raise
        except (ValueError, TypeError) as exc:
            raise Invalid(str(exc)) from None
        if switch != isinstance(result, bool) or not isinstance(result, (bool, int, float)) \
                or isinstance(result, np.generic) or result != result:
            raise Invalid(f"is {value!r}, which its check turned into {result!r}, not a "
                          f"{'bool' if switch else 'number'}")
        return result
    checked.__name__ = getattr(check, "__name__", "check")
    return checked


def _slots(name: str, state: Sequence[str] | Mapping[str, Slot]) -> dict[str, Slot]:
    if isinstance(state, str):
        raise fail(name, f"state must be a sequence of names, got the string {state!r}")
    items = state.items() if isinstance(state, Mapping) else [(s, Slot()) for s in state]
    slots: dict[str, Slot] = {}
    for slot, declared in items:
        if not isinstance(slot, str) or not slot.isidentifier() or keyword.iskeyword(slot) \
                or slot == "step" or slot.startswith(("_", "flatopt_")):
            raise fail(name, f"state slot name {slot!r} must be an identifier other than "
                              "'step', not starting with '_'")
        if slot in slots:
            raise fail(name, f"state slot {slot!r} is named twice")
        if not isinstance(declared, Slot) or declared.shape is not None \
                or declared.initial is not None or declared.when is not None:
            raise fail(name, f"state slot {slot!r}: give a flatopt.Slot() (nonnegative= "
                              "only: slots start at zero and are parallel to the parameters)")
        slots[slot] = declared
    return slots


def _checked(name, update, hyperparameters, state, derived, per_step, per_step_values,
             per_parameter, sources, totals, group_state, modes) -> Definition:
    if not isinstance(name, str) or not name or "\x00" in name or name != name.strip():
        raise RuleDefinitionError(f"a rule's name must be a non-empty string without NUL or "
                                  f"surrounding spaces, got {name!r}")
    existing = registry.lookup(name)
    if existing is not None and not getattr(existing, "user_defined", False):
        raise fail(name, f"a built-in optimizer has that name "
                         f"({existing.__module__}.{existing.__qualname__})")
    _plain_function(name, update, "update", sources)
    slots = tuple(_slots(name, state))
    if not isinstance(hyperparameters, Mapping):
        raise fail(name, "hyperparameters must be a mapping of name -> default")
    hypers = {key: _hyperparameter(name, key, value) for key, value in hyperparameters.items()}
    state_names = _group_state(name, group_state, hypers)
    constants = _per_parameter(name, per_parameter, hypers)
    derived_names, derived_reads = _derived(name, derived, hypers, constants, sources)
    per_step_values, per_step_reads = _per_step(name, per_step, per_step_values, hypers,
                                                derived_names, constants, sources)
    before_update = (derived_names, per_step_values, constants)
    found = _totals(name, totals, slots, hypers, state_names, before_update, sources)
    update_reads = _element_reads(name, "update", update, slots, hypers,
                                  (*before_update, found.per_tensor_values,
                                   found.per_group_values))
    mode_reads = _modes(name, modes, slots, hypers, derived_names, sources)
    read = {*update_reads, *per_step_reads, *derived_reads, *found.reduce_reads,
            *found.per_tensor_reads, *found.per_group_reads, *mode_reads[0], *mode_reads[1]}
    unread = [key for key in hypers if key not in read]
    if unread:
        raise fail(name, f"hyperparameter(s) {unread} are read by no function (update, "
                         "per_step, derived, reduce, per_tensor or per_group): a setting "
                         "that changes nothing")
    unused = [key for key in (*derived_names, *per_step_values, *constants,
                              *found.reduce_values, *found.per_tensor_values,
                              *found.per_group_values)
              if key not in read and key not in state_names]
    if unused:
        raise fail(name, f"value(s) {unused} are computed but no function reads them")
    _check_writes(name, update, _parameters(update), slots, sources)
    if GROUP_STEP in read:
        hypers[GROUP_STEP] = Hyperparameter(0, step_count, (0,), state=True)
    if modes[0] is not None:  # which point the parameters hold: y (training) or x
        hypers[TRAIN_MODE] = Hyperparameter(True, flag, (True,), state=True)
    return Definition(name, update, slots, hypers, derived, derived_names, per_step,
                      per_step_values, update_reads, per_step_reads, derived_reads, constants,
                      *found, group_state=state_names, to_eval=modes[0],
                      to_eval_reads=mode_reads[0], to_train=modes[1],
                      to_train_reads=mode_reads[1])


def _reduce_when(name: str, reduce_when: str | None, d: Definition) -> str | None:
    if reduce_when is None:
        return None
    hyper = d.hyperparameters.get(reduce_when) if isinstance(reduce_when, str) else None
    if hyper is None or not hyper.is_flag or d.per_tensor is None:
        raise fail(name, f"reduce_when must name a switch (a bool hyperparameter) of a rule "
                         f"with reduce and per_tensor, got {reduce_when!r}")
    return reduce_when


def _from_param(name: str, from_param: Sequence[str], slots: Sequence[str]) -> tuple:
    if isinstance(from_param, str) or not all(s in slots for s in from_param) \
            or len(set(from_param)) != len(from_param):
        raise fail(name, f"from_param must name state slots {tuple(slots)}, each once; got "
                         f"{from_param!r}")
    return tuple(from_param)


def _modes(name: str, modes: tuple, slots: Sequence[str], hypers: Mapping,
           derived_names: Sequence[str], sources) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names ``to_eval`` and ``to_train`` read (hyperparameters and derived values),
    each function checked."""
    if (modes[0] is None) != (modes[1] is None):
        raise fail(name, "to_eval and to_train go together (opt.eval() moves the parameters, "
                         "opt.train() moves them back)")
    if modes[0] is None:
        return (), ()
    reads = []
    for what, function in zip(("to_eval", "to_train"), modes):
        _plain_function(name, function, what, sources)
        parameters = _parameters(function)
        if len(parameters) < 1 + len(slots):
            raise fail(name, f"{what} {function.__name__}{inspect.signature(function)} must "
                             f"take the parameter and its {len(slots)} state slot(s) "
                             f"{tuple(slots)} first (no gradient)")
        _known(name, what, parameters[1 + len(slots):], hypers, derived_names)
        _check_writes(name, function, (parameters[0], None, *parameters[1:]), slots[:0],
                      sources)
        reads.append(parameters[1 + len(slots):])
    return reads[0], reads[1]


def _element_reads(name: str, what: str, function: Callable, slots: Sequence[str],
                   hypers: Mapping, others: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The names an element function (``update``, ``reduce``) reads after the parameter,
    the gradient and the state slots, checked against the known ones."""
    parameters = _parameters(function)
    fixed = 2 + len(slots)
    if len(parameters) < fixed:
        raise fail(name, f"{what} {function.__name__}{inspect.signature(function)} must take "
                         f"the parameter, the gradient and its {len(slots)} state slot(s) "
                         f"{tuple(slots)} first")
    reads = parameters[fixed:]
    _known(name, what, reads, hypers, *others)
    named = {*hypers, *[v for values in others for v in values]}
    for position, parameter in enumerate(parameters[:fixed]):
        if parameter in named:
            raise fail(name, f"{what}'s parameter {position + 1} ({parameter!r}) is an "
                             "element (parameter, gradient or state), but its name is a "
                             "hyperparameter's or value's")
    return reads


class _Totals(NamedTuple):
    """``reduce`` and what turns its totals into values (``per_tensor`` or ``per_group``),
    with their value names and the names they read (:class:`Definition`'s fields)."""

    reduce: Callable | None = None
    reduce_values: tuple[str, ...] = ()
    reduce_reads: tuple[str, ...] = ()
    per_tensor: Callable | None = None
    per_tensor_values: tuple[str, ...] = ()
    per_tensor_reads: tuple[str, ...] = ()
    per_group: Callable | None = None
    per_group_values: tuple[str, ...] = ()
    per_group_reads: tuple[str, ...] = ()


def _totals(name: str, totals: tuple, slots: Sequence[str], hypers: Mapping,
            state_names: Sequence[str], before: Sequence[Sequence[str]], sources) -> _Totals:
    reduce, reduce_values, per_tensor, per_tensor_values, per_group, per_group_values = totals
    for what, function, values in (("reduce", reduce, reduce_values),
                                   ("per_tensor", per_tensor, per_tensor_values),
                                   ("per_group", per_group, per_group_values)):
        if isinstance(values, str) or (function is None) != (not values):
            raise fail(name, f"{what} and {what}_values go together (the function and a "
                             "sequence of the names of the values it returns)")
    if (reduce is None) != (per_tensor is None and per_group is None) \
            or (per_tensor is not None and per_group is not None):
        raise fail(name, "reduce goes with one of per_tensor and per_group, which turn its "
                         "totals (per tensor, per group) into the values update reads")
    if reduce is None:
        if state_names:
            raise fail(name, "group_state is per_group's to update: give reduce and "
                             "per_group")
        return _Totals()
    reduce_values = tuple(reduce_values)
    _plain_function(name, reduce, "reduce", sources)
    taken = [*hypers, *[v for values in before for v in values]]
    for position, key in enumerate(reduce_values):
        _value_name(name, "reduce", key, [*taken, *reduce_values[:position]])
    reduce_reads = _element_reads(name, "reduce", reduce, slots, hypers, before)
    if per_tensor is not None:
        _plain_function(name, per_tensor, "per_tensor", sources)
        values = tuple(per_tensor_values)
        for position, key in enumerate(values):
            _value_name(name, "per_tensor", key, [*taken, *reduce_values, *values[:position]])
        reads = _parameters(per_tensor)
        _known(name, "per_tensor", reads, hypers, *before, reduce_values)
        return _Totals(reduce, reduce_values, reduce_reads, per_tensor, values, reads)
    if state_names and not set(state_names) <= set(per_group_values):
        raise fail(name, f"group_state {sorted(set(state_names) - set(per_group_values))} "
                         "must be among per_group_values (per_group gives its new values)")
    _plain_function(name, per_group, "per_group", sources)
    values = tuple(per_group_values)
    for position, key in enumerate(values):  # (a group state's name is its new value's)
        if key not in state_names:
            _value_name(name, "per_group", key, [*taken, *reduce_values, *values[:position]])
    reads = _parameters(per_group)
    per_parameter = [key for key in reads if any(key in values for values in before[1:])]
    if per_parameter:
        raise fail(name, f"per_group reads {per_parameter}, values of each parameter: it "
                         "sees the group's totals and values")
    _known(name, "per_group", reads, hypers, before[0], reduce_values)
    return _Totals(reduce, reduce_values, reduce_reads, per_group=per_group,
                   per_group_values=values, per_group_reads=reads)


def _group_state(name: str, group_state: Mapping[str, float] | None,
                 hypers: dict) -> tuple[str, ...]:
    """The group state's names, each added to ``hypers`` as state at its initial value."""
    if group_state is None:
        return ()
    if not isinstance(group_state, Mapping):
        raise fail(name, "group_state must be a mapping of name -> initial number")
    for key, value in group_state.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) \
                or _reserved(key) or key in hypers:
            raise fail(name, f"group_state name {key!r} clashes with a hyperparameter or a "
                             "reserved name, or is not an identifier")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value):
            raise fail(name, f"group_state {key!r}: the initial value must be a finite "
                             f"number, got {value!r}")
        hypers[key] = Hyperparameter(float(value), finite, (float(value),), state=True)
    return tuple(group_state)


def _value_name(name: str, what: str, key: Any, taken: Sequence[str]) -> None:
    """A derived, per_step or per_parameter value's name: an identifier no other name has."""
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) \
            or _reserved(key) or key in taken:
        raise fail(name, f"{what} value {key!r} clashes with another name (a hyperparameter, "
                         "another value, a reserved name) or is not an identifier")


def _per_parameter(name: str, per_parameter: Mapping[str, Callable] | None,
                   hypers: Mapping) -> dict[str, Callable]:
    if per_parameter is None:
        return {}
    if not isinstance(per_parameter, Mapping):
        raise fail(name, "per_parameter must be a mapping of name -> function(path, shape)")
    for key, function in per_parameter.items():
        _value_name(name, "per_parameter", key, list(hypers))
        if not callable(function):
            raise fail(name, f"per_parameter {key!r} must be a function(path, shape)")
    return dict(per_parameter)


def _derived(name: str, derived: Callable | None, hypers: Mapping, constants: Mapping,
             sources) -> tuple:
    """``derived``'s value names (from a call with the defaults) and the names it reads."""
    if derived is None:
        return (), ()
    _plain_function(name, derived, "derived", sources)
    reads = _parameters(derived)
    if GROUP_STEP in reads:
        raise fail(name, "derived cannot read group_step (it is checked before the step "
                         "advances it): read it in per_step or update")
    _known(name, "derived", reads, hypers)
    values = call_derived(name, derived, reads, {k: h.default for k, h in hypers.items()})
    for key in values:
        _value_name(name, "derived", key, [*hypers, *constants])
    return tuple(values), reads


def _per_step(name: str, per_step: Callable | None, values: Sequence[str], hypers: Mapping,
              derived_names: Sequence[str], constants: Mapping, sources) -> tuple:
    """``per_step``'s value names and the names it reads."""
    if isinstance(values, str) or (per_step is None) != (not values):
        raise fail(name, "per_step and per_step_values go together (the function and a "
                         "sequence of the names of the values it returns)")
    if per_step is None:
        return (), ()
    values = tuple(values)
    _plain_function(name, per_step, "per_step", sources)
    parameters = _parameters(per_step)
    if not parameters or parameters[0] != "step":
        raise fail(name, f"per_step {per_step.__name__}() must take 'step' first")
    _known(name, "per_step", parameters[1:], hypers, derived_names, constants)
    for position, key in enumerate(values):
        _value_name(name, "per_step", key,
                    [*hypers, *derived_names, *constants, *values[:position]])
    return values, parameters[1:]


def _known(name: str, what: str, reads: Sequence[str], hypers: Mapping, *others) -> None:
    known = set(hypers).union(*others) | {GROUP_STEP}
    unknown = [key for key in reads if key not in known]
    if unknown:
        raise fail(name, f"{what} reads {unknown}, which are no hyperparameter or value "
                         f"it can read (it can read: {sorted(known)})")
    flags = [key for key in reads if key in hypers and hypers[key].is_flag]
    if what == "derived" and flags:
        raise fail(name, f"derived reads switches {flags}; derived values are numbers, "
                          "read switches in update or per_step")


def _check_writes(name: str, update: Callable, parameters: Sequence[str],
                  slots: Sequence[str], sources: Mapping[str, str]) -> None:
    """Every state slot (and the parameter) gets a new value in ``update``: assigned, or
    returned as an expression other than its own input name. A slot it never writes would
    stay zero and only cost memory."""
    tree = ast.parse(textwrap.dedent(user_source(name, update, sources)))
    written = {node.id for node in ast.walk(tree)
               if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    element_names = [parameters[0], *parameters[2:2 + len(slots)]]
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and node.value is not None:
            results = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            written.update(element for element, result in zip(element_names, results)
                           if not (isinstance(result, ast.Name) and result.id == element))
    never = [n for n in element_names if n not in written]
    if never:
        raise fail(name, f"update {update.__name__}() never assigns {never} (the parameter "
                          "and every state slot must get a new value)")


__all__ = ["define_optimizer", "finite", "RuleDefinitionError"]
