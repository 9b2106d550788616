"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")."""

from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import Off, element_prepare, element_reduce, element_span
from ..layouts import positions
from ..rule import Rule
from .caution import REDUCTIONS, caution_finalize


class Scalars(NamedTuple):
    neg_lr: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    decay_factor: float


class Flags(NamedTuple):
    has_weight_decay: bool
    maximize: bool
    caution: bool


class Columns(NamedTuple):
    step: int
    caution_scale: float


C = positions(Columns)


def lion_direction(g, m, beta1, one_minus_beta1, maximize):
    """The gradient (``-g`` if maximize) and the direction ``c = beta1 * m + (1 - beta1) *
    g``; returns ``(g, c)``."""
    if maximize:
        g = -g
    return g, beta1 * m + one_minus_beta1 * g


def lion_agrees(c, g):
    """timm's cautious mask for Lion, ``sign(c) * g > 0`` (the sign, not ``c``: no underflow)."""
    return ((c > 0) & (g > 0)) | ((c < 0) & (g < 0))  # no short circuit: no branches


def lion_rule(p, g, m, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor,
              has_weight_decay, maximize, caution, caution_scale):
    """One Lion element update; returns ``(p, m)``::

        g = -g                                       if maximize
        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay)              if weight_decay != 0 (decoupled)
        u = sign(c)                                  (sign(0) = 0, and 0 for NaN, as torch.sign)
        u = u * caution_scale if u * g > 0 else 0    if caution (timm's, see caution.py)
        p = p - lr * u
        m = beta2 * m + (1 - beta2) * g

    A kept cautious update is torch's ``add`` with alpha, a fused multiply-add.
    """
    g, c = lion_direction(g, m, beta1, one_minus_beta1, maximize)
    if has_weight_decay:
        p = p * decay_factor
    if caution:
        # a masked element adds (-lr) * 0: p is unchanged
        if lion_agrees(c, g):
            p = fma(caution_scale if c > 0 else -caution_scale, neg_lr, p)
    elif c > 0:
        p = p + neg_lr
    elif c < 0:
        p = p - neg_lr
    m = beta2 * m + one_minus_beta2 * g
    return p, m


# caution as a constant in each call: the loop without it is the plain Lion loop
lion_span = element_span("lion_span", lion_rule, 1, Scalars, Columns, Flags,
                         branches={"caution": Off()})


def lion_agreement(p, g, m, beta1, one_minus_beta1, maximize):
    """For ``caution``: whether ``sign(c) * g > 0`` for the element (nothing stored), and 1:
    the reduce counts both."""
    gi, c = lion_direction(g, m, beta1, one_minus_beta1, maximize)
    return lion_agrees(c, gi), 1


lion_reduce = element_reduce("lion_reduce", lion_agreement, 1, 2, Scalars, Columns, Flags,
                             counts=True)


def lion_finalize(present, columns, scalars, flags, start, stop, stride, sums):
    caution_finalize(present, columns[C.caution_scale], sums, start, stop, stride)


lion_prepare = element_prepare("lion_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (the update does not read it)."""


RULE = Rule(name="lion", span=lion_span, prepare=lion_prepare,
            helpers=(lion_direction, lion_agrees, lion_agreement, lion_rule, caution_finalize),
            slots=("exp_avg",), columns={"step": "int64", "caution_scale": "param"},
            scalars=Scalars, flags=Flags, reduce=lion_reduce, finalize=lion_finalize,
            reductions=REDUCTIONS, reduce_flag="caution", variants=("caution",))
