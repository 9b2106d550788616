"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), as apex's FusedLAMB:
Adam's moments, then a per-parameter trust ratio ||p|| / ||update||."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare, element_span
from ..layouts import positions
from ..rule import Rule


class Scalars(NamedTuple):
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float


class PrepareScalars(NamedTuple):
    lr: float
    beta1: float
    beta2: float


class Flags(NamedTuple):
    bias_correction: bool
    adapt: bool
    maximize: bool


class Columns(NamedTuple):
    step: int
    bias_correction1: float
    bias_correction2: float
    neg_step_size: float


S, P, F, C = (positions(Scalars), positions(PrepareScalars), positions(Flags),
              positions(Columns))


def lamb_direction(p, m, v, bias_correction1, bias_correction2, eps, weight_decay):
    """The update direction ``m_hat / (sqrt(v_hat) + eps) + weight_decay * p``."""
    return (m / bias_correction1) / (math.sqrt(v / bias_correction2) + eps) + weight_decay * p


def lamb_moments(mi, vi, gi, beta1, one_minus_beta1, beta2, one_minus_beta2):
    """The moments after one gradient: ``(beta1 * m + (1 - beta1) * g, beta2 * v + (1 -
    beta2) * g * g)``."""
    return beta1 * mi + one_minus_beta1 * gi, beta2 * vi + (one_minus_beta2 * gi) * gi


def lamb_reduce(arrays, scalars, columns, flags, k, start, stop, stride):
    """The totals of p**2 and direction**2 over the segment (float64), from the moments the
    step will store (this pass stores nothing: see ``Rule.reduce``)."""
    p, g, m, v = arrays
    beta1 = scalars[S.beta1]
    one_minus_beta1 = scalars[S.one_minus_beta1]
    beta2 = scalars[S.beta2]
    one_minus_beta2 = scalars[S.one_minus_beta2]
    eps = scalars[S.eps]
    weight_decay = scalars[S.weight_decay]
    bc1 = columns[C.bias_correction1][k]
    bc2 = columns[C.bias_correction2][k]
    maximize = flags[F.maximize]
    param_sq = 0.0
    direction_sq = 0.0
    for i in range(start, stop, stride):
        gi = -g[i] if maximize else g[i]
        mi, vi = lamb_moments(m[i], v[i], gi, beta1, one_minus_beta1, beta2, one_minus_beta2)
        r = lamb_direction(p[i], mi, vi, bc1, bc2, eps, weight_decay)
        param_sq += float(p[i]) * float(p[i])
        direction_sq += float(r) * float(r)
    return param_sq, direction_sq


def lamb_finalize(present, columns, scalars, flags, start, stop, stride, sums):
    """The step size ``lr * ||p|| / ||direction||`` (lr when either norm is zero, or when the
    ratio does not apply: no weight decay and not ``always_adapt``, as apex does)."""
    neg_step_size = columns[C.neg_step_size]
    for k in range(start, stop, stride):
        if present[k] != 0:
            ratio = 1.0
            if flags[F.adapt] and sums[k, 0] > 0 and sums[k, 1] > 0:
                ratio = math.sqrt(sums[k, 0]) / math.sqrt(sums[k, 1])
            neg_step_size[k] = -(scalars[P.lr] * ratio)


def lamb_rule(p, g, m, v, bias_correction1, bias_correction2, neg_step_size, beta1,
              one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, maximize):
    """One element: the moments, and the move along the direction by the finalized step
    size; returns ``(p, m, v)``."""
    g = -g if maximize else g
    m, v = lamb_moments(m, v, g, beta1, one_minus_beta1, beta2, one_minus_beta2)
    return (p + neg_step_size * lamb_direction(p, m, v, bias_correction1, bias_correction2,
                                               eps, weight_decay), m, v)


lamb_span = element_span("lamb_span", lamb_rule, 2, Scalars, Columns, Flags)


def lamb_per_step(t, beta1, beta2, bias_correction):
    """The bias corrections ``1 - beta**t`` (1 without bias correction), in float64."""
    if bias_correction:
        return 1.0 - beta1 ** t, 1.0 - beta2 ** t
    return 1.0, 1.0


lamb_prepare = element_prepare("lamb_prepare", lamb_per_step,
                               ("bias_correction1", "bias_correction2"), PrepareScalars,
                               Columns, Flags)


RULE = Rule(name="lamb", span=lamb_span, prepare=lamb_prepare,
            helpers=(lamb_per_step, lamb_moments, lamb_direction, lamb_rule),
            slots=("exp_avg", "exp_avg_sq"),
            columns={"step": "int64", "bias_correction1": "param",
                     "bias_correction2": "param", "neg_step_size": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags,
            reduce=lamb_reduce, finalize=lamb_finalize,
            reductions=("param_norm_sq", "direction_norm_sq"))
