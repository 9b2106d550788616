"""Adagrad (torch.optim.Adagrad): per-element step sizes from the sum of squared gradients."""

import math
from typing import NamedTuple

from ..elementwise import element_span
from ..rule import Rule, positions


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


def adagrad_prepare(present, columns, scalars, flags, start, stop, stride):
    """Advance each present parameter's own step count ``t`` and form its step size in
    float64 as torch does in Python, ``neg_clr = -(lr / (1 + (t - 1) * lr_decay))``, stored
    in the buffer's dtype (once per distinct step count in a run)."""
    steps = columns[C.step]
    neg_clr = columns[C.neg_clr]
    lr = scalars[P.lr]
    lr_decay = scalars[P.lr_decay]
    last_step = -1
    value = 0.0
    for k in range(start, stop, stride):
        if present[k] != 0:
            steps[k] += 1
            if steps[k] != last_step:
                # float64 on purpose (the literals too): torch forms this scalar in Python
                last_step = steps[k]
                value = -(lr / (1.0 + (float(last_step) - 1.0) * lr_decay))
            neg_clr[k] = value


RULE = Rule(name="adagrad", span=adagrad_span, prepare=adagrad_prepare, helpers=(adagrad_rule,),
            slots=("sum",), columns={"step": "int64", "neg_clr": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
