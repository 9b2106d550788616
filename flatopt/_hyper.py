"""Hyperparameter names, defaults and validation, shared by constructors, groups and step()."""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Callable, Mapping

import numpy as np

from .errors import HyperparameterError

# Keys a group may carry besides hyperparameters: its parameters, a free-form label, and the
# initial_lr that learning-rate schedulers record (as in torch).
GROUP_KEYS = ("params", "label", "initial_lr")


class Invalid(Exception):
    """Raised by a checker with the reason a value is refused."""


def _real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Invalid(f"must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number):
        raise Invalid("must not be NaN")
    return number


def non_negative(value: Any) -> float:
    number = _real(value)
    if number < 0 or math.isinf(number):
        raise Invalid(f"must be a finite number >= 0, got {value!r}")
    return number


def unit_fraction(value: Any) -> float:
    """A number in [0, 1]."""
    number = _real(value)
    if not 0.0 <= number <= 1.0:
        raise Invalid(f"must be in [0, 1], got {value!r}")
    return number


def flag(value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise Invalid(f"must be True or False, got {value!r}")
    return bool(value)


def betas(value: Any) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise Invalid(f"must be a pair (beta1, beta2), got {value!r}")
    pair = []
    for position, beta in enumerate(value):
        try:
            number = _real(beta)
        except Invalid as exc:
            raise Invalid(f"beta{position + 1} {exc}") from None
        if not 0.0 <= number < 1.0:
            raise Invalid(f"beta{position + 1} must be in [0, 1), got {beta!r}")
        pair.append(number)
    return (pair[0], pair[1])


def label(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"must be a string, got {value!r}")
    return value


Spec = Mapping[str, tuple[Any, Callable[[Any], Any]]]
"""Hyperparameter name -> (default, checker returning the normalised value)."""


def describe_group(number: int | None, group: Mapping[str, Any] | None = None) -> str:
    if number is None:
        return "constructor arguments"
    name = group.get("label") if group else None
    return f"param group {number}" + (f" ({name!r})" if name else "")


def unknown_key_problems(keys, spec: Spec, where: str, allowed=GROUP_KEYS) -> list[str]:
    """One message per key that is neither a hyperparameter nor an allowed group key."""
    known = list(spec) + list(allowed)
    problems = []
    for key in keys:
        if key in spec or key in allowed:
            continue
        near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        problems.append(f"{where}: unknown hyperparameter {key!r}{hint}; "
                        f"known: {', '.join(spec)}")
    return problems


def check_values(values: Mapping[str, Any], spec: Spec, where: str,
                 cross_check: Callable[[dict], list[str]] | None = None
                 ) -> tuple[dict[str, Any], list[str]]:
    """Normalise every hyperparameter in ``values``; return (normalised, problems)."""
    normalised: dict[str, Any] = {}
    problems: list[str] = []
    for key, (_, checker) in spec.items():
        if key not in values:
            continue
        try:
            normalised[key] = checker(values[key])
        except Invalid as exc:
            problems.append(f"{where}: {key}={values[key]!r} is invalid: {exc}")
    if cross_check is not None and not problems and len(normalised) == len(spec):
        problems += [f"{where}: {message}" for message in cross_check(normalised)]
    return normalised, problems


def raise_problems(problems: list[str], error=HyperparameterError) -> None:
    if problems:
        raise error("\n".join(problems) if len(problems) > 1 else problems[0])
