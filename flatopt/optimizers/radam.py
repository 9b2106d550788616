"""RAdam (torch.optim.RAdam semantics): Adam with variance rectification."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import radam as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import switch
from .adam import adam_hyperparameters, adam_state_schema, lerp_from_end, moment_scalars



SCHEMA = adam_state_schema(
    int8_state=True,
    name="RAdam", rule=rule.RULE, torch_name="RAdam",
    # beta2 = 0.9 has rho_inf = 19 and switches to the rectified update at step 6
    # (0.999 at step 6 too, 0.5 never: rho_inf = 3): the runs cover both sides.
    hyperparameters=adam_hyperparameters(
        1e-3, ((0.9, 0.999), (0.8, 0.9), (0.5, 0.99), (0.3, 0.9), (0.0, 0.999), (0.9, 0.5)),
        decoupled_weight_decay=switch(), maximize=switch()),
)
RAdamParamState = SCHEMA.record


@register
class RAdam(Optimizer):
    r"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond"),
    with L2 or decoupled weight decay and maximize.

    For each parameter with a gradient, with ``t`` that parameter's own step count and
    ``rho_inf = 2 / (1 - beta2) - 1``::

        g = -grad if maximize else grad
        t = t + 1
        p = p * (1 - lr * weight_decay)              decoupled_weight_decay, whatever g is
        g = g + weight_decay * p                     otherwise (L2 into the gradient)
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        rho_t = rho_inf - 2 * t * beta2**t / (1 - beta2**t)
        if rho_t > 5:
            r = sqrt((rho_t - 4) (rho_t - 2) rho_inf / ((rho_inf - 4) (rho_inf - 2) rho_t))
            p = p - lr * m / (1 - beta1**t) * sqrt(1 - beta2**t) / (sqrt(v) + eps) * r
        else:
            p = p - lr * m / (1 - beta1**t)

    The switch is taken per parameter from its own ``t``. A missing gradient skips the
    parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                         **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(lr=s["lr"], one=1.0, **moment_scalars(s, dtype))

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        beta1, beta2 = s["betas"]
        return rule.PrepareScalars(beta1=beta1, beta2=beta2, rho_inf=2 / (1 - beta2) - 1)

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0,
                          decoupled=s["decoupled_weight_decay"], maximize=s["maximize"],
                          lerp_from_end=lerp_from_end(s))
