"""ASGD (torch.optim.ASGD): averaged SGD (Polyak & Juditsky 1992) with a decaying step size."""

from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import Off, element_prepare, element_span
from ..rule import Rule


class Scalars(NamedTuple):
    weight_decay: float


class PrepareScalars(NamedTuple):
    lr: float
    lambd: float
    alpha: float
    t0: float


class Flags(NamedTuple):
    has_weight_decay: bool
    maximize: bool


class Columns(NamedTuple):
    step: int
    eta: float
    mu: float
    decay_factor: float
    neg_eta: float
    ax_weight: float
    averaging: int


def asgd_rule(p, g, ax, decay_factor, neg_eta, ax_weight, weight_decay, has_weight_decay,
              maximize, averaging):
    """One ASGD element update; returns ``(p, ax)``.

    With ``eta`` and ``mu`` the parameter's values before this step (see
    :func:`asgd_per_step`)::

        g = -g                                         if maximize
        g = g + weight_decay * p                       if weight_decay != 0
        p = p * (1 - lambd * eta)
        p = p - eta * g
        ax = ax + (p - ax) * mu                        if mu != 1 (averaging)
        ax = p                                         otherwise

    Rounded as torch's single-tensor ASGD: ``add`` with alpha (the L2 decay, the step) is a
    fused multiply-add; ``(p - ax) * mu`` is rounded before it is added.
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = fma(p, weight_decay, g)
    p = p * decay_factor
    p = fma(g, neg_eta, p)
    if averaging:
        ax = ax + (p - ax) * ax_weight
    else:
        ax = p
    return p, ax


# Separate loops: before averaging starts ax is written, never read.
asgd_span = element_span("asgd_span", asgd_rule, 1, Scalars, Columns, Flags,
                         branches={"averaging": Off(unread=("ax",))})


def asgd_per_step(t, eta, mu, lr, lambd, alpha, t0):
    """This step's values of a parameter at its step ``t`` from its ``eta`` and ``mu`` (torch
    starts them at the group's current lr and 1 when ``t`` becomes 1): ``decay_factor = 1 -
    lambd * eta``, ``neg_eta = -eta``, ``ax_weight = mu`` (in the buffer's dtype) and
    ``averaging = mu != 1``; then, as torch does after the update, the next ``eta`` and ``mu``
    in float64 (the literals too: torch forms them in Python)::

        eta = lr / (1 + lambd * lr * t) ** alpha
        mu = 1 / max(1, t - t0)
    """
    if t == 1.0:
        eta = lr
        mu = 1.0
    return (1.0 - lambd * eta, -eta, mu, 1 if mu != 1.0 else 0,
            lr / ((1.0 + lambd * lr * t) ** alpha), 1.0 / max(1.0, t - t0))


asgd_prepare = element_prepare("asgd_prepare", asgd_per_step,
                               ("decay_factor", "neg_eta", "ax_weight", "averaging", "eta",
                                "mu"), PrepareScalars, Columns, Flags)


RULE = Rule(name="asgd", span=asgd_span, prepare=asgd_prepare,
            helpers=(asgd_rule, asgd_per_step),
            slots=("ax",),
            columns={"step": "int64", "eta": "float64", "mu": "float64",
                     "decay_factor": "param", "neg_eta": "param", "ax_weight": "param",
                     "averaging": "uint8"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
