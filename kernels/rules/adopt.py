"""ADOPT (Taniguchi et al. 2024), as timm's ``Adopt``: the second moment is updated after the
step, so the step uses the gradient normalised by the previous one; a parameter's first step
only seeds the second moment."""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import element_prepare, element_reduce, element_span
from ..layouts import positions
from ..rule import Rule
from .caution import REDUCTIONS, caution_finalize, cautious
from .moments import nearer_lerp, square_ema


class Scalars(NamedTuple):
    neg_lr: float
    lerp_coefficient: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    neg_lr_weight_decay: float


class PrepareScalars(NamedTuple):
    clip_exp: float


class Flags(NamedTuple):
    has_weight_decay: bool
    decoupled: bool
    clip: bool
    maximize: bool
    lerp_from_end: bool
    caution: bool


class Columns(NamedTuple):
    step: int
    first: int
    clip_value: float
    caution_scale: float


S, P, F, C = (positions(Scalars), positions(PrepareScalars), positions(Flags),
              positions(Columns))


def adopt_gradient(p, g, weight_decay, has_weight_decay, decoupled, maximize):
    """The gradient the moments see: ``-g`` if maximize, plus the L2 term when not
    decoupled."""
    if maximize:
        g = -g
    if has_weight_decay and not decoupled:
        g = fma(p, weight_decay, g)
    return g


def adopt_moment(g, m, v, clip_value, lerp_coefficient, eps, clip, lerp_from_end):
    """The new first moment ``lerp(m, clamp(g / max(sqrt(v), eps), -c, c), 1 - beta1)``
    (from the previous second moment)."""
    root = math.sqrt(v)
    n = g / (eps if root < eps else root)
    if clip:
        if n < -clip_value:
            n = -clip_value
        elif n > clip_value:
            n = clip_value
    return nearer_lerp(m, n, lerp_coefficient, lerp_from_end)


def adopt_rule(p, g, m, v, first, clip_value, neg_lr, lerp_coefficient, beta2,
               one_minus_beta2, eps, weight_decay, neg_lr_weight_decay, has_weight_decay,
               decoupled, clip, maximize, lerp_from_end, caution, caution_scale):
    """One ADOPT element update; returns ``(p, m, v)``. With ``t`` the parameter's own step
    count::

        g = -g                                   if maximize
        g = g + weight_decay * p                 if weight_decay != 0 and not decoupled
        t == 1:  v = v + g * g                   (nothing else: the first step seeds v)
        t > 1:   p = p - lr * weight_decay * p   if weight_decay != 0 and decoupled
                 n = g / max(sqrt(v), eps)
                 n = clamp(n, -c, c)             c = (t - 1) ** clip_exp, unless clip_exp None
                 m = lerp(m, n, 1 - beta1)       (torch's lerp, from the nearer end)
                 u = m * (caution_scale if m * g > 0 else 0)   if caution (see caution.py)
                 p = p - lr * (u or m)
                 v = beta2 * v + (1 - beta2) * g * g

    Rounded as timm's single-tensor path on torch's CPU kernels (``add`` with alpha, ``lerp``
    and ``addcmul``'s last step are fused multiply-adds); clamps keep NaN, as torch's do.
    """
    g = adopt_gradient(p, g, weight_decay, has_weight_decay, decoupled, maximize)
    if first:
        return p, m, fma(g, g, v)
    if has_weight_decay and decoupled:
        p = fma(p, neg_lr_weight_decay, p)
    m = adopt_moment(g, m, v, clip_value, lerp_coefficient, eps, clip, lerp_from_end)
    u = cautious(m, g, caution_scale) if caution else m
    p = fma(u, neg_lr, p)
    v = square_ema(v, g, beta2, one_minus_beta2)
    return p, m, v


adopt_span = element_span("adopt_span", adopt_rule, 2, Scalars, Columns, Flags)


def adopt_agrees(p, g, m, v, first, clip_value, lerp_coefficient, eps, weight_decay,
                 has_weight_decay, decoupled, clip, maximize, lerp_from_end):
    """For ``caution``: whether the element's new ``m`` agrees in sign with its ``g`` (the
    ``g`` and ``m`` the span computes; nothing stored), and 1: the reduce counts both. A
    first step moves nothing: it counts nothing."""
    if first:
        return False, 0
    gi = adopt_gradient(p, g, weight_decay, has_weight_decay, decoupled, maximize)
    mi = adopt_moment(gi, m, v, clip_value, lerp_coefficient, eps, clip, lerp_from_end)
    return mi * gi > 0, 1


adopt_reduce = element_reduce("adopt_reduce", adopt_agrees, 2, 2, Scalars, Columns, Flags,
                              counts=True)


def adopt_finalize(present, columns, scalars, flags, start, stop, stride, sums):
    caution_finalize(present, columns[C.caution_scale], sums, start, stop, stride)


def adopt_per_step(t, clip_exp, clip):
    """Whether this is the parameter's first step (which only seeds ``v``), and the clamp
    bound ``(t - 1) ** clip_exp``, formed in float64 as timm does in Python (torch rounds a
    clamp bound to the tensor's dtype)."""
    return t == 1.0, (t - 1.0) ** clip_exp if clip else 0.0


adopt_prepare = element_prepare("adopt_prepare", adopt_per_step, ("first", "clip_value"),
                                PrepareScalars, Columns, Flags)


RULE = Rule(name="adopt", span=adopt_span, prepare=adopt_prepare,
            helpers=(adopt_per_step, nearer_lerp, square_ema, cautious, adopt_agrees,
                     adopt_gradient, adopt_moment, adopt_rule, caution_finalize),
            slots=("exp_avg", "exp_avg_sq"),
            columns={"step": "int64", "first": "uint8", "clip_value": "param",
                     "caution_scale": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags,
            reduce=adopt_reduce, finalize=adopt_finalize, reductions=REDUCTIONS,
            reduce_flag="caution")
