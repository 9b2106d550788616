"""Lion (Chen et al. 2023): sign updates of an interpolated momentum; no torch.optim class."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import lion as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import STEP_COUNT, Hyperparameter, Schema, Slot, betas, non_negative, switch



SCHEMA = Schema(
    int8_state=True,
    name="Lion", rule=rule.RULE, torch_name=None, hyperparameters={
        "lr": Hyperparameter(1e-4, non_negative, (1e-4, 1e-3)),
        "betas": Hyperparameter((0.9, 0.99), betas,
                                ((0.9, 0.99), (0.95, 0.98), (0.5, 0.9), (0.0, 0.99),
                                 (0.9, 0.0))),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1, 1.0)),
        "maximize": switch(),
        "caution": switch(since=2),
    },
    version=2,
    columns={"step": STEP_COUNT},
    slots={"exp_avg": Slot()},
)
LionParamState = SCHEMA.record


@register
class Lion(Optimizer):
    r"""Lion, EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms", Algorithm 2), with decoupled weight decay and maximize.

    For each parameter with a gradient (``step`` counts that parameter's steps; the update
    itself does not use it)::

        g = -grad if maximize else grad
        c = beta1 * m + (1 - beta1) * g              the update direction
        p = p * (1 - lr * weight_decay)              decoupled, whatever g is
        u = sign(c)                                  sign(0) = 0
        u = u * (u * g > 0) / max(mean(u * g > 0), 1e-3)   if caution
        p = p - lr * u
        m = beta2 * m + (1 - beta2) * g              the momentum, tracked with beta2

    Every element moves by exactly ``lr`` (plus decay), so Lion's lr is typically 3-10x
    smaller than AdamW's and its weight_decay 3-10x larger. torch.optim has no Lion; the
    NumPy reference in ``tests/reference.py`` is the oracle. State: ``step`` and
    ``exp_avg`` (m). A missing gradient skips the parameter entirely; a zero gradient is a
    real step (weight decay, and ``sign(beta1 * m)``; with caution, weight decay only).

    ``caution`` (timm's ``Lion``, "Cautious Optimizers", arXiv 2411.16085): only the elements
    whose update direction agrees in sign with the gradient move, by ``lr`` times the inverse
    of their share of the parameter (at most 1000); a second reading pass over the buffer.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, caution: bool = False, *, maximize: bool = False,
                 **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay,
                         caution=caution, maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        beta1, beta2 = s["betas"]
        return rule.Scalars(neg_lr=-s["lr"], beta1=beta1, one_minus_beta1=1.0 - beta1,
                            beta2=beta2, one_minus_beta2=1.0 - beta2,
                            decay_factor=1.0 - s["lr"] * s["weight_decay"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, maximize=s["maximize"],
                          caution=s["caution"])
