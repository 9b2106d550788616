"""ASGD (torch.optim.ASGD): averaged SGD (Polyak & Juditsky 1992) with a decaying step size."""

from typing import NamedTuple

from ..arithmetic import fma
from ..rule import Rule, positions


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


S, P, F, C = (positions(Scalars), positions(PrepareScalars), positions(Flags),
              positions(Columns))


def asgd_rule(p, g, ax, decay_factor, neg_eta, ax_weight, weight_decay, has_weight_decay,
              maximize, averaging):
    """One ASGD element update; returns ``(p, ax)``.

    With ``eta`` and ``mu`` the parameter's values before this step (see
    :func:`asgd_prepare`)::

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


def asgd_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, ax = arrays
    decay_factor = columns[C.decay_factor][k]
    neg_eta = columns[C.neg_eta][k]
    ax_weight = columns[C.ax_weight][k]
    weight_decay = scalars[S.weight_decay]
    has_weight_decay = flags[F.has_weight_decay]
    maximize = flags[F.maximize]
    # Separate loops: before averaging starts ax is written, never read.
    if columns[C.averaging][k] != 0:
        for i in range(start, stop, stride):
            p[i], ax[i] = asgd_rule(p[i], g[i], ax[i], decay_factor, neg_eta, ax_weight,
                                    weight_decay, has_weight_decay, maximize, True)
    else:
        for i in range(start, stop, stride):
            p[i], ax[i] = asgd_rule(p[i], g[i], neg_eta, decay_factor, neg_eta, ax_weight,
                                    weight_decay, has_weight_decay, maximize, False)


def asgd_prepare(present, columns, scalars, flags, start, stop, stride):
    """Advance each present parameter's own step count ``t``; hand the span this step's
    ``eta`` and ``mu`` (torch starts them at the group's current lr and 1 when ``t`` becomes
    1) as ``decay_factor = 1 - lambd * eta``, ``neg_eta = -eta``, ``ax_weight = mu`` in the
    buffer's dtype and ``averaging = mu != 1``; then, as torch does after the update, in
    float64::

        eta = lr / (1 + lambd * lr * t) ** alpha
        mu = 1 / max(1, t - t0)
    """
    steps = columns[C.step]
    eta = columns[C.eta]
    mu = columns[C.mu]
    decay_factor = columns[C.decay_factor]
    neg_eta = columns[C.neg_eta]
    ax_weight = columns[C.ax_weight]
    averaging = columns[C.averaging]
    lr = scalars[P.lr]
    lambd = scalars[P.lambd]
    alpha = scalars[P.alpha]
    t0 = scalars[P.t0]
    last_step = -1
    next_eta = 0.0
    next_mu = 0.0
    for k in range(start, stop, stride):
        if present[k] != 0:
            steps[k] += 1
            if steps[k] == 1:
                eta[k] = lr
                mu[k] = 1.0
            current = eta[k]
            decay_factor[k] = 1.0 - lambd * current
            neg_eta[k] = -current
            ax_weight[k] = mu[k]
            averaging[k] = 1 if mu[k] != 1.0 else 0
            if steps[k] != last_step:
                # float64 on purpose (the literals too): torch forms these values in Python
                last_step = steps[k]
                t = float(last_step)
                next_eta = lr / ((1.0 + lambd * lr * t) ** alpha)
                next_mu = 1.0 / max(1.0, t - t0)
            eta[k] = next_eta
            mu[k] = next_mu


RULE = Rule(name="asgd", span=asgd_span, prepare=asgd_prepare, helpers=(asgd_rule,),
            slots=("ax",),
            columns={"step": "int64", "eta": "float64", "mu": "float64",
                     "decay_factor": "param", "neg_eta": "param", "ax_weight": "param",
                     "averaging": "uint8"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
