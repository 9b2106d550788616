"""Stochastic gradient descent with momentum (torch.optim.SGD semantics)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from ..kernels.rules import sgd as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import Column, Hyperparameter, Schema, Slot, non_negative, switch, unit_fraction


class SGDParamState(NamedTuple):
    """One parameter's SGD state (a view into the flat state buffer)."""

    momentum_buffer: np.ndarray


def _nesterov_needs_momentum(values: Mapping[str, Any]) -> list[str]:
    if values["nesterov"] and (values["momentum"] <= 0 or values["dampening"] != 0):
        return ["nesterov=True requires momentum > 0 and dampening = 0 "
                f"(momentum={values['momentum']}, dampening={values['dampening']})"]
    return []


SCHEMA = Schema(
    int8_state=True,
    name="SGD", rule=rule.RULE, torch_name="SGD", record=SGDParamState,
    benchmark={"momentum": 0.9},
    hyperparameters={
        "lr": Hyperparameter(1e-3, non_negative, (0.01, 0.1)),
        "momentum": Hyperparameter(0.0, non_negative, (0.0, 0.5, 0.9)),
        "dampening": Hyperparameter(0.0, unit_fraction, (0.0, 0.3)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.05)),
        "nesterov": switch(),
        "maximize": switch(),
    },
    cross_check=_nesterov_needs_momentum,
    # A state-dict entry holds only the buffer; its presence says the buffer was seeded.
    columns={"momentum_initialized": Column("uint8", 1, marker=True, in_state_dict=False)},
    slots={"momentum_buffer": Slot(when=lambda s: s["momentum"] != 0)},
)


@register
class SGD(Optimizer):
    r"""SGD with momentum, dampening, Nesterov, weight decay and maximize.

    For each parameter with a gradient (a missing gradient skips the parameter entirely)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                     if weight_decay != 0
        if momentum != 0:
            buf = g                                  the first step this parameter has a gradient
            buf = momentum * buf + (1 - dampening) * g        later steps
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g

    The momentum buffer is seeded with the (decayed) gradient itself, undampened, exactly as
    ``torch.optim.SGD`` does. Hyperparameters are read from ``param_groups`` at every step.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(neg_lr=-s["lr"], weight_decay=s["weight_decay"],
                            momentum=s["momentum"], one_minus_dampening=1.0 - s["dampening"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0,
                          has_momentum=s["momentum"] != 0, nesterov=s["nesterov"],
                          maximize=s["maximize"])
