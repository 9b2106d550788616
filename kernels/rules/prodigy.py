"""Prodigy (Mishchenko & Defazio 2023), as ``prodigyopt.Prodigy``: Adam whose step size is d,
a running estimate of the distance to the solution made from sums over every parameter.

Two passes per step: ``prodigy_reduce`` sums, per parameter, ``<g, p0 - p>`` and ``|s|``
(of the ``s`` this step will store) without storing anything; the optimizer's ``combine``
adds them over every group and updates d (``Rule.global_reductions``); ``prodigy_span``
then updates the moments and ``s`` and moves the parameters with the new d.

Every scalar is written by ``combine`` at every step (d changes at every step, and the
reference takes betas, ``decouple`` and its bias correction from group 0 for all groups), so
the switches are scalars too: 1 or 0 in the buffer's dtype, read once before each loop.
"""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..layouts import positions
from ..rule import Rule
from .fresh import mark_first_steps


class Scalars(NamedTuple):
    beta1: float
    beta2: float
    beta3: float
    m_coefficient: float       # d * (1 - beta1), d before this step's update
    v_coefficient: float       # d * d * (1 - beta2)
    s_coefficient: float       # (d / d0) * dlr, or (d / d0) * d with safeguard_warmup
    weight_decay: float        # the coupled (L2) decay
    neg_decay_dlr: float       # -weight_decay * dlr, the decoupled decay
    neg_dlr: float
    d_eps: float               # new d * eps
    neg_dlr_d: float           # -dlr * new d (the update without a first moment)
    use_m: float               # beta1 > 0
    coupled: float             # weight_decay != 0 and not decouple
    decoupled: float           # weight_decay != 0 and decouple
    active: float              # the group's lr > 0: moments, s and sums updated
    move: float                # the d denominator was > 0: parameters move


class Columns(NamedTuple):
    step: int
    initialized: int
    fresh: int                 # state created this step: p0 is the parameter as it is


S, C = positions(Scalars), positions(Columns)


def prodigy_gradient(p, g, weight_decay, coupled):
    """The gradient with the coupled decay (torch's in-place ``grad.add_(p, alpha=wd)``)."""
    return fma(p, weight_decay, g) if coupled else g


def prodigy_rule(p, g, m, v, s, beta1, beta2, beta3, m_coefficient, v_coefficient,
                 s_coefficient, neg_decay_dlr, neg_dlr, d_eps, neg_dlr_d, use_m, decoupled,
                 active, move):
    """One element, ``g`` already decayed; returns ``(p, m, v, s)``. Rounded as torch's CPU
    kernels: ``mul_`` then ``add_`` with alpha fused, ``addcmul_``'s last step fused,
    ``addcdiv_`` as ``p + (value * m) / denom``."""
    if active:
        if use_m:
            m = fma(g, m_coefficient, m * beta1)
        v = fma(v_coefficient * g, g, v * beta2)
        s = fma(g, s_coefficient, s * beta3)
    if move:
        denom = math.sqrt(v) + d_eps
        if decoupled:
            p = fma(p, neg_decay_dlr, p)
        if use_m:
            p = p + (neg_dlr * m) / denom
        else:
            p = p + (neg_dlr_d * g) / denom
    return p, m, v, s


def prodigy_reduce(arrays, scalars, columns, flags, k, start, stop, stride):
    """``(sum of g * (p0 - p), sum of |s_new|)`` over the segment, in float64: the terms of
    the d estimate's numerator and denominator (zero for a group with lr 0, and the first for
    fresh state, whose p0 is p)."""
    p, g, m, v, s, p0 = arrays
    dot = 0.0
    total = 0.0
    if scalars[S.active] != 0:
        beta3 = scalars[S.beta3]
        s_coefficient = scalars[S.s_coefficient]
        weight_decay = scalars[S.weight_decay]
        coupled = scalars[S.coupled] != 0
        if columns[C.fresh][k] != 0:
            for i in range(start, stop, stride):
                gi = prodigy_gradient(p[i], g[i], weight_decay, coupled)
                total += abs(float(fma(gi, s_coefficient, s[i] * beta3)))
        else:
            for i in range(start, stop, stride):
                gi = prodigy_gradient(p[i], g[i], weight_decay, coupled)
                dot += float(gi) * float(p0[i] - p[i])
                total += abs(float(fma(gi, s_coefficient, s[i] * beta3)))
    return dot, total


def prodigy_span(arrays, scalars, columns, flags, k, start, stop, stride):
    """p0 recorded for fresh state, then the moments, s and the move."""
    p, g, m, v, s, p0 = arrays
    if columns[C.fresh][k] != 0:
        for i in range(start, stop, stride):
            p0[i] = p[i]
    beta1 = scalars[S.beta1]
    beta2 = scalars[S.beta2]
    beta3 = scalars[S.beta3]
    m_coefficient = scalars[S.m_coefficient]
    v_coefficient = scalars[S.v_coefficient]
    s_coefficient = scalars[S.s_coefficient]
    weight_decay = scalars[S.weight_decay]
    neg_decay_dlr = scalars[S.neg_decay_dlr]
    neg_dlr = scalars[S.neg_dlr]
    d_eps = scalars[S.d_eps]
    neg_dlr_d = scalars[S.neg_dlr_d]
    use_m = scalars[S.use_m] != 0
    coupled = scalars[S.coupled] != 0
    decoupled = scalars[S.decoupled] != 0
    active = scalars[S.active] != 0
    move = scalars[S.move] != 0
    for i in range(start, stop, stride):
        p[i], m[i], v[i], s[i] = prodigy_rule(
            p[i], prodigy_gradient(p[i], g[i], weight_decay, coupled), m[i], v[i], s[i],
            beta1, beta2, beta3, m_coefficient, v_coefficient, s_coefficient, neg_decay_dlr,
            neg_dlr, d_eps, neg_dlr_d, use_m, decoupled, active, move)


def prodigy_prepare(present, columns, scalars, flags, start, stop, stride):
    """Marks fresh state (its p0 is taken this step). The step count advances in
    ``combine``: not at all on a step whose d denominator is 0, as in the reference."""
    mark_first_steps(present, columns[C.initialized], columns[C.fresh], start, stop, stride)


RULE = Rule(name="prodigy", span=prodigy_span, prepare=prodigy_prepare,
            helpers=(prodigy_gradient, prodigy_rule, mark_first_steps),
            slots=("exp_avg", "exp_avg_sq", "s", "p0"),
            columns={"step": "int64", "initialized": "uint8", "fresh": "uint8"},
            scalars=Scalars, reduce=prodigy_reduce, reductions=("dot", "s_abs"),
            global_reductions=True)
