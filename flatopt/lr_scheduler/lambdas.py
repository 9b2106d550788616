"""Schedules given as functions of the step: LambdaLR (``lr = initial lr * f(t)``, what
``transformers.get_linear_schedule_with_warmup`` builds) and MultiplicativeLR
(``lr *= f(t)``).

As in torch, the functions themselves are not saved: ``state_dict()["lr_lambdas"]`` holds, per
group, None for a plain function or lambda, and the attributes (``__dict__``) of a callable
object, which ``load_state_dict`` writes back into the live object. Build the scheduler with the
same functions before loading. Unlike torch, those attributes must be JSON data (as every
flatopt scheduler state is), and a callable that is not a function is checked at construction.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from ._checks import check_optimizer, describe, group_lrs, plain
from .base import LRScheduler


def _lambdas(optimizer: Any, lr_lambda: Any) -> list[Callable[[int], Any]]:
    """One function per group: a list/tuple of that length, or one repeated (torch)."""
    count = len(optimizer.param_groups)
    if isinstance(lr_lambda, (list, tuple)):
        if len(lr_lambda) != count:
            raise ValueError(f"Expected {count} lr_lambdas, but got {len(lr_lambda)}")
        functions = list(lr_lambda)
    else:
        functions = [lr_lambda] * count
    for function in functions:
        if not callable(function):
            raise TypeError(f"lr_lambda should be a function, but got "
                            f"{type(function).__name__}")
    return functions


def saved_attributes(function: Callable) -> dict | None:
    """What torch saves of one lr_lambda: nothing for a function, else its attributes."""
    if isinstance(function, types.FunctionType):
        return None
    return plain(vars(function).copy(), f"the attributes of lr_lambda {function!r}")


class _FunctionSchedule(LRScheduler):
    """The state handling LambdaLR and MultiplicativeLR share (``lr_lambdas``, as torch)."""

    extra_state = ("lr_lambdas",)

    def __init__(self, optimizer: Any, lr_lambda: Any, last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        self.lr_lambdas = _lambdas(optimizer, lr_lambda)
        for function in self.lr_lambdas:
            saved_attributes(function)  # a state that cannot be saved is refused now
        super().__init__(optimizer, last_epoch)

    def _extra_values(self) -> dict[str, Any]:
        return {"lr_lambdas": [saved_attributes(f) for f in self.lr_lambdas]}

    def _checked_extra(self, values: dict[str, Any]) -> dict[str, Any]:
        saved = values["lr_lambdas"]
        if not isinstance(saved, list) or len(saved) != len(self.lr_lambdas):
            raise ValueError(f"lr_lambdas must be a list of {len(self.lr_lambdas)} entries "
                             f"(None or a dict), got {describe(saved)}")
        checked = []
        for i, (attributes, function) in enumerate(zip(saved, self.lr_lambdas)):
            live = saved_attributes(function)
            if (attributes is None) != (live is None):
                raise ValueError(
                    f"lr_lambdas[{i}] was saved from a "
                    f"{'function' if attributes is None else 'callable object'}, but this "
                    f"scheduler's is a {'function' if live is None else 'callable object'}: "
                    "build it with the functions the state was saved with")
            checked.append(None if attributes is None else plain(attributes,
                                                                  f"lr_lambdas[{i}]"))
        return {"lr_lambdas": checked}

    def _apply_state(self, values: dict[str, Any]) -> None:
        attributes = values.pop("lr_lambdas")
        super()._apply_state(values)
        for function, saved in zip(self.lr_lambdas, attributes):
            if saved is not None:
                vars(function).update(saved)


class LambdaLR(_FunctionSchedule):
    """``lr = initial_lr * lr_lambda(t)`` for each group (``lr_lambda``: one function, or one
    per group)."""

    def get_lr(self):
        self._warn_get_lr_outside_step()
        return [base_lr * function(self.last_epoch)
                for function, base_lr in zip(self.lr_lambdas, self.base_lrs, strict=True)]


class MultiplicativeLR(_FunctionSchedule):
    """``lr *= lr_lambda(t)`` at every step after the first (``lr_lambda``: one function, or
    one per group)."""

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial:
            return group_lrs(self.optimizer)
        return [group["lr"] * function(self.last_epoch)
                for function, group in zip(self.lr_lambdas, self.optimizer.param_groups,
                                           strict=True)]
