"""Schedule-Free SGD, AdamW and RAdam (Defazio et al. 2024, facebookresearch's
``schedulefree``): the parameters hold ``y``, an interpolation between the SGD iterate ``z``
(a state slot) and the average ``x``, which is never stored: ``opt.eval()`` moves the
parameters to ``x`` and ``opt.train()`` back to ``y``, in one pass over each buffer (``SWITCH``
below, run through the backends' chunk walk like a rule).

One element body serves the three optimizers: AdamW and RAdam share ``RULE_ADAM`` (slots
``z`` and ``exp_avg_sq``; RAdam's rectification only changes the group's scalars and whether
the gradient is normalised), SGD has ``RULE_SGD`` (slot ``z``). Every group-level number (the
warm-up or rectified lr, the averaging weight ``ckp1``) is formed in Python by the optimizer
from the group's counters, as the reference does, and reaches the kernel as a scalar in the
buffer's dtype.
"""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..layouts import positions
from ..rule import Rule
from .fresh import mark_first_steps
from .moments import nearer_lerp, square_ema


class Scalars(NamedTuple):
    lerp_coefficient: float
    """ckp1, or ckp1 - 1 when torch's lerp works from ``z``'s end (ckp1 >= 0.5)."""
    lerp_from_end: float
    """1 or 0: a scalar, not a flag, because it depends on ckp1 rounded to the buffer's
    dtype (torch decides on the rounded weight)."""
    y_lr: float
    """lr * (beta1 * (1 - ckp1) - 1): the gradient's weight in y's update."""
    neg_lr: float
    weight_decay: float
    beta2: float
    one_minus_beta2: float
    bias_correction2: float
    eps: float


class Flags(NamedTuple):
    adaptive: bool
    """Adam's second moment (AdamW, RAdam)."""
    normalize: bool
    """The gradient divided by sqrt(v / bias_correction2) + eps (RAdam: once rho_t > 4)."""
    has_weight_decay: bool


class Columns(NamedTuple):
    initialized: int
    first: int


S, F, C = positions(Scalars), positions(Flags), positions(Columns)


def schedulefree_rule(y, g, z, v, first, lerp_coefficient, y_lr, neg_lr, weight_decay, beta2,
                      one_minus_beta2, bias_correction2, eps, adaptive, normalize,
                      has_weight_decay, lerp_from_end):
    """One element of a schedule-free step; returns ``(y, z, v)``::

        z = y                                     the parameter's first step (z = clone(p))
        v = beta2 * v + (1 - beta2) * g * g       adaptive (AdamW, RAdam)
        g = g / (sqrt(v / bias_correction2) + eps)     normalize
        g = g + weight_decay * y                  weight decay at y (L2, into the gradient)
        y = lerp(y, z, ckp1)
        y = y + lr * (beta1 * (1 - ckp1) - 1) * g
        z = z - lr * g

    Rounded as the reference's single-tensor path on torch's CPU kernels: ``addcmul``'s last
    step, ``add`` with alpha, ``sub`` with alpha and ``lerp`` (from the nearer end) are fused
    multiply-adds; the denominator is ``div``, ``sqrt``, ``add`` rounded one by one.
    """
    if first:
        z = y
    if adaptive:
        v = square_ema(v, g, beta2, one_minus_beta2)
        if normalize:
            g = g / (math.sqrt(v / bias_correction2) + eps)
    if has_weight_decay:
        g = fma(y, weight_decay, g)
    y = nearer_lerp(y, z, lerp_coefficient, lerp_from_end)
    y = fma(g, y_lr, y)
    z = fma(g, neg_lr, z)
    return y, z, v


