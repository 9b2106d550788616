"""The moments rules share. :func:`nearer_lerp`: torch's lerp as its CPU kernel computes it,
with the end chosen once per step (Adam's, Adamax's and ADOPT's first moment, schedule-free's
``y``; ``flatopt.blocks.lerp`` chooses it per call). :func:`unfused_moments`: Adam's
moments as NAdam and RAdam round them: the gradient the moments see (``-g`` with maximize,
plus the L2 term of coupled weight decay), decoupled weight decay of the parameter, ``m =
lerp(m, g, 1 - beta1)`` from the nearer end, and ``v = beta2 * v + (1 - beta2) * g * g``; with
the scalars they read (:class:`MomentScalars`). Listed among each rule's helpers
(``kernels/_bind.py`` compiles them over this module)."""

from typing import NamedTuple

from ..arithmetic import fma
from ..rule import Rule


class MomentScalars(NamedTuple):
    """The scalars of Adam's moments (a rule's ``Scalars``, or the start of them)."""

    lerp_coefficient: float
    """``w = 1 - beta1``, or ``w - 1`` when the lerp works from the gradient's end."""
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    decoupled_decay_factor: float
    """``1 - lr * weight_decay``."""


class MomentFlags(NamedTuple):
    """The switches of Adam's moments (a rule's ``Flags``)."""

    has_weight_decay: bool
    decoupled: bool
    maximize: bool
    lerp_from_end: bool


def nearer_lerp(start, end, coefficient, from_end):
    """torch's ``lerp(start, end, w)`` as its CPU kernel computes it: one fused multiply-add
    from the nearer end, ``start + w * (end - start)`` when ``w < 0.5``, else ``end + (w - 1) *
    (end - start)``; ``coefficient`` is ``w`` or ``w - 1`` accordingly (``from_end``). With ``w``
    = 1 the result is then exactly ``end``."""
    return fma(coefficient, end - start, end if from_end else start)


def square_ema(v, g, beta, one_minus_beta):
    """``beta * v + (1 - beta) * g * g`` rounded as torch's ``v.mul_(beta).addcmul_(g, g,
    value=1 - beta)``: ``v * beta`` rounded, then one fused multiply-add of ``(1 - beta) * g``
    (rounded) by ``g`` (Adam's, ADOPT's, AdEMAMix's and schedule-free's second moment)."""
    return fma(one_minus_beta * g, g, v * beta)


def bias_correction(beta, step):
    """``1 - beta ** step`` in float64, as torch forms it in Python (a per-step body's)."""
    return 1.0 - beta ** float(step)


def unfused_moments(p, g, m, v, lerp_coefficient, beta2, one_minus_beta2, weight_decay,
                    decoupled_decay_factor, has_weight_decay, decoupled, maximize,
                    lerp_from_end):
    """``(p, g, m, v)`` after maximize, weight decay and the moments, rounded as torch's NAdam
    and RAdam kernels: each multiply and add on its own (no fused multiply-add)."""
    if maximize:
        g = -g
    if has_weight_decay:
        if decoupled:
            p = p * decoupled_decay_factor
        else:
            g = g + weight_decay * p
    if lerp_from_end:
        m = g + lerp_coefficient * (g - m)
    else:
        m = m + lerp_coefficient * (g - m)
    v = v * beta2 + (one_minus_beta2 * g) * g
    return p, g, m, v


def moment_rule(name: str, span, prepare, helpers: tuple, columns: dict[str, str],
                scalars: type, prepare_scalars: type) -> Rule:
    """A rule on Adam's moments as NAdam and RAdam round them: its state the two moments
    (``exp_avg``, ``exp_avg_sq``), its switches :class:`MomentFlags`, and
    :func:`unfused_moments` among its ``helpers``."""
    return Rule(name=name, span=span, prepare=prepare, helpers=(*helpers, unfused_moments),
                slots=("exp_avg", "exp_avg_sq"), columns=columns, scalars=scalars,
                prepare_scalars=prepare_scalars, flags=MomentFlags)
