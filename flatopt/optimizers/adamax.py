"""Adamax (torch.optim.Adamax semantics): Adam with an infinity-norm second moment."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import adamax as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Schema, Slot, switch
from .adam import adam_hyperparameters, lerp_from_end



SCHEMA = Schema(
    int8_state=True,
    name="Adamax", rule=rule.RULE, torch_name="Adamax", hyperparameters=adam_hyperparameters(
        2e-3, ((0.9, 0.999), (0.8, 0.99), (0.5, 0.9), (0.3, 0.99), (0.0, 0.999)),
        eps_examples=(1e-8, 1e-3), maximize=switch()),
    columns={"step": STEP_COUNT},
    slots={"exp_avg": Slot(), "exp_inf": Slot(nonnegative=True)},
)
AdamaxParamState = SCHEMA.record


@register
class Adamax(Optimizer):
    r"""Adamax (Kingma & Ba 2015, section 7.1), with L2 weight decay and maximize.

    For each parameter with a gradient, with ``t`` that parameter's own step count::

        g = -grad if maximize else grad
        t = t + 1
        g = g + weight_decay * p                     if weight_decay != 0
        m = m + (1 - beta1) * (g - m)
        u = max(beta2 * u, |g| + eps)
        p = p - lr / (1 - beta1**t) * m / u

    State: ``step``, ``exp_avg`` (m) and ``exp_inf`` (u), as in torch. A missing gradient
    skips the parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        beta1, beta2 = s["betas"]
        weight = float(dtype.type(1.0 - beta1))  # torch's lerp weight, in the tensor's dtype
        return rule.Scalars(
            lerp_coefficient=weight - 1.0 if lerp_from_end(s) else weight,  # exact: Sterbenz
            beta2=beta2, eps=s["eps"], weight_decay=s["weight_decay"])

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(lr=s["lr"], beta1=s["betas"][0])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, maximize=s["maximize"],
                          lerp_from_end=lerp_from_end(s))
