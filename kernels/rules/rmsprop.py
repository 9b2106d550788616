"""RMSprop (torch.optim.RMSprop), centered or not, with or without momentum."""

import math
from typing import NamedTuple

from ..elementwise import Off, element_prepare, element_span
from ..rule import Rule


class Scalars(NamedTuple):
    neg_lr: float
    alpha: float
    one_minus_alpha: float
    lerp_coefficient: float
    eps: float
    weight_decay: float
    momentum: float


class Flags(NamedTuple):
    has_weight_decay: bool
    centered: bool
    has_momentum: bool
    maximize: bool
    lerp_from_end: bool


class Columns(NamedTuple):
    step: int


def rmsprop_rule(p, g, v, buf, avg_g, neg_lr, alpha, one_minus_alpha, lerp_coefficient, eps,
                 weight_decay, momentum, has_weight_decay, centered, has_momentum, maximize,
                 lerp_from_end):
    """One RMSprop element update; returns ``(p, v, buf, avg_g)`` (torch's ``square_avg``,
    ``momentum_buffer`` and ``grad_avg``)::

        g = -g                                 if maximize
        g = g + weight_decay * p               if weight_decay != 0
        v = alpha * v + (1 - alpha) * g * g
        avg_g = lerp(avg_g, g, 1 - alpha)      if centered (torch's lerp, from the nearer end)
        avg = sqrt(v - avg_g * avg_g) + eps    if centered (eps outside the root)
        avg = sqrt(v) + eps                    otherwise
        buf = momentum * buf + g / avg         if momentum > 0 (the buffer starts at zero)
        p = p - lr * buf                       if momentum > 0
        p = p - lr * g / avg                   otherwise
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = g + weight_decay * p
    v = v * alpha + (one_minus_alpha * g) * g
    if centered:
        if lerp_from_end:
            avg_g = g + lerp_coefficient * (g - avg_g)
        else:
            avg_g = avg_g + lerp_coefficient * (g - avg_g)
        avg = math.sqrt(v - avg_g * avg_g) + eps
    else:
        avg = math.sqrt(v) + eps
    if has_momentum:
        buf = buf * momentum + g / avg
        p = p + neg_lr * buf
    else:
        p = p + (neg_lr * g) / avg
    return p, v, buf, avg_g


# One loop per combination of the flags that decide which slots are read and written, so that
# an unused slot is never touched and each loop vectorises (Rule.variants: the CPU compiles
# only the loop a configuration takes).
rmsprop_span = element_span(
    "rmsprop_span", rmsprop_rule, 3, Scalars, Columns, Flags,
    branches={"centered": Off(unread=("avg_g",), unwritten=("avg_g",)),
              "has_momentum": Off(unread=("buf",), unwritten=("buf",))})


rmsprop_prepare = element_prepare("rmsprop_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (the update does not read it)."""


RULE = Rule(name="rmsprop", span=rmsprop_span, prepare=rmsprop_prepare,
            helpers=(rmsprop_rule,), slots=("square_avg", "momentum_buffer", "grad_avg"),
            columns={"step": "int64"}, scalars=Scalars, flags=Flags,
            variants=("centered", "has_momentum"))
