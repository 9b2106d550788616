"""LAMB: layer-wise adaptive moments (You et al. 2020), as NVIDIA apex's FusedLAMB."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import lamb as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import Hyperparameter, betas, non_negative, switch
from .adam import adam_state_schema



SCHEMA = adam_state_schema(
    int8_state=True,
    name="LAMB", rule=rule.RULE, hyperparameters={
        "lr": Hyperparameter(1e-3, non_negative, (1e-3, 1e-2)),
        "betas": Hyperparameter((0.9, 0.999), betas, ((0.9, 0.999), (0.8, 0.99), (0.0, 0.9))),
        "eps": Hyperparameter(1e-6, non_negative, (1e-6, 1e-8)),
        "weight_decay": Hyperparameter(0.01, non_negative, (0.0, 0.01, 0.1)),
        "bias_correction": switch(True),
        "always_adapt": switch(),
        "maximize": switch(),
    },
)
LAMBParamState = SCHEMA.record


@register
class LAMB(Optimizer):
    r"""LAMB with apex FusedLAMB's rule. For each parameter with a gradient, ``t`` its own
    step count::

        g = -grad if maximize else grad
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * p
        ratio = ||p|| / ||r||     if (weight_decay != 0 or always_adapt) and both norms > 0
                1                 otherwise
        p = p - lr * ratio * r

    without bias correction the ``1 - beta**t`` factors are 1. The norms are per parameter
    tensor, over all its elements: a fused pass computes the moments and both totals, then a
    second pass moves the parameters. apex's FusedLAMB also clips the global gradient norm
    (max_grad_norm=1.0 by default); here that is ``opt.step(max_grad_norm=1.0)``.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, *, bias_correction: bool = True,
                 always_adapt: bool = False, maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, always_adapt=always_adapt,
                         maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        beta1, beta2 = s["betas"]
        return rule.Scalars(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2,
                            one_minus_beta2=1.0 - beta2, eps=s["eps"],
                            weight_decay=s["weight_decay"])

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(lr=s["lr"], beta1=s["betas"][0], beta2=s["betas"][1])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(bias_correction=s["bias_correction"],
                          adapt=s["weight_decay"] != 0 or s["always_adapt"],
                          maximize=s["maximize"])
