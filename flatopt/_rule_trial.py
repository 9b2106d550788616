"""A user rule's trial run (:func:`flatopt.define_optimizer`): its functions compiled by Numba
and run for a few steps on sample elements with the default hyperparameters, so that a body
Numba cannot compile, a wrong number of results, a non-finite result from finite inputs or a
float32 body computing in float64 is a :class:`RuleDefinitionError` before any optimizer
exists."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from numba import njit
from numba.core import types as numba_types

from .kernels._bind import bind_functions
from ._rule_source import (GROUP_STEP, Definition, Shapes, call_derived, fail, helpers)

TRIAL_STEPS = 3
"""Steps of the trial run :func:`define_optimizer` makes with the default hyperparameters."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Numba colours its messages


def trial_run(d: Definition) -> Shapes:
    """Compile the rule's functions with Numba (float64, uncached) and run them for
    :data:`TRIAL_STEPS` steps on sample elements with the default hyperparameters, in the
    order of a step (per_step, reduce over the elements, per_tensor or per_group, update;
    per_group's group state carried to the next step), then to_eval and to_train: a typing
    error, a wrong number of
    results or a non-finite result from finite inputs fails here, naming the function,
    before any optimizer exists. Returns which of them return tuples."""
    functions = list(dict.fromkeys(  # (to_eval and to_train may be one function)
        f for f in (d.update, d.per_step, d.reduce, d.per_tensor, d.per_group, d.to_eval,
                    d.to_train) if f is not None))
    try:
        compiled = bind_functions(f"rule {d.name!r}", (*functions, *helpers(d.name, functions)),
                                  njit(error_model="numpy"))
    except TypeError as exc:
        raise fail(d.name, str(exc)) from None
    values = _trial_values(d)
    rng = np.random.default_rng(0)
    params = np.concatenate([rng.standard_normal(6), [0.0, 1.0]])
    grads = np.concatenate([rng.standard_normal(6), [0.0, 0.0]])
    state = np.zeros((len(d.slots), params.size))
    shapes: dict[str, bool] = {}
    elements = ("param", "grad", *d.slots)

    def results(role: str, function: Callable, reads: Sequence[str], names: Sequence[str],
                inputs: dict, before: tuple = ()) -> tuple:
        """``function``'s results for ``before`` and the values ``reads`` names, checked."""
        result = _run(d, compiled, function, [*before, *[values[v] for v in reads]])
        shapes[role] = isinstance(result, tuple)
        return _checked_results(d, role, function, result if shapes[role] else (result,),
                                names, f"{inputs} at step {values[GROUP_STEP]}")

    state[[d.slots.index(s) for s in d.from_param]] = params  # (their first step's values)
    for step in range(1, TRIAL_STEPS + 1):
        values[GROUP_STEP] = values["step"] = step
        if d.per_step is not None:
            values.update(zip(d.per_step_values, results(
                "per_step", d.per_step, ("step", *d.per_step_reads), d.per_step_values, {})))
        if d.reduce is not None:
            totals = np.zeros(len(d.reduce_values))
            for i in range(params.size):
                before = (params[i], grads[i], *state[:, i])
                totals += results("reduce", d.reduce, d.reduce_reads, d.reduce_values,
                                  dict(zip(elements, before)), before)
            values.update(zip(d.reduce_values, totals))
            role, function, names, reads = (
                ("per_tensor", d.per_tensor, d.per_tensor_values, d.per_tensor_reads)
                if d.per_tensor is not None else
                ("per_group", d.per_group, d.per_group_values, d.per_group_reads))
            values.update(zip(names, map(float, results(
                role, function, reads, names, dict(zip(d.reduce_values, totals))))))
        for i in range(params.size):
            before = (params[i], grads[i], *state[:, i])
            result = results("update", d.update, d.update_reads, ("param", *d.slots),
                             dict(zip(elements, before)), before)
            params[i], state[:, i] = result[0], result[1:]
    for role, function, reads in (("to_eval", d.to_eval, d.to_eval_reads),
                                  ("to_train", d.to_train, d.to_train_reads)):
        for i in range(params.size) if function is not None else ():
            before = (params[i], *state[:, i])
            result = results(role, function, reads, ("param", *d.slots),
                             dict(zip(("param", *d.slots), before)), before)
            params[i], state[:, i] = result[0], result[1:]
    _stays_float32(d, compiled, values)
    return Shapes(**shapes)


