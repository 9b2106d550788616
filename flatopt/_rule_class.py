"""The optimizer class of a user's rule (:func:`flatopt.define_optimizer`): its kernel
arguments read by name from the group's values, derived's values checked per group before a
step, and for per-group totals the ``combine`` the global-reductions step calls."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .errors import HyperparameterError, ModeError, raise_problems
from .kernels.rule import Rule
from .optimizer import Optimizer
from .schema import Schema, describe_group
from ._rule_source import (GROUP_STEP, TRAIN_MODE, Definition, compiled_per_group,
                           derived_problem, identifier, layouts)

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _values(d: Definition) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """A group's values by name: its settings and, computed from them, derived's."""
    def values(settings: Mapping[str, Any]) -> Mapping[str, Any]:
        if d.derived is None:
            return settings
        derived, _ = derived_problem(d.derived, d.derived_reads, settings)
        return {**settings, **derived}
    return values


def _check_step(d: Definition) -> Callable:
    def check_step(self, settings):
        """Every group in train mode (a rule with mode passes), and derived's values for
        every group, before anything changes (a group value it cannot take is the group's
        problem: HyperparameterError)."""
        if TRAIN_MODE in d.hyperparameters:
            raise_problems([
                f"{describe_group(number, s)} is in eval mode (its parameters hold the point "
                "to_eval moved them to); call opt.train() before stepping"
                for number, s in enumerate(settings) if not s[TRAIN_MODE]], ModeError)
        checked = self.__dict__.get("_derived_checked")
        if d.derived is None or (checked is not None and len(checked) == len(settings)
                                 and all(a is b for a, b in zip(checked, settings))):
            return  # the same validated group values as at the last step: checked then
        problems = []
        narrow = {buf.group for buf in self.buffers if buf.dtype == np.float32}
        for number, group in enumerate(settings):
            derived, problem = derived_problem(d.derived, d.derived_reads, group,
                                               d.derived_names)
            if problem is None and number in narrow:
                wide = {k: v for k, v in derived.items() if abs(v) > FLOAT32_MAX}
                problem = f"derived values {wide} overflow float32" if wide else None
            if problem:
                problems.append(f"{describe_group(number, group)}: {problem}")
        if problems:
            raise HyperparameterError(f"{d.name}: cannot step with these hyperparameters: "
                                      + "; ".join(problems))
        self._derived_checked = list(settings)
    return check_step


def _combine(d: Definition, rule: Rule, scalars: Sequence[str], values: Callable) -> Callable:
    per_group = []  # compiled at the first step (Numba, uncached: a small function)

    def combine(self, settings, totals):
        """``per_group`` of each group's totals: the step pass's scalars and the new group
        state (before the reduce pass, ``totals`` None: the scalars the reduce reads)."""
        if totals is not None and not per_group:
            per_group.append(compiled_per_group(d))
        scalars_per_group, changes = [], []
        for number, group in enumerate(settings):
            known = values(group)
            if totals is not None:
                result = per_group[0](*[totals[number, d.reduce_values.index(v)]
                                        if v in d.reduce_values else known[v]
                                        for v in d.per_group_reads])
                new = dict(zip(d.per_group_values,
                               map(float, result if isinstance(result, tuple) else (result,))))
                known = {**known, **new}
                changes.append({k: new[k] for k in d.group_state} or None)
            scalars_per_group.append(rule.scalars(*[known.get(v, 0.0) for v in scalars]))
        return scalars_per_group, changes if totals is not None else None
    return combine


def _switch(d: Definition, modes: tuple[Rule, Rule], values: Callable) -> Callable:
    def switch(self, train: bool) -> None:
        """Run ``to_train`` (``to_eval``) over the parameters with state of every group not
        in that mode yet, then record the mode in those groups."""
        with self.lock:
            settings = self.settings()
            switching = [s[TRAIN_MODE] != train for s in settings]
            rule = modes[1] if train else modes[0]

            def arguments(buf):
                if not switching[buf.group]:
                    return None
                known = values(settings[buf.group])
                return (np.array([known[v] for v in rule.scalars._fields], buf.dtype),
                        tuple(bool(known[v]) for v in rule.flags._fields))

            self._map_state(rule, d.slots, arguments)
            for group, flip in zip(self.param_groups, switching):
                if flip:
                    group[TRAIN_MODE] = train
    return switch


def optimizer_class(d: Definition, schema: Schema, rule: Rule, doc: str | None,
                    modes: tuple[Rule, Rule] | None = None) -> type[Optimizer]:
    scalars, prepare, flags = layouts(d)
    values = _values(d)

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
        "before_step": before_step, "check_step": _check_step(d),
        **({"combine": _combine(d, rule, scalars, values)} if d.per_group is not None else {}),
        **(_mode_methods(d, modes, values) if modes is not None else {}),
        "path_columns": dict(d.per_parameter),
        "__doc__": doc or (f"{d.name}: a user-defined rule stepping every element with "
                           f"{d.update.__name__}()."),
        "__module__": d.update.__module__,
    }

    def __init__(self, params, **hyperparameters):
        Optimizer.__init__(self, params, **hyperparameters)
    __init__.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    namespace["__init__"] = __init__
    return type(identifier(d.name), (Optimizer,), namespace)


def _mode_methods(d: Definition, modes: tuple[Rule, Rule], values: Callable) -> dict:
    switch = _switch(d, modes, values)

    def train(self) -> None:
        """Move the parameters of every group in eval mode back with the rule's
        ``to_train`` (one pass per buffer); then step."""
        switch(self, True)

    def eval(self) -> None:
        """Move the parameters of every group in train mode with the rule's ``to_eval`` (one
        pass per buffer): call before evaluating the model or saving it for inference. A
        checkpoint records the mode and resumes in it; a step in eval mode is refused."""
        switch(self, False)
    return {"train": train, "eval": eval}

