"""Adadelta (torch.optim.Adadelta)."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare, element_span
from ..layouts import positions
from ..rule import Rule


class Scalars(NamedTuple):
    neg_lr: float
    rho: float
    one_minus_rho: float
    eps: float
    weight_decay: float


class Flags(NamedTuple):
    has_weight_decay: bool
    maximize: bool


class Columns(NamedTuple):
    step: int


C = positions(Columns)


def adadelta_rule(p, g, v, u, neg_lr, rho, one_minus_rho, eps, weight_decay,
                  has_weight_decay, maximize):
    """One Adadelta element update; returns ``(p, v, u)`` (torch's ``square_avg`` and
    ``acc_delta``)::

        g = -g                                 if maximize
        g = g + weight_decay * p               if weight_decay != 0
        v = rho * v + (1 - rho) * g * g
        delta = sqrt(u + eps) / sqrt(v + eps) * g          (eps inside both roots)
        u = rho * u + (1 - rho) * delta * delta
        p = p - lr * delta
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = g + weight_decay * p
    v = v * rho + (one_minus_rho * g) * g
    std = math.sqrt(v + eps)
    delta = (math.sqrt(u + eps) / std) * g
    u = u * rho + (one_minus_rho * delta) * delta
    p = p + neg_lr * delta
    return p, v, u


adadelta_span = element_span("adadelta_span", adadelta_rule, 2, Scalars, Columns, Flags)


adadelta_prepare = element_prepare("adadelta_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (the update does not read it)."""


RULE = Rule(name="adadelta", span=adadelta_span, prepare=adadelta_prepare,
            helpers=(adadelta_rule,), slots=("square_avg", "acc_delta"),
            columns={"step": "int64"}, scalars=Scalars, flags=Flags)
