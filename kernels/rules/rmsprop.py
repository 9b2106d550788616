"""RMSprop (torch.optim.RMSprop), centered or not, with or without momentum."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare
from ..rule import Rule, positions


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


S, F, C = positions(Scalars), positions(Flags), positions(Columns)


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


def rmsprop_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, v, buf, avg_g = arrays
    neg_lr = scalars[S.neg_lr]
    alpha = scalars[S.alpha]
    one_minus_alpha = scalars[S.one_minus_alpha]
    lerp_coefficient = scalars[S.lerp_coefficient]
    eps = scalars[S.eps]
    weight_decay = scalars[S.weight_decay]
    momentum = scalars[S.momentum]
    has_weight_decay = flags[F.has_weight_decay]
    maximize = flags[F.maximize]
    lerp_from_end = flags[F.lerp_from_end]
    # One loop per combination of the flags that decide which slots are read and written, so
    # that an unused slot (stood in for by the gradient buffer) is never touched and each
    # loop vectorises.
    if flags[F.centered]:
        if flags[F.has_momentum]:
            for i in range(start, stop, stride):
                p[i], v[i], buf[i], avg_g[i] = rmsprop_rule(
                    p[i], g[i], v[i], buf[i], avg_g[i], neg_lr, alpha, one_minus_alpha,
                    lerp_coefficient, eps, weight_decay, momentum, has_weight_decay, True,
                    True, maximize, lerp_from_end)
        else:
            for i in range(start, stop, stride):
                p[i], v[i], _, avg_g[i] = rmsprop_rule(
                    p[i], g[i], v[i], eps, avg_g[i], neg_lr, alpha, one_minus_alpha,
                    lerp_coefficient, eps, weight_decay, momentum, has_weight_decay, True,
                    False, maximize, lerp_from_end)
    else:
        if flags[F.has_momentum]:
            for i in range(start, stop, stride):
                p[i], v[i], buf[i], _ = rmsprop_rule(
                    p[i], g[i], v[i], buf[i], eps, neg_lr, alpha, one_minus_alpha,
                    lerp_coefficient, eps, weight_decay, momentum, has_weight_decay, False,
                    True, maximize, lerp_from_end)
        else:
            for i in range(start, stop, stride):
                p[i], v[i], _, _ = rmsprop_rule(
                    p[i], g[i], v[i], eps, eps, neg_lr, alpha, one_minus_alpha,
                    lerp_coefficient, eps, weight_decay, momentum, has_weight_decay, False,
                    False, maximize, lerp_from_end)


rmsprop_prepare = element_prepare("rmsprop_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (the update does not read it)."""


RULE = Rule(name="rmsprop", span=rmsprop_span, prepare=rmsprop_prepare,
            helpers=(rmsprop_rule,), slots=("square_avg", "momentum_buffer", "grad_avg"),
            columns={"step": "int64"}, scalars=Scalars, flags=Flags,
            variants=("centered", "has_momentum"))
