"""AdEMAMix (Pagliardini et al. 2024), as bitsandbytes' ``_ReferenceAdEMAMix``: Adam's moments
plus a slow EMA of the gradient mixed into the numerator."""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import element_span
from ..layouts import positions
from ..rule import Rule
from .moments import square_ema


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


C = positions(Columns)


def ademamix_rule(p, g, m1, m2, nu, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3,
                  one_minus_beta3, bias_correction1, bias_correction2_sqrt, eps, alpha,
                  weight_decay, neg_lr):
    """One element; returns ``(p, m1, m2, nu)``. Rounded as torch's CPU kernels: ``mul_``
    then ``add_`` with alpha (a fused multiply-add), ``addcmul_``'s last step fused, the
    rest one operation at a time in the reference's order."""
    m1 = fma(g, one_minus_beta1, m1 * beta1)
    m2 = fma(g, one_minus_beta3, m2 * beta3)
    nu = square_ema(nu, g, beta2, one_minus_beta2)
    denom = math.sqrt(nu) / bias_correction2_sqrt + eps
    update = (m1 / bias_correction1 + alpha * m2) / denom
    update = fma(p, weight_decay, update)
    return p + neg_lr * update, m1, m2, nu


ademamix_span = element_span("ademamix_span", ademamix_rule, 3, Scalars)


def ademamix_prepare(present, columns, scalars, flags, start, stop, stride):
    """Marks parameters with state (the step count is the group's, in the scalars)."""
    initialized = columns[C.initialized]
    for k in range(start, stop, stride):
        if present[k] != 0:
            initialized[k] = 1


RULE = Rule(name="ademamix", span=ademamix_span, prepare=ademamix_prepare,
            helpers=(ademamix_rule, square_ema), slots=("m1", "m2", "nu"),
            columns={"initialized": "uint8"}, scalars=Scalars)
