"""Adam and AdamW (torch.optim.Adam / AdamW): AdamW is this rule with ``decoupled`` set."""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import Off, element_prepare, element_reduce, element_span
from ..layouts import positions
from ..rule import Rule
from .caution import REDUCTIONS, caution_finalize, cautious
from .moments import MomentScalars, bias_correction, nearer_lerp, square_ema


Scalars = MomentScalars


class PrepareScalars(NamedTuple):
    lr: float
    beta1: float
    beta2: float


class Flags(NamedTuple):
    has_weight_decay: bool
    decoupled: bool
    amsgrad: bool
    maximize: bool
    lerp_from_end: bool
    caution: bool


class Columns(NamedTuple):
    step: int
    neg_step_size: float
    bias_correction2_sqrt: float
    caution_scale: float


C = positions(Columns)


def adam_moment(p, g, m, lerp_coefficient, weight_decay, has_weight_decay, decoupled,
                maximize, lerp_from_end):
    """The gradient the moments see (``-g`` if maximize, plus Adam's L2 term) and the new
    first moment ``lerp(m, g, 1 - beta1)``; returns ``(g, m)``."""
    if maximize:
        g = -g
    if has_weight_decay and not decoupled:
        g = fma(p, weight_decay, g)
    return g, nearer_lerp(m, g, lerp_coefficient, lerp_from_end)


def adam_rule(p, g, m, v, v_max, neg_step_size, bias_correction2_sqrt, lerp_coefficient,
              beta2, one_minus_beta2, eps, weight_decay, decoupled_decay_factor,
              has_weight_decay, decoupled, amsgrad, maximize, lerp_from_end, caution,
              caution_scale):
    """One Adam/AdamW element update; returns ``(p, m, v, v_max)``.

    AdamW is this rule with ``decoupled=True``. With ``t`` the parameter's own step count::

        g = -g                                         if maximize
        p = p * (1 - lr * weight_decay)                if weight_decay != 0 and decoupled (AdamW)
        g = g + weight_decay * p                       if weight_decay != 0 and not decoupled (Adam)
        m = lerp(m, g, 1 - beta1)                      (torch's lerp, see below)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                          if amsgrad (raw, uncorrected v)
        denom = sqrt(v_max or v) / sqrt(1 - beta2**t) + eps
        u = m * (caution_scale if m * g > 0 else 0)    if caution (timm's, see caution.py)
        p = p - (lr / (1 - beta1**t)) * (u or m) / denom

    The lerp is computed as torch's kernel does, from the nearer end: with ``w = 1 - beta1``,
    ``m + w * (g - m)`` when ``w < 0.5``, else ``g + (w - 1) * (g - m)`` (``lerp_from_end``);
    ``lerp_coefficient`` is ``w`` or ``w - 1`` accordingly. (With beta1 = 0 the moment is
    then exactly the gradient, as in torch.)

    Rounded as torch's CPU kernels: the L2 decay (``add`` with alpha), the lerp and the last
    step of ``v``'s ``addcmul`` are fused multiply-adds; the update is ``addcdiv``
    (``(neg_step_size * m) / denom``, then added).
    """
    if has_weight_decay and decoupled:
        p = p * decoupled_decay_factor
    g, m = adam_moment(p, g, m, lerp_coefficient, weight_decay, has_weight_decay, decoupled,
                       maximize, lerp_from_end)
    v = square_ema(v, g, beta2, one_minus_beta2)
    if amsgrad:
        # torch.maximum propagates NaN; "not (v_max >= v)" keeps that.
        if not (v_max >= v):
            v_max = v
        denom = math.sqrt(v_max) / bias_correction2_sqrt + eps
    else:
        denom = math.sqrt(v) / bias_correction2_sqrt + eps
    u = cautious(m, g, caution_scale) if caution else m
    p = p + (neg_step_size * u) / denom
    return p, m, v, v_max


# amsgrad and caution choose the loop, each a constant in its call (the loops without caution
# are the plain Adam loops); they are Rule.variants: the CPU compiles only the loop a
# configuration takes. Without amsgrad v_max is neither read nor written, which keeps the loop
# within LLVM's alias-check limit so that it vectorises.
adam_span = element_span("adam_span", adam_rule, 3, Scalars, Columns, Flags,
                         branches={"amsgrad": Off(unread=("v_max",), unwritten=("v_max",)),
                                   "caution": Off()})


def adam_agrees(p, g, m, lerp_coefficient, weight_decay, has_weight_decay, decoupled,
                maximize, lerp_from_end):
    """For ``caution``: whether the element's new ``m`` agrees in sign with its ``g`` (the
    ``g`` and ``m`` the span computes; nothing stored), and 1: the reduce counts both."""
    gi, mi = adam_moment(p, g, m, lerp_coefficient, weight_decay, has_weight_decay, decoupled,
                         maximize, lerp_from_end)
    return mi * gi > 0, 1


adam_reduce = element_reduce("adam_reduce", adam_agrees, 1, 2, Scalars, Columns, Flags,
                             counts=True)


def adam_finalize(present, columns, scalars, flags, start, stop, stride, sums):
    caution_finalize(present, columns[C.caution_scale], sums, start, stop, stride)


def adam_per_step(t, lr, beta1, beta2):
    """A parameter's bias corrections at its step ``t``, formed in float64 as torch does in
    Python (the literals too), then stored in the buffer's dtype: ``neg_step_size =
    -lr / (1 - beta1**t)``, ``bias_correction2_sqrt = sqrt(1 - beta2**t)``."""
    return -(lr / bias_correction(beta1, t)), bias_correction(beta2, t) ** 0.5


adam_prepare = element_prepare("adam_prepare", adam_per_step,
                               ("neg_step_size", "bias_correction2_sqrt"), PrepareScalars,
                               Columns, Flags)


RULE = Rule(name="adam", span=adam_span, prepare=adam_prepare,
            helpers=(adam_per_step, bias_correction, nearer_lerp, square_ema, cautious, adam_moment,
                     adam_agrees, adam_rule, caution_finalize),
            slots=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
            columns={"step": "int64", "neg_step_size": "param",
                     "bias_correction2_sqrt": "param", "caution_scale": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags,
            reduce=adam_reduce, finalize=adam_finalize, reductions=REDUCTIONS,
            reduce_flag="caution", variants=("amsgrad", "caution"))
