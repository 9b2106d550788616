"""Fused, parallel Numba CPU kernels over one flat buffer.

A buffer holds many parameters back to back (with alignment padding between them). Work is cut
into fixed-size element chunks, independent of parameter boundaries, so threads get even work
whether the buffer holds one huge tensor or thousands of small ones. ``chunk_first[c]`` is the
slot of the first parameter that reaches into chunk ``c``; a chunk walks the parameters it
overlaps and updates only their elements, so padding is never touched.

Per-parameter data (presence, first-step flags, bias corrections) arrives as arrays indexed by
slot. The per-parameter bookkeeping (step counts, flags) runs in a serial ``*_prepare`` kernel
first, because a parameter spanning several chunks must be counted once.
"""

from numba import njit, prange

from . import rules

_sgd_rule = njit(cache=True, inline="always")(rules.sgd_rule)
_adam_rule = njit(cache=True, inline="always")(rules.adam_rule)


@njit(cache=True)
def sgd_prepare(present, momentum_initialized, first, track_momentum):
    """Set ``first[k]`` for parameters stepping with no momentum buffer yet; mark them initialised."""
    for k in range(present.size):
        active = present[k] != 0
        first[k] = active and momentum_initialized[k] == 0
        if active and track_momentum:
            momentum_initialized[k] = 1


@njit(cache=True)
def adam_prepare(present, steps, neg_step_size, bias_correction2_sqrt, lr, beta1, beta2):
    """Advance each present parameter's own step count and compute its bias corrections.

    Scalars are formed in float64 as torch does in Python, then stored in the buffer's dtype.
    """
    for k in range(present.size):
        if present[k] != 0:
            steps[k] += 1
            t = float(steps[k])
            neg_step_size[k] = -(lr / (1.0 - beta1 ** t))
            bias_correction2_sqrt[k] = (1.0 - beta2 ** t) ** 0.5


@njit(parallel=True, cache=True)
def sgd_step(p, g, buf, offsets, sizes, present, first, chunk_first, chunk_size, hyper,
             has_weight_decay, has_momentum, nesterov, maximize):
    """SGD over one buffer. ``hyper = [-lr, weight_decay, momentum, 1 - dampening]`` in p's dtype."""
    neg_lr = hyper[0]
    weight_decay = hyper[1]
    momentum = hyper[2]
    one_minus_dampening = hyper[3]
    n_params = offsets.size
    total = p.size
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k])
                b = min(hi, offsets[k] + sizes[k])
                is_first = first[k] != 0
                if has_momentum:
                    for i in range(a, b):
                        p[i], buf[i] = _sgd_rule(p[i], g[i], buf[i], is_first, neg_lr,
                                                 weight_decay, momentum, one_minus_dampening,
                                                 has_weight_decay, True, nesterov, maximize)
                else:
                    for i in range(a, b):
                        p[i], _ = _sgd_rule(p[i], g[i], g[i], is_first, neg_lr, weight_decay,
                                            momentum, one_minus_dampening, has_weight_decay,
                                            False, nesterov, maximize)
            k += 1


@njit(parallel=True, cache=True)
def adam_step(p, g, m, v, v_max, offsets, sizes, present, neg_step_size,
              bias_correction2_sqrt, chunk_first, chunk_size, hyper, has_weight_decay,
              decoupled, amsgrad, maximize):
    """Adam/AdamW over one buffer.

    ``hyper = [1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay, 0]``
    in p's dtype. ``v_max`` is only read and written when ``amsgrad``.
    """
    one_minus_beta1 = hyper[0]
    beta2 = hyper[1]
    one_minus_beta2 = hyper[2]
    eps = hyper[3]
    weight_decay = hyper[4]
    decay_factor = hyper[5]
    zero = hyper[6]
    n_params = offsets.size
    total = p.size
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k])
                b = min(hi, offsets[k] + sizes[k])
                step_size = neg_step_size[k]
                bc2 = bias_correction2_sqrt[k]
                if amsgrad:
                    for i in range(a, b):
                        p[i], m[i], v[i], v_max[i] = _adam_rule(
                            p[i], g[i], m[i], v[i], v_max[i], step_size, bc2, one_minus_beta1,
                            beta2, one_minus_beta2, eps, weight_decay, decay_factor,
                            has_weight_decay, decoupled, True, maximize)
                else:
                    for i in range(a, b):
                        p[i], m[i], v[i], _ = _adam_rule(
                            p[i], g[i], m[i], v[i], zero, step_size, bc2, one_minus_beta1,
                            beta2, one_minus_beta2, eps, weight_decay, decay_factor,
                            has_weight_decay, decoupled, False, maximize)
            k += 1


__all__ = ["sgd_prepare", "adam_prepare", "sgd_step", "adam_step"]
