"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")."""

from typing import NamedTuple

from ..rule import Rule, positions


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


class Columns(NamedTuple):
    step: int


S, F, C = positions(Scalars), positions(Flags), positions(Columns)


def lion_rule(p, g, m, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor,
              has_weight_decay, maximize):
    """One Lion element update; returns ``(p, m)``::

        g = -g                                       if maximize
        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay)              if weight_decay != 0 (decoupled)
        p = p - lr * sign(c)                         (sign(0) = 0, and 0 for NaN, as torch.sign)
        m = beta2 * m + (1 - beta2) * g
    """
    if maximize:
        g = -g
    c = beta1 * m + one_minus_beta1 * g
    if has_weight_decay:
        p = p * decay_factor
    if c > 0:
        p = p + neg_lr
    elif c < 0:
        p = p - neg_lr
    m = beta2 * m + one_minus_beta2 * g
    return p, m


def lion_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, m = arrays
    neg_lr = scalars[S.neg_lr]
    beta1 = scalars[S.beta1]
    one_minus_beta1 = scalars[S.one_minus_beta1]
    beta2 = scalars[S.beta2]
    one_minus_beta2 = scalars[S.one_minus_beta2]
    decay_factor = scalars[S.decay_factor]
    has_weight_decay = flags[F.has_weight_decay]
    maximize = flags[F.maximize]
    for i in range(start, stop, stride):
        p[i], m[i] = lion_rule(p[i], g[i], m[i], neg_lr, beta1, one_minus_beta1, beta2,
                               one_minus_beta2, decay_factor, has_weight_decay, maximize)


def lion_prepare(present, columns, scalars, flags, start, stop, stride):
    """Advance each present parameter's own step count (the state marker; Lion's update
    does not depend on it)."""
    steps = columns[C.step]
    for k in range(start, stop, stride):
        if present[k] != 0:
            steps[k] += 1


RULE = Rule(name="lion", span=lion_span, prepare=lion_prepare, helpers=(lion_rule,),
            slots=("exp_avg",), columns={"step": "int64"}, scalars=Scalars, flags=Flags)
