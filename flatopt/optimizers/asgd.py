"""ASGD (torch.optim.ASGD semantics): averaged stochastic gradient descent."""

from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np

from ..kernels.rules import asgd as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Column, Hyperparameter, Schema, Slot, non_negative, switch



SCHEMA = Schema(
    name="ASGD", rule=rule.RULE, torch_name="ASGD", hyperparameters={
        "lr": Hyperparameter(1e-2, non_negative, (1e-2, 0.1)),
        # torch checks none of lambd, alpha and t0; flatopt takes finite values >= 0, which
        # keep eta = lr / (1 + lambd * lr * t) ** alpha finite, >= 0 and at most lr.
        "lambd": Hyperparameter(1e-4, non_negative, (1e-4, 0.0, 0.5)),
        "alpha": Hyperparameter(0.75, non_negative, (0.75, 0.5, 1.0)),
        # t0 = 0 averages from the second step on, 3.5 from the fifth (mu = 1 / (t - t0)).
        "t0": Hyperparameter(1e6, non_negative, (1e6, 0.0, 3.5)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.05)),
        "maximize": switch(),
    },
    # eta: the step size for the parameter's next step (the group's lr at its first);
    # mu: the weight of that step's parameter in the average ax (1: ax = p).
    columns={"step": STEP_COUNT,
             "eta": Column("float64", sys.float_info.max),
             "mu": Column("float64", 1.0)},
    slots={"ax": Slot()},
)
ASGDParamState = SCHEMA.record


@register
class ASGD(Optimizer):
    r"""Averaged SGD (Polyak & Juditsky 1992) with torch.optim.ASGD's step-size schedule.

    For each parameter with a gradient, with ``t`` that parameter's own step count; ``eta``
    starts at the group's lr and ``mu`` at 1 the first time the parameter is stepped::

        g = -grad if maximize else grad
        t = t + 1
        g = g + weight_decay * p                     if weight_decay != 0
        p = p * (1 - lambd * eta)
        p = p - eta * g
        ax = ax + (p - ax) * mu  if mu != 1  else  p
        eta = lr / (1 + lambd * lr * t) ** alpha     (for the next step)
        mu = 1 / max(1, t - t0)

    State: ``step``, ``eta`` and ``mu`` (float64 numbers) and ``ax`` (the average), as in
    torch. A missing gradient skips the parameter entirely; a zero gradient is a real step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-2, lambd: float = 1e-4, alpha: float = 0.75,
                 t0: float = 1e6, weight_decay: float = 0, *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, lambd=lambd, alpha=alpha, t0=t0,
                         weight_decay=weight_decay, maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(weight_decay=s["weight_decay"])

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(lr=s["lr"], lambd=s["lambd"], alpha=s["alpha"], t0=s["t0"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, maximize=s["maximize"])
