"""RMSprop (torch.optim.RMSprop semantics), centered or not, with or without momentum."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import rmsprop as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Hyperparameter, Schema, Slot, non_negative, switch, unit_fraction



SCHEMA = Schema(
    int8_state=True,
    name="RMSprop", rule=rule.RULE, torch_name="RMSprop", hyperparameters={
        "lr": Hyperparameter(1e-2, non_negative, (1e-2, 1e-3)),
        # torch accepts any alpha >= 0; above 1 the "average" of squares can turn negative
        # (and would then be refused as saved state), so flatopt takes alpha in [0, 1].
        "alpha": Hyperparameter(0.99, unit_fraction, (0.99, 0.9, 0.5, 0.3)),
        "eps": Hyperparameter(1e-8, non_negative, (1e-8, 1e-6)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "momentum": Hyperparameter(0.0, non_negative, (0.0, 0.5, 0.9)),
        "centered": switch(),
        "maximize": switch(),
    },
    columns={"step": STEP_COUNT},
    slots={"square_avg": Slot(nonnegative=True),
           "momentum_buffer": Slot(when=lambda s: s["momentum"] > 0),
           "grad_avg": Slot(when=lambda s: s["centered"])},
)
RMSpropParamState = SCHEMA.record


def lerp_from_end(settings: Mapping) -> bool:
    """torch's lerp(grad_avg, g, w) computes from g when the weight w = 1 - alpha is not
    below 0.5."""
    return not abs(1.0 - settings["alpha"]) < 0.5


@register
class RMSprop(Optimizer):
    r"""RMSprop (Hinton's lecture 6e; centered as in Graves 2013), with momentum, L2 weight
    decay and maximize.

    For each parameter with a gradient (``step`` counts that parameter's steps)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                     if weight_decay != 0
        v = alpha * v + (1 - alpha) * g * g
        if centered:
            a = a + (1 - alpha) * (g - a)
            avg = sqrt(v - a * a) + eps
        else:
            avg = sqrt(v) + eps
        if momentum > 0:
            buf = momentum * buf + g / avg           (buf starts at zero)
            p = p - lr * buf
        else:
            p = p - lr * g / avg

    State: ``step``, ``square_avg`` (v), ``momentum_buffer`` (buf, when momentum > 0) and
    ``grad_avg`` (a, when centered), as in torch. A missing gradient skips the parameter
    entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False, *,
                 maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                         momentum=momentum, centered=centered, maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        alpha = s["alpha"]
        weight = float(dtype.type(1.0 - alpha))  # torch's lerp weight, in the tensor's dtype
        return rule.Scalars(
            neg_lr=-s["lr"], alpha=alpha, one_minus_alpha=1.0 - alpha,
            lerp_coefficient=weight - 1.0 if lerp_from_end(s) else weight,  # exact: Sterbenz
            eps=s["eps"], weight_decay=s["weight_decay"], momentum=s["momentum"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, centered=s["centered"],
                          has_momentum=s["momentum"] > 0, maximize=s["maximize"],
                          lerp_from_end=lerp_from_end(s))
