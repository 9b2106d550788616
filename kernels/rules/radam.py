"""RAdam (torch.optim.RAdam): Adam with the variance rectification of Liu et al. (2020)."""

import math
from typing import NamedTuple

from ..elementwise import element_prepare, element_span
from ..layouts import positions
from .moments import MomentFlags, MomentScalars, bias_correction, moment_rule, unfused_moments


Scalars = NamedTuple("Scalars", [("lr", float), ("one", float),
                                 *MomentScalars.__annotations__.items()])
"""Adam's moment scalars after the lr and a one in the buffer's dtype (for torch's
reciprocal)."""


class PrepareScalars(NamedTuple):
    beta1: float
    beta2: float
    rho_inf: float


Flags = MomentFlags


class Columns(NamedTuple):
    step: int
    rectified: int
    bias_correction1: float
    bias_correction2_sqrt: float
    rect: float


P, C = positions(PrepareScalars), positions(Columns)


def radam_rule(p, g, m, v, rectified, bias_correction1, bias_correction2_sqrt, rect, lr, one,
               lerp_coefficient, beta2, one_minus_beta2, eps, weight_decay,
               decoupled_decay_factor, has_weight_decay, decoupled, maximize, lerp_from_end):
    """One RAdam element update; returns ``(p, m, v)``.

    With ``t`` the parameter's own step count and ``rectified``, ``rect`` from
    :func:`radam_prepare` (``rho_t > 5``)::

        g = -g                                         if maximize
        p = p * (1 - lr * weight_decay)                if weight_decay != 0 and decoupled
        g = g + weight_decay * p                       if weight_decay != 0 and not decoupled
        m = lerp(m, g, 1 - beta1)                      (torch's lerp, as Adam)
        v = beta2 * v + (1 - beta2) * g * g
        u = m / (1 - beta1**t) * lr
        u = u * (sqrt(1 - beta2**t) * (1 / (sqrt(v) + eps))) * rect      if rectified
        p = p - u

    in torch's order: ``bias_correction2**0.5 / (sqrt(v) + eps)`` is a Python float divided
    by a tensor, which torch computes as ``reciprocal() * value``.
    """
    p, g, m, v = unfused_moments(p, g, m, v, lerp_coefficient, beta2, one_minus_beta2,
                                 weight_decay, decoupled_decay_factor, has_weight_decay,
                                 decoupled, maximize, lerp_from_end)
    update = (m / bias_correction1) * lr
    if rectified:
        adaptive_lr = (one / (math.sqrt(v) + eps)) * bias_correction2_sqrt
        update = (update * adaptive_lr) * rect
    p = p - update
    return p, m, v


radam_span = element_span("radam_span", radam_rule, 2, Scalars, Columns, Flags)


def radam_per_step(t, beta1, beta2, rho_inf):
    """A parameter's values at its step ``t``, formed in float64 as torch does in Python::

        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        rho_t = rho_inf - 2 * t * beta2**t / bias_correction2
        rectified = rho_t > 5
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5

    with ``rho_inf = 2 / (1 - beta2) - 1``; the switch is per parameter, from its own ``t``.
    Returns ``(rectified, bias_correction1, sqrt(bias_correction2), rect)``, the last two 0
    when not rectified."""
    correction1 = bias_correction(beta1, t)
    correction2 = bias_correction(beta2, t)
    rho_t = rho_inf - 2.0 * t * (beta2 ** t) / correction2
    if rho_t > 5.0:
        return 1, correction1, correction2 ** 0.5, ((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                                                    / ((rho_inf - 4.0) * (rho_inf - 2.0)
                                                       * rho_t)) ** 0.5
    return 0, correction1, 0.0, 0.0


radam_prepare = element_prepare("radam_prepare", radam_per_step,
                                ("rectified", "bias_correction1", "bias_correction2_sqrt",
                                 "rect"), PrepareScalars, Columns)


RULE = moment_rule("radam", radam_span, radam_prepare,
                   (radam_per_step, bias_correction, radam_rule),
                   {"step": "int64", "rectified": "uint8", "bias_correction1": "param",
                    "bias_correction2_sqrt": "param", "rect": "param"},
                   Scalars, PrepareScalars)
