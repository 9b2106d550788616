"""Rprop (torch.optim.Rprop semantics): resilient backpropagation."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import rprop as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Hyperparameter, Invalid, Schema, Slot, non_negative, switch



def _pair(value: Any, names: tuple[str, str]) -> tuple[float, float]:
    if not isinstance(value, (tuple, list, np.ndarray)) or len(value) != 2:
        raise Invalid(f"must be a pair ({names[0]}, {names[1]}), got {value!r}")
    pair = []
    for name, item in zip(names, value):
        try:
            pair.append(non_negative(item))
        except Invalid as exc:
            raise Invalid(f"{name} {exc}") from None
    return (pair[0], pair[1])


def etas(value: Any) -> tuple[float, float]:
    """(etaminus, etaplus) with 0 < etaminus < 1 < etaplus (torch's check), both finite."""
    etaminus, etaplus = _pair(value, ("etaminus", "etaplus"))
    if not 0.0 < etaminus < 1.0 < etaplus:
        raise Invalid(f"must satisfy 0 < etaminus < 1 < etaplus, got {value!r}")
    return (etaminus, etaplus)


def step_sizes(value: Any) -> tuple[float, float]:
    """(step_size_min, step_size_max), finite, with 0 <= min <= max (torch checks nothing)."""
    low, high = _pair(value, ("step_size_min", "step_size_max"))
    if low > high:
        raise Invalid(f"step_size_min must not exceed step_size_max, got {value!r}")
    return (low, high)


SCHEMA = Schema(
    name="Rprop", rule=rule.RULE, torch_name="Rprop", hyperparameters={
        "lr": Hyperparameter(1e-2, non_negative, (1e-2, 1e-3, 0.1)),
        "etas": Hyperparameter((0.5, 1.2), etas, ((0.5, 1.2), (0.3, 1.5), (0.9, 1.1))),
        # (1e-3, 0.05) makes both clamps bite within a short run; lr 0.1 starts above it.
        "step_sizes": Hyperparameter((1e-6, 50), step_sizes,
                                     ((1e-6, 50), (1e-3, 0.05), (0.0, 1.0))),
        "maximize": switch(),
    },
    columns={"step": STEP_COUNT},
    slots={"prev": Slot(), "step_size": Slot(nonnegative=True)},
)
RpropParamState = SCHEMA.record


@register
class Rprop(Optimizer):
    r"""Rprop (Riedmiller & Braun 1993), the variant torch.optim.Rprop implements.

    For each parameter with a gradient; on its first step ``prev = 0`` and every element's
    ``step_size = lr`` (the group's lr at that step)::

        g = -grad if maximize else grad
        step_size = step_size * etaplus              where g * prev > 0
        step_size = step_size * etaminus, g = 0      where g * prev < 0 (the sign flipped)
        step_size = clamp(step_size, step_size_min, step_size_max)
        p = p - sign(g) * step_size
        prev = g

    ``lr`` is read only when a parameter's state starts. State: ``step``, ``prev`` and
    ``step_size``, as in torch. A missing gradient skips the parameter entirely; a zero
    gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-2, etas: tuple[float, float] = (0.5, 1.2),
                 step_sizes: tuple[float, float] = (1e-6, 50), *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, etas=etas, step_sizes=step_sizes, maximize=maximize,
                         **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        etaminus, etaplus = s["etas"]
        low, high = s["step_sizes"]
        return rule.Scalars(lr=s["lr"], etaminus=etaminus, etaplus=etaplus, step_size_min=low,
                            step_size_max=high, zero=0.0)

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(maximize=s["maximize"])