def _trial_values(d: Definition) -> dict[str, Any]:
    """The values of the trial run: the defaults, derived's, the per-parameter values of a
    parameter 'trial.weight' of shape (8,)."""
    values: dict[str, Any] = {k: h.default for k, h in d.hyperparameters.items()}
    if d.derived is not None:
        values.update(call_derived(d.name, d.derived, d.derived_reads, dict(values)))
    for key, function in d.per_parameter.items():
        try:
            values[key] = float(function("trial.weight", (8,)))
        except Exception as exc:  # a user's function: report it, typed
            raise fail(d.name, f"per_parameter {key!r} raised {type(exc).__name__} for path "
                               f"'trial.weight', shape (8,): {exc}") from None
    return values


def _checked_results(d: Definition, role: str, function: Callable, result: tuple,
                     names: Sequence[str], inputs: str) -> tuple:
    """``result`` of ``function``: as many numbers as ``names``, all finite."""
    if len(result) != len(names):
        raise fail(d.name, f"{role} {function.__name__}() returned {len(result)} value(s), "
                           f"not the {len(names)} of {tuple(names)}")
    if not all(isinstance(r, (float, int, np.floating, np.integer)) for r in result):
        raise fail(d.name, f"{role} {function.__name__}() must return numbers, got "
                           f"{result!r}")
    if not all(math.isfinite(r) for r in result):
        raise fail(d.name, f"{role} {function.__name__}() gives a non-finite "
                           f"{dict(zip(names, result))} from finite inputs {inputs} with the "
                           "default hyperparameters")
    return result


def _stays_float32(d: Definition, compiled: Mapping[str, Callable], values: Mapping) -> None:
    """``update`` compiled for float32 elements and values (as a float32 buffer's kernels
    call it) must give float32 results: a float64 one means its arithmetic was promoted (a
    Python literal, an integer), which the float32 walks would pay for and the 16-bit
    storage modes' views refuse to store."""
    flags = {k for k, h in d.hyperparameters.items() if h.is_flag}
    with np.errstate(over="ignore"):  # a value float32 cannot hold: check_step refuses it
        arguments = [np.float32(0.5)] * (2 + len(d.slots)) + [
            bool(values[v]) if v in flags else np.float32(values[v]) for v in d.update_reads]
    dispatcher = compiled[d.update.__name__]
    _run(d, compiled, d.update, arguments)
    result = dispatcher.overloads[dispatcher.signatures[-1]].signature.return_type
    members = list(result) if isinstance(result, numba_types.BaseTuple) else [result]
    names = ("param", *d.slots)
    wide = [n for n, t in zip(names, members) if t != numba_types.float32]
    if wide:
        raise fail(d.name, f"update {d.update.__name__}() gives {wide} as "
                           f"{[str(t) for n, t in zip(names, members) if n in wide]} from "
                           "float32 inputs: a Python literal or an integer in its "
                           "arithmetic promotes float32 to float64; give constants as "
                           "derived values (rounded to the buffer's dtype)")


def _run(d: Definition, compiled: Mapping[str, Callable], function: Callable,
         arguments: list) -> Any:
    try:
        return compiled[function.__name__](*arguments)
    except Exception as exc:  # Numba's typing errors and whatever the body raises
        first = _ANSI.sub("", str(exc)).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:6])
        raise fail(d.name, f"{function.__name__}() does not compile or run with Numba: "
                            f"{type(exc).__name__}: {detail}") from None
