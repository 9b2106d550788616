"""Adadelta (torch.optim.Adadelta semantics)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import adadelta as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Hyperparameter, Schema, Slot, non_negative, switch, unit_fraction



SCHEMA = Schema(
    name="Adadelta", rule=rule.RULE, torch_name="Adadelta", hyperparameters={
        "lr": Hyperparameter(1.0, non_negative, (1.0, 0.1)),
        "rho": Hyperparameter(0.9, unit_fraction, (0.9, 0.5, 0.0, 1.0)),
        "eps": Hyperparameter(1e-6, non_negative, (1e-6, 1e-3)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "maximize": switch(),
    },
    columns={"step": STEP_COUNT},
    slots={"square_avg": Slot(nonnegative=True), "acc_delta": Slot(nonnegative=True)},
)
AdadeltaParamState = SCHEMA.record


@register
class Adadelta(Optimizer):
    r"""Adadelta (Zeiler 2012), with L2 weight decay and maximize.

    For each parameter with a gradient (``step`` counts that parameter's steps)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                     if weight_decay != 0
        v = rho * v + (1 - rho) * g * g
        delta = sqrt(u + eps) / sqrt(v + eps) * g
        u = rho * u + (1 - rho) * delta * delta
        p = p - lr * delta

    State: ``step``, ``square_avg`` (v) and ``acc_delta`` (u), as in torch. A missing
    gradient skips the parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0.0, *, maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(neg_lr=-s["lr"], rho=s["rho"], one_minus_rho=1.0 - s["rho"],
                            eps=s["eps"], weight_decay=s["weight_decay"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, maximize=s["maximize"])
