"""Per-element update rules: the one body of each algorithm.

Each rule is a plain Python function over scalars. ``kernels.cpu`` compiles it with
``numba.njit`` and ``kernels.cuda`` with ``cuda.jit(device=True)``, so the CPU and CUDA
backends run the same arithmetic in the same order. Every scalar argument arrives already in
the buffer's dtype; the rules contain no numeric literals, so a float32 buffer never promotes
to float64 inside the loop.

The order of operations follows ``torch.optim`` 2.x's single-tensor path
(``torch/optim/sgd.py`` ``_single_tensor_sgd`` and ``torch/optim/adam.py``
``_single_tensor_adam``).
"""

import math


def sgd_rule(p, g, buf, first, neg_lr, weight_decay, momentum, one_minus_dampening,
             has_weight_decay, has_momentum, nesterov, maximize):
    """One SGD element update; returns ``(p, buf)``.

    ::

        g = -g                               if maximize
        g = g + weight_decay * p             if weight_decay != 0
        buf = g                              if momentum != 0 and first step with a gradient
        buf = momentum * buf + (1 - dampening) * g          otherwise (momentum != 0)
        g = g + momentum * buf  if nesterov else buf        (momentum != 0)
        p = p - lr * g
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = g + weight_decay * p
    if has_momentum:
        if first:
            buf = g
        else:
            buf = buf * momentum + one_minus_dampening * g
        if nesterov:
            g = g + momentum * buf
        else:
            g = buf
    p = p + neg_lr * g
    return p, buf


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
    """
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
    if amsgrad:
        # torch.maximum propagates NaN; "not (v_max >= v)" keeps that.
        if not (v_max >= v):
            v_max = v
        denom = math.sqrt(v_max) / bias_correction2_sqrt + eps
    else:
        denom = math.sqrt(v) / bias_correction2_sqrt + eps
    p = p + (neg_step_size * m) / denom
    return p, m, v, v_max


def adam_bias_correction(step, lr, beta1, beta2):
    """Per-parameter scalars for step count ``step`` (already advanced), in float64 as torch
    computes them in Python: ``(-lr / (1 - beta1**t), sqrt(1 - beta2**t))``."""
    t = float(step)
    return -(lr / (1.0 - beta1 ** t)), (1.0 - beta2 ** t) ** 0.5
