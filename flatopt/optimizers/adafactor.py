"""Adafactor (torch.optim.Adafactor semantics, torch 2.13)."""

from __future__ import annotations

import math
from typing import Any

from ..kernels.rules import adafactor as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Hyperparameter, Invalid, Schema, Slot, non_negative, real, switch



def _beta2_decay(value: Any) -> float:
    number = real(value)
    if not -math.inf < number <= 0.0:
        raise Invalid(f"must be a finite number <= 0, got {value!r}")
    return number


def _eps_pair(value: Any) -> tuple[float | None, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise Invalid(f"must be a pair (eps1, eps2), eps1 None or a number, got {value!r}")
    eps1, eps2 = value
    try:
        return (None if eps1 is None else non_negative(eps1)), non_negative(eps2)
    except Invalid as exc:
        raise Invalid(f"(eps1, eps2) = {value!r}: each {exc}") from None


def _clipping_threshold(value: Any) -> float:
    number = real(value)
    if not 1.0 <= number < math.inf:
        raise Invalid(f"must be a finite number >= 1, got {value!r}")
    return number


SCHEMA = Schema(
    name="Adafactor", rule=rule.RULE, torch_name="Adafactor", hyperparameters={
        "lr": Hyperparameter(1e-2, non_negative, (1e-2, 1e-3)),
        "beta2_decay": Hyperparameter(-0.8, _beta2_decay, (-0.8, -0.5, 0.0)),
        "eps": Hyperparameter((None, 1e-3), _eps_pair, ((None, 1e-3), (1e-30, 1e-3),
                                                        (1e-3, 1e-2))),
        "d": Hyperparameter(1.0, _clipping_threshold, (1.0, 2.0)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "maximize": switch(),
    },
    columns={"step": STEP_COUNT},
    slots={"row_var": Slot(nonnegative=True, shape=rule.row_shape),
           "col_var": Slot(nonnegative=True, shape=rule.column_shape),
           "variance": Slot(nonnegative=True, shape=rule.vector_shape)},
)
AdafactorParamState = SCHEMA.record


@register
class Adafactor(Optimizer):
    r"""Adafactor (torch.optim.Adafactor): per-parameter step sizes from factored second
    moments, memory ``R + C`` per ``R x C`` matrix instead of ``R * C``. For each parameter
    with a gradient, ``t`` its own step count::

        g = -grad if maximize else grad
        beta2_t = t ** beta2_decay
        rho = min(lr, 1 / sqrt(t))
        alpha = max(eps2, ||p|| / sqrt(numel)) * rho
        p = p * (1 - lr * weight_decay)              when weight_decay != 0
        matrices (..., R, C), factored over the last two dimensions:
            row_var = lerp(row_var, mean(g², over C), beta2_t)     (..., R, 1)
            col_var = lerp(col_var, mean(g², over R), beta2_t)     (..., 1, C)
            var = row_var @ col_var / max(mean(row_var, over R), eps1)
        vectors and 0-d: variance = lerp(variance, g², beta2_t); var = variance
        u = g / sqrt(max(var, eps1²))
        p = p - alpha / max(1, ||u|| / (sqrt(numel) * d)) * u

    ``eps=(eps1, eps2)``: ``eps1`` None (the default) is the machine epsilon of the
    parameter's dtype. The state slots are *shaped* (``Slot.shape``): ``row_var`` and
    ``col_var`` take ``R + C`` values per matrix in buffers of their own. Differences from
    torch: a zero-size parameter is left alone (torch raises ZeroDivisionError); with
    ``eps1=None`` each dtype uses its own epsilon (torch's loop takes the first parameter's
    dtype for the whole group).
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                         weight_decay=weight_decay, maximize=maximize, **unknown)
