"""Argument and state checks shared by the schedulers, and torch's deprecation text."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..optimizer import Optimizer
from ..schema import python_number


EPOCH_DEPRECATION_WARNING = (
    "The epoch parameter in `scheduler.step()` was not necessary and is being "
    "deprecated where possible. Please use `scheduler.step()` to step the "
    "scheduler. During the deprecation, if epoch is different from None, the "
    "closed form is used instead of the new chainable form, where available. "
    "Please open an issue if you are unable to replicate your use case: "
    "https://github.com/pytorch/pytorch/issues/new/choose."
)
"""torch's text, warned (``UserWarning``) when ``step`` is given an epoch."""


# ----------------------------------------------------------------------------- checks
def describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def integer(value: Any, name: str, low: int | None = None) -> int:
    """An integer (not a bool) >= low, as a Python int."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {describe(value)}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return value


def real(value: Any, name: str, *, low: float | None = None, low_open: bool = False,
          high: float | None = None, high_open: bool = False) -> float:
    """A finite real number (not a bool) in the given range, as a Python float."""
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if below or above:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            parts.append(f"{'<' if high_open else '<='} {high}")
        raise ValueError(f"{name} must be {' and '.join(parts)}, got {value!r}")
    return number


def reals(values: Any, name: str, count: int | None, **limits: Any) -> list[float]:
    """A list of ``count`` numbers, each checked by :func:`real`."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of numbers, got {describe(values)}")
    if count is not None and len(values) != count:
        raise ValueError(f"{name} must have one value per param group ({count}), "
                         f"got {len(values)}")
    return [real(v, f"{name}[{i}]", **limits) for i, v in enumerate(values)]


def any_reals(values: Any, name: str, count: int | None) -> list[float]:
    """A list of ``count`` real numbers (infinite allowed), as floats."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of numbers, got {describe(values)}")
    if count is not None and len(values) != count:
        raise ValueError(f"{name} must have one value per param group ({count}), "
                         f"got {len(values)}")
    for i, v in enumerate(values):
        if not is_real(v):
            raise TypeError(f"{name}[{i}] must be a real number, got {describe(v)}")
    return [float(v) for v in values]


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")
    return bool(value)


def plain(value: Any, where: str) -> Any:
    """``value`` as JSON data: tuples become lists, numpy scalars Python numbers."""
    value = python_number(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: state keys must be strings, got {describe(key)}")
            out[key] = plain(v, f"{where}[{key!r}]")
        return out
    raise TypeError(f"{where} is a {type(value).__name__}, which is not JSON data")


def check_optimizer(optimizer: Any) -> None:
    """A flatopt optimizer, or anything whose ``param_groups`` is a list of dicts."""
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return
    if isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__}.param_groups must be a list of dicts, "
                        f"got {describe(groups)}")
    raise TypeError(f"{type(optimizer).__name__} is not an Optimizer (a scheduler takes a "
                    "flatopt optimizer, or an object whose param_groups is a list of dicts)")


def check_last_epoch(last_epoch: Any) -> int:
    return integer(last_epoch, "last_epoch", low=-1)


def require_initial_lr(optimizer: Any) -> None:
    """torch's KeyError for ``last_epoch >= 0`` without ``initial_lr`` in every group."""
    for i, group in enumerate(optimizer.param_groups):
        if "initial_lr" not in group:
            raise KeyError(
                f"param 'initial_lr' is not specified in param_groups[{i}] when "
                "resuming scheduler with last_epoch >= 0.\n"
                "This typically happens when:\n"
                "1. You're trying to resume training from a checkpoint but haven't "
                "properly loaded the optimizer state\n"
                "2. You're using last_epoch >= 0 for a fresh training run (not "
                "recommended)")


def _format_param(name: str, optimizer: Any, param: Any) -> list:
    """One value per group: a list/tuple of that length, or a scalar repeated (torch)."""
    if isinstance(param, (list, tuple)):
        if len(param) != len(optimizer.param_groups):
            raise ValueError(
                f"{name} must have the same length as optimizer.param_groups. "
                f"{name} has {len(param)} values, param_groups has "
                f"{len(optimizer.param_groups)}.")
        return list(param)
    return [param] * len(optimizer.param_groups)


def per_group(name: str, optimizer: Any, param: Any) -> list[float]:
    """:func:`_format_param`, each value a finite number >= 0."""
    values = _format_param(name, optimizer, param)
    listed = isinstance(param, (list, tuple))
    return [real(v, f"{name}[{i}]" if listed else name, low=0.0)
            for i, v in enumerate(values)]


def group_lrs(optimizer: Any) -> list:
    return [group["lr"] for group in optimizer.param_groups]


# ----------------------------------------------------------------------------- base class