def schedulefree_walk(y, g, z, v, adaptive, scalars, columns, flags, k, start, stop, stride):
    """The body over a span; without ``adaptive`` (SGD) ``v`` is neither read nor written."""
    first = columns[C.first][k] != 0
    lerp_coefficient = scalars[S.lerp_coefficient]
    lerp_from_end = scalars[S.lerp_from_end] != 0
    y_lr = scalars[S.y_lr]
    neg_lr = scalars[S.neg_lr]
    weight_decay = scalars[S.weight_decay]
    beta2 = scalars[S.beta2]
    one_minus_beta2 = scalars[S.one_minus_beta2]
    bias_correction2 = scalars[S.bias_correction2]
    eps = scalars[S.eps]
    normalize = flags[F.normalize]
    has_weight_decay = flags[F.has_weight_decay]
    if adaptive:
        for i in range(start, stop, stride):
            y[i], z[i], v[i] = schedulefree_rule(
                y[i], g[i], z[i], v[i], first, lerp_coefficient, y_lr, neg_lr, weight_decay,
                beta2, one_minus_beta2, bias_correction2, eps, True, normalize,
                has_weight_decay, lerp_from_end)
    else:
        for i in range(start, stop, stride):
            y[i], z[i], _ = schedulefree_rule(
                y[i], g[i], z[i], g[i], first, lerp_coefficient, y_lr, neg_lr, weight_decay,
                beta2, one_minus_beta2, bias_correction2, eps, False, False,
                has_weight_decay, lerp_from_end)


def schedulefree_adam_span(arrays, scalars, columns, flags, k, start, stop, stride):
    y, g, z, v = arrays
    schedulefree_walk(y, g, z, v, True, scalars, columns, flags, k, start, stop, stride)


def schedulefree_sgd_span(arrays, scalars, columns, flags, k, start, stop, stride):
    y, g, z = arrays
    schedulefree_walk(y, g, z, g, False, scalars, columns, flags, k, start, stop, stride)


def schedulefree_prepare(present, columns, scalars, flags, start, stop, stride):
    """A parameter's first step with a gradient seeds ``z`` with its value (the reference's
    ``state['z'] = clone(p)``); the step counts are the group's, kept by the optimizer."""
    mark_first_steps(present, columns[C.initialized], columns[C.first], start, stop, stride)


_COLUMNS = {"initialized": "uint8", "first": "uint8"}
_HELPERS = (schedulefree_walk, schedulefree_rule, nearer_lerp, square_ema, mark_first_steps)

RULE_ADAM = Rule(name="schedulefree_adam", span=schedulefree_adam_span,
                 prepare=schedulefree_prepare, helpers=_HELPERS,
                 slots=("z", "exp_avg_sq"), columns=_COLUMNS, scalars=Scalars, flags=Flags)
"""ScheduleFreeAdamW and ScheduleFreeRAdam."""

RULE_SGD = Rule(name="schedulefree_sgd", span=schedulefree_sgd_span,
                prepare=schedulefree_prepare, helpers=_HELPERS,
                slots=("z",), columns=_COLUMNS, scalars=Scalars, flags=Flags)


# ----------------------------------------------------------------------------- train / eval
class SwitchScalars(NamedTuple):
    coefficient: float
    """w, or w - 1 when torch's lerp works from ``z``'s end (|w| >= 0.5); w = 1 - 1/beta1
    (to x, eval) or 1 - beta1 (to y, train)."""


class SwitchFlags(NamedTuple):
    from_end: bool


W, G = positions(SwitchScalars), positions(SwitchFlags)


def switch_span(arrays, scalars, columns, flags, k, start, stop, stride):
    """``p = lerp(p, z, w)`` over a parameter that has state: the reference's
    ``p.lerp_(end=z, weight=w)``, a fused multiply-add from the nearer end."""
    p = arrays[0]
    z = arrays[2]
    coefficient = scalars[W.coefficient]
    if flags[G.from_end]:
        for i in range(start, stop, stride):
            p[i] = fma(coefficient, z[i] - p[i], z[i])
    else:
        for i in range(start, stop, stride):
            p[i] = fma(coefficient, z[i] - p[i], p[i])


def switch_prepare(present, columns, scalars, flags, start, stop, stride):
    pass


SWITCH = Rule(name="schedulefree_switch", span=switch_span, prepare=switch_prepare,
              helpers=(), slots=("z",), columns={}, scalars=SwitchScalars, flags=SwitchFlags)
"""Run over the parameters that have state (``present`` = the marker column), with arrays
``(params, grads, z)``: ``Optimizer._map_state``."""
