"""Adagrad (torch.optim.Adagrad semantics): state created for every parameter up front."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import adagrad as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import MAX_STEP, Column, Hyperparameter, Schema, Slot, non_negative, switch



SCHEMA = Schema(
    int8_state=True,
    name="Adagrad", rule=rule.RULE, torch_name="Adagrad", eager=True,
    hyperparameters={
        "lr": Hyperparameter(1e-2, non_negative, (1e-2, 0.1)),
        "lr_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.05)),
        "initial_accumulator_value": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "eps": Hyperparameter(1e-10, non_negative, (1e-10, 1e-6)),
        "maximize": switch(),
    },
    # Every parameter has state from construction (step 0): no marker column.
    columns={"step": Column("int64", MAX_STEP)},
    slots={"sum": Slot(nonnegative=True, initial=lambda s: s["initial_accumulator_value"])},
)
AdagradParamState = SCHEMA.record


@register
class Adagrad(Optimizer):
    r"""Adagrad (Duchi et al. 2011) with lr decay, weight decay and maximize, as
    torch.optim.Adagrad.

    Every parameter has state from the start, as in torch: ``step = 0`` and ``sum`` filled
    with its group's ``initial_accumulator_value``. For each parameter with a gradient, with
    ``t`` that parameter's own step count::

        t = t + 1
        g = -grad if maximize else grad
        g = g + weight_decay * p                     if weight_decay != 0
        clr = lr / (1 + (t - 1) * lr_decay)
        sum = sum + g * g
        p = p - clr * g / (sqrt(sum) + eps)

    A missing gradient skips the parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-2, lr_decay: float = 0,
                 weight_decay: float = 0, initial_accumulator_value: float = 0,
                 eps: float = 1e-10, *, maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps,
                         maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(eps=s["eps"], weight_decay=s["weight_decay"])

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(lr=s["lr"], lr_decay=s["lr_decay"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, maximize=s["maximize"])
