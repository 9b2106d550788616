"""AdEMAMix (Pagliardini et al. 2024), as bitsandbytes' ``_ReferenceAdEMAMix``: Adam's moments
plus a slow EMA of the gradient mixed into the numerator."""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..rule import Rule, positions


class Scalars(NamedTuple):
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    beta3: float
    one_minus_beta3: float
    bias_correction1: float
    bias_correction2_sqrt: float
    eps: float
    alpha: float
    weight_decay: float
    neg_lr: float


class Columns(NamedTuple):
    initialized: int


S, C = positions(Scalars), positions(Columns)


def ademamix_rule(p, g, m1, m2, nu, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3,
                  one_minus_beta3, bias_correction1, bias_correction2_sqrt, eps, alpha,
                  weight_decay, neg_lr):
    """One element; returns ``(p, m1, m2, nu)``. Rounded as torch's CPU kernels: ``mul_``
    then ``add_`` with alpha (a fused multiply-add), ``addcmul_``'s last step fused, the
    rest one operation at a time in the reference's order."""
    m1 = fma(g, one_minus_beta1, m1 * beta1)
    m2 = fma(g, one_minus_beta3, m2 * beta3)
    nu = fma(one_minus_beta2 * g, g, nu * beta2)
    denom = math.sqrt(nu) / bias_correction2_sqrt + eps
    update = (m1 / bias_correction1 + alpha * m2) / denom
    update = fma(p, weight_decay, update)
    return p + neg_lr * update, m1, m2, nu


def ademamix_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, m1, m2, nu = arrays
    beta1 = scalars[S.beta1]
    one_minus_beta1 = scalars[S.one_minus_beta1]
    beta2 = scalars[S.beta2]
    one_minus_beta2 = scalars[S.one_minus_beta2]
    beta3 = scalars[S.beta3]
    one_minus_beta3 = scalars[S.one_minus_beta3]
    bc1 = scalars[S.bias_correction1]
    bc2_sqrt = scalars[S.bias_correction2_sqrt]
    eps = scalars[S.eps]
    alpha = scalars[S.alpha]
    weight_decay = scalars[S.weight_decay]
    neg_lr = scalars[S.neg_lr]
    for i in range(start, stop, stride):
        p[i], m1[i], m2[i], nu[i] = ademamix_rule(
            p[i], g[i], m1[i], m2[i], nu[i], beta1, one_minus_beta1, beta2, one_minus_beta2,
            beta3, one_minus_beta3, bc1, bc2_sqrt, eps, alpha, weight_decay, neg_lr)


def ademamix_prepare(present, columns, scalars, flags, start, stop, stride):
    """Marks parameters with state (the step count is the group's, in the scalars)."""
    initialized = columns[C.initialized]
    for k in range(start, stop, stride):
        if present[k] != 0:
            initialized[k] = 1


RULE = Rule(name="ademamix", span=ademamix_span, prepare=ademamix_prepare,
            helpers=(ademamix_rule,), slots=("m1", "m2", "nu"),
            columns={"initialized": "uint8"}, scalars=Scalars)
