"""Adam and AdamW (torch.optim.Adam / AdamW): AdamW is this rule with ``decoupled`` set."""

import math
from typing import NamedTuple

from ..arithmetic import fma
from ..rule import Rule, positions


class Scalars(NamedTuple):
    lerp_coefficient: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    decoupled_decay_factor: float


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


class Columns(NamedTuple):
    step: int
    neg_step_size: float
    bias_correction2_sqrt: float


S, P, F, C = (positions(Scalars), positions(PrepareScalars), positions(Flags),
              positions(Columns))


def adam_rule(p, g, m, v, v_max, neg_step_size, bias_correction2_sqrt, lerp_coefficient,
              beta2, one_minus_beta2, eps, weight_decay, decoupled_decay_factor,
              has_weight_decay, decoupled, amsgrad, maximize, lerp_from_end):
    """One Adam/AdamW element update; returns ``(p, m, v, v_max)``.

    AdamW is this rule with ``decoupled=True``. With ``t`` the parameter's own step count::

        g = -g                                         if maximize
        p = p * (1 - lr * weight_decay)                if weight_decay != 0 and decoupled (AdamW)
        g = g + weight_decay * p                       if weight_decay != 0 and not decoupled (Adam)
        m = lerp(m, g, 1 - beta1)                      (torch's lerp, see below)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                          if amsgrad (raw, uncorrected v)
        denom = sqrt(v_max or v) / sqrt(1 - beta2**t) + eps
        p = p - (lr / (1 - beta1**t)) * m / denom

    The lerp is computed as torch's kernel does, from the nearer end: with ``w = 1 - beta1``,
    ``m + w * (g - m)`` when ``w < 0.5``, else ``g + (w - 1) * (g - m)`` (``lerp_from_end``);
    ``lerp_coefficient`` is ``w`` or ``w - 1`` accordingly. (With beta1 = 0 the moment is
    then exactly the gradient, as in torch.)

    Rounded as torch's CPU kernels: the L2 decay (``add`` with alpha), the lerp and the last
    step of ``v``'s ``addcmul`` are fused multiply-adds; the update is ``addcdiv``
    (``(neg_step_size * m) / denom``, then added).
    """
    if maximize:
        g = -g
    if has_weight_decay:
        if decoupled:
            p = p * decoupled_decay_factor
        else:
            g = fma(p, weight_decay, g)
    if lerp_from_end:
        m = fma(lerp_coefficient, g - m, g)
    else:
        m = fma(lerp_coefficient, g - m, m)
    v = fma(one_minus_beta2 * g, g, v * beta2)
    if amsgrad:
        # torch.maximum propagates NaN; "not (v_max >= v)" keeps that.
        if not (v_max >= v):
            v_max = v
        denom = math.sqrt(v_max) / bias_correction2_sqrt + eps
    else:
        denom = math.sqrt(v) / bias_correction2_sqrt + eps
    p = p + (neg_step_size * m) / denom
    return p, m, v, v_max


def adam_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, m, v, v_max = arrays
    step_size = columns[C.neg_step_size][k]
    bc2 = columns[C.bias_correction2_sqrt][k]
    lerp_coefficient = scalars[S.lerp_coefficient]
    beta2 = scalars[S.beta2]
    one_minus_beta2 = scalars[S.one_minus_beta2]
    eps = scalars[S.eps]
    weight_decay = scalars[S.weight_decay]
    decay_factor = scalars[S.decoupled_decay_factor]
    has_weight_decay = flags[F.has_weight_decay]
    decoupled = flags[F.decoupled]
    maximize = flags[F.maximize]
    lerp_from_end = flags[F.lerp_from_end]
    # Separate loops: without amsgrad v_max is neither read nor written, which keeps the loop
    # within LLVM's alias-check limit so that it vectorises.
    if flags[F.amsgrad]:
        for i in range(start, stop, stride):
            p[i], m[i], v[i], v_max[i] = adam_rule(
                p[i], g[i], m[i], v[i], v_max[i], step_size, bc2, lerp_coefficient, beta2,
                one_minus_beta2, eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                True, maximize, lerp_from_end)
    else:
        for i in range(start, stop, stride):
            p[i], m[i], v[i], _ = adam_rule(
                p[i], g[i], m[i], v[i], eps, step_size, bc2, lerp_coefficient, beta2,
                one_minus_beta2, eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                False, maximize, lerp_from_end)


def adam_prepare(present, columns, scalars, flags, start, stop, stride):
    """Advance each present parameter's own step count; its bias corrections, formed in
    float64 as torch does in Python, then stored in the buffer's dtype:
    ``neg_step_size = -lr / (1 - beta1**t)``, ``bias_correction2_sqrt = sqrt(1 - beta2**t)``.
    Parameters usually share a step count, so the powers are computed once per distinct
    count in a run (the same value, not an approximation)."""
    steps = columns[C.step]
    neg_step_size = columns[C.neg_step_size]
    bias_correction2_sqrt = columns[C.bias_correction2_sqrt]
    last_step = -1
    step_size = 0.0
    correction = 0.0
    for k in range(start, stop, stride):
        if present[k] != 0:
            steps[k] += 1
            if steps[k] != last_step:
                # float64 on purpose (the literals too): torch forms these scalars in Python
                last_step = steps[k]
                t = float(last_step)
                step_size = -(scalars[P.lr] / (1.0 - scalars[P.beta1] ** t))
                correction = (1.0 - scalars[P.beta2] ** t) ** 0.5
            neg_step_size[k] = step_size
            bias_correction2_sqrt[k] = correction


RULE = Rule(name="adam", span=adam_span, prepare=adam_prepare, helpers=(adam_rule,),
            slots=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
            columns={"step": "int64", "neg_step_size": "param",
                     "bias_correction2_sqrt": "param"},
            scalars=Scalars, prepare_scalars=PrepareScalars, flags=Flags)
