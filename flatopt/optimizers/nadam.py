"""NAdam (torch.optim.NAdam semantics): Adam with Nesterov momentum and a momentum schedule."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import nadam as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import (ADAM_MOMENTS, STEP_COUNT, Column, Hyperparameter, Schema, non_negative,
                      switch)
from .adam import adam_hyperparameters, lerp_from_end, moment_scalars



SCHEMA = Schema(
    int8_state=True,
    name="NAdam", rule=rule.RULE, torch_name="NAdam", hyperparameters=adam_hyperparameters(
        2e-3, ((0.9, 0.999), (0.8, 0.99), (0.5, 0.999), (0.3, 0.9), (0.0, 0.999)),
        # 0 keeps mu at beta1 / 2; 0.5 moves it towards beta1 within a short run
        momentum_decay=Hyperparameter(4e-3, non_negative, (4e-3, 0.0, 0.5)),
        decoupled_weight_decay=switch(), maximize=switch()),
    # mu_product is a product of factors mu_t in [0, beta1), from 1 at the first step.
    columns={"step": STEP_COUNT,
             "mu_product": Column("float64", 1.0)},
    slots=ADAM_MOMENTS,
)
NAdamParamState = SCHEMA.record


@register
class NAdam(Optimizer):
    r"""NAdam (Dozat 2016, "Incorporating Nesterov Momentum into Adam"), with L2 or decoupled
    weight decay (NAdamW) and maximize, as torch.optim.NAdam.

    For each parameter with a gradient, with ``t`` that parameter's own step count and
    ``mu_product`` its product of the ``mu`` so far (1 before its first step)::

        g = -grad if maximize else grad
        t = t + 1
        p = p * (1 - lr * weight_decay)              decoupled_weight_decay, whatever g is
        g = g + weight_decay * p                     otherwise (L2 into the gradient)
        mu = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        mu_product = mu_product * mu
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        denom = sqrt(v / (1 - beta2**t)) + eps
        p = p - lr * (1 - mu) / (1 - mu_product) * g / denom
        p = p - lr * mu_next / (1 - mu_product * mu_next) * m / denom

    State: ``step``, ``mu_product`` (a float64 number), ``exp_avg``, ``exp_avg_sq``, as in
    torch. A missing gradient skips the parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, momentum_decay: float = 4e-3,
                 decoupled_weight_decay: bool = False, *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         momentum_decay=momentum_decay,
                         decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                         **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(**moment_scalars(s, dtype))

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        beta1, beta2 = s["betas"]
        return rule.PrepareScalars(lr=s["lr"], beta1=beta1, beta2=beta2,
                                   momentum_decay=s["momentum_decay"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0,
                          decoupled=s["decoupled_weight_decay"], maximize=s["maximize"],
                          lerp_from_end=lerp_from_end(s))
