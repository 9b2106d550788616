"""Adagrad (torch.optim.Adagrad): per-element step sizes from the sum of squared gradients."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare, element_span
from ..layouts import positions
from ..rule import Rule


class Scalars(NamedTuple):
    eps: float
    weight_decay: float


class PrepareScalars(NamedTuple):
    lr: float
    lr_decay: float


class Flags(NamedTuple):
    has_weight_decay: bool
    maximize: bool


class Columns(NamedTuple):
    step: int
    neg_clr: float


P, C = positions(PrepareScalars), positions(Columns)


def adagrad_rule(p, g, state_sum, neg_clr, eps, weight_decay, has_weight_decay, maximize):
    """One Adagrad element update; returns ``(p, sum)``::

        g = -g                                         if maximize
        g = g + weight_decay * p                       if weight_decay != 0
        sum = sum + g * g
        p = p - clr * g / (sqrt(sum) + eps)            clr = lr / (1 + (t - 1) * lr_decay)

    in torch's order (``addcdiv``: ``-clr`` times ``g``, divided, then added).
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = g + weight_decay * p
    state_sum = state_sum + g * g
    std = math.sqrt(state_sum) + eps
    p = p + (neg_clr * g) / std
    return p, state_sum


adagrad_span = element_span("adagrad_span", adagrad_rule, 1, Scalars, Columns, Flags)


def adagrad_per_step(t, lr, lr_decay):
    """``neg_clr = -(lr / (1 + (t - 1) * lr_decay))``, formed in float64 as torch does in
    Python."""
    return (-(lr / (1.0 + (t - 1.0) * lr_decay)),)


adagrad_prepare = element_prepare("adagrad_prepare", adagrad_per_step, ("neg_clr",),
                                  PrepareScalars, Columns)


RULE = Rule(name="adagrad", span=adagrad_span, prepare=adagrad_prepare,
            helpers=(adagrad_per_step, adagrad_rule),
            slots=("sum",), columns={"step": "int64", "neg_clr": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
