"""Adamax (torch.optim.Adamax): Adam with an infinity-norm second moment."""

from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import element_prepare, element_span
from ..layouts import positions
from ..rule import Rule
from .moments import bias_correction, nearer_lerp


class Scalars(NamedTuple):
    lerp_coefficient: float
    beta2: float
    eps: float
    weight_decay: float


class PrepareScalars(NamedTuple):
    lr: float
    beta1: float


class Flags(NamedTuple):
    has_weight_decay: bool
    maximize: bool
    lerp_from_end: bool


class Columns(NamedTuple):
    step: int
    neg_step_size: float


P, C = positions(PrepareScalars), positions(Columns)


def adamax_rule(p, g, m, u, neg_step_size, lerp_coefficient, beta2, eps, weight_decay,
                has_weight_decay, maximize, lerp_from_end):
    """One Adamax element update; returns ``(p, m, u)`` (``u`` is torch's ``exp_inf``).

    With ``t`` the parameter's own step count::

        g = -g                                 if maximize
        g = g + weight_decay * p               if weight_decay != 0
        m = lerp(m, g, 1 - beta1)              (torch's lerp, from the nearer end, as Adam)
        u = max(beta2 * u, |g| + eps)          (NaN in either propagates, as torch.maximum)
        p = p - (lr / (1 - beta1**t)) * m / u

    Rounded as torch's single-tensor Adamax: the L2 decay and the lerp are fused
    multiply-adds (ATen's ``add`` with alpha and ``lerp``).
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = fma(p, weight_decay, g)
    m = nearer_lerp(m, g, lerp_coefficient, lerp_from_end)
    u = u * beta2
    bound = abs(g) + eps
    if bound > u or bound != bound:  # torch.maximum: a NaN on either side wins
        u = bound
    p = p + (neg_step_size * m) / u
    return p, m, u


adamax_span = element_span("adamax_span", adamax_rule, 2, Scalars, Columns, Flags)


def adamax_per_step(t, lr, beta1):
    """``neg_step_size = -lr / (1 - beta1**t)``, formed in float64 as torch does in Python."""
    return (-(lr / bias_correction(beta1, t)),)


adamax_prepare = element_prepare("adamax_prepare", adamax_per_step, ("neg_step_size",),
                                 PrepareScalars, Columns)


RULE = Rule(name="adamax", span=adamax_span, prepare=adamax_prepare,
            helpers=(adamax_per_step, bias_correction, nearer_lerp, adamax_rule),
            slots=("exp_avg", "exp_inf"),
            columns={"step": "int64", "neg_step_size": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
