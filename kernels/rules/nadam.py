"""NAdam (torch.optim.NAdam): Adam with Nesterov momentum and a momentum schedule (Dozat 2016)."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare, element_span
from .moments import MomentFlags, MomentScalars, moment_rule, unfused_moments


Scalars = MomentScalars


class PrepareScalars(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    momentum_decay: float


Flags = MomentFlags


class Columns(NamedTuple):
    step: int
    mu_product: float
    bias_correction2: float
    grad_coefficient: float
    exp_avg_coefficient: float


def nadam_rule(p, g, m, v, bias_correction2, grad_coefficient, exp_avg_coefficient,
               lerp_coefficient, beta2, one_minus_beta2, eps, weight_decay,
               decoupled_decay_factor, has_weight_decay, decoupled, maximize, lerp_from_end):
    """One NAdam element update; returns ``(p, m, v)``.

    With the per-parameter values of :func:`nadam_per_step`::

        g = -g                                         if maximize
        p = p * (1 - lr * weight_decay)                if weight_decay != 0 and decoupled
        g = g + weight_decay * p                       if weight_decay != 0 and not decoupled
        m = lerp(m, g, 1 - beta1)                      (torch's lerp, as Adam)
        v = beta2 * v + (1 - beta2) * g * g
        denom = sqrt(v / (1 - beta2**t)) + eps
        p = p + (-lr * (1 - mu_t) / (1 - mu_product_t)) * g / denom
        p = p + (-lr * mu_{t+1} / (1 - mu_product_t * mu_{t+1})) * m / denom

    in torch's order (two ``addcdiv``: the coefficient times the numerator, divided by
    ``denom``, then added).
    """
    p, g, m, v = unfused_moments(p, g, m, v, lerp_coefficient, beta2, one_minus_beta2,
                                 weight_decay, decoupled_decay_factor, has_weight_decay,
                                 decoupled, maximize, lerp_from_end)
    denom = math.sqrt(v / bias_correction2) + eps
    p = p + (grad_coefficient * g) / denom
    p = p + (exp_avg_coefficient * m) / denom
    return p, m, v


nadam_span = element_span("nadam_span", nadam_rule, 2, Scalars, Columns, Flags)


def nadam_per_step(t, mu_product, lr, beta1, beta2, momentum_decay):
    """A parameter's ``mu_product`` (set to 1 when ``t`` becomes 1, as torch creates it) and
    its values at step ``t``, formed in float64 as torch does in Python (the literals too)::

        mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        mu_product = mu_product * mu_t
        bias_correction2 = 1 - beta2**t
        grad_coefficient = -lr * (1 - mu_t) / (1 - mu_product)
        exp_avg_coefficient = (-lr * mu_next) / (1 - mu_product * mu_next)

    The last three are stored in the buffer's dtype.
    """
    if t == 1.0:
        mu_product = 1.0
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1.0) * momentum_decay)))
    product = mu_product * mu
    return (product, 1.0 - beta2 ** t, -lr * (1.0 - mu) / (1.0 - product),
            (-lr * mu_next) / (1.0 - product * mu_next))


nadam_prepare = element_prepare("nadam_prepare", nadam_per_step,
                                ("mu_product", "bias_correction2", "grad_coefficient",
                                 "exp_avg_coefficient"), PrepareScalars, Columns, Flags)


RULE = moment_rule("nadam", nadam_span, nadam_prepare, (nadam_rule, nadam_per_step),
                   {"step": "int64", "mu_product": "float64", "bias_correction2": "param",
                    "grad_coefficient": "param", "exp_avg_coefficient": "param"},
                   Scalars, PrepareScalars)
