"""Fused, parallel Numba CPU kernels over one flat buffer.

A buffer holds many parameters back to back (with alignment padding between them). Work is cut
into fixed-size element chunks, independent of parameter boundaries, so threads get even work
whether the buffer holds one huge tensor or thousands of small ones. ``chunk_first[c]`` is the
slot of the first parameter that reaches into chunk ``c``; a chunk walks the parameters it
overlaps and updates only their elements, so padding is never touched.

Per-parameter data (presence, first-step flags, bias corrections) arrives as arrays indexed by
slot. The per-parameter bookkeeping (step counts, flags) runs in a serial ``*_prepare`` kernel
first, because a parameter spanning several chunks must be counted once.

How the element loops are kept fast (each point was measured; see ``bench/``):

- ``error_model="numpy"``: with Numba's default ("python") every float division checks for
  zero to raise ``ZeroDivisionError``, a branch per element that stops LLVM from vectorising.
  IEEE division is what torch does anyway (eps keeps Adam's denominator positive).
- Element loops run over unsigned (``uint64``) index ranges: with signed indices Numba's
  negative-index wraparound check could not be proved dead and the loop stayed scalar. (Slices
  indexed from 0 vectorise too, but each slice costs a reference count update, which shows up
  with thousands of small parameters.)
- The flags stay run-time arguments: once the loop vectorises, LLVM hoists or selects the
  rule's flag branches (measured equal to literal-flag copies of the loop, at a fraction of the
  compile time). ``amsgrad`` and SGD's momentum get separate loops because they change which
  arrays are written. The AMSGrad loop writes four arrays, more pairs than LLVM's runtime
  alias-check limit, and stays scalar (about a quarter of the speed in cache).
- Small buffers (below ``PARALLEL_MIN_ELEMENTS``), and any buffer when Numba runs on one
  thread, take a serial path inside the same kernel (``serial=True``, chosen by
  :func:`run_serially`), which skips the parallel launch: its fixed cost exceeds the whole
  update of a small buffer.
"""

from numba import get_num_threads, njit, prange, uint64

from . import rules

_sgd_rule = njit(cache=True, inline="always")(rules.sgd_rule)
_adam_rule = njit(cache=True, inline="always")(rules.adam_rule)
_adam_bias_correction = njit(cache=True, inline="always")(rules.adam_bias_correction)

# Below this many elements a buffer is updated on the calling thread. In a back-to-back loop a
# parallel launch costs a few microseconds and pays off from ~32K elements, but in a training
# loop the forward and backward passes run between steps, the worker threads have gone to sleep
# and waking them costs tens of microseconds (more when BLAS threads compete for the cores):
# the demo's 74K-element buffer took 75-87 us serially against 80-650 us in parallel on 2 cores.
PARALLEL_MIN_ELEMENTS = 1 << 17


@njit(cache=True)
def sgd_prepare(present, momentum_initialized, first, track_momentum):
    """Set ``first[k]`` for parameters stepping with no momentum buffer yet; mark them initialised.

    Returns the number of parameters with a gradient (0: the buffer has nothing to step).
    """
    n_present = 0
    for k in range(present.size):
        active = present[k] != 0
        first[k] = active and momentum_initialized[k] == 0
        if active:
            n_present += 1
            if track_momentum:
                momentum_initialized[k] = 1
    return n_present


@njit(cache=True)
def adam_prepare(present, steps, neg_step_size, bias_correction2_sqrt, lr, beta1, beta2):
    """Advance each present parameter's own step count and compute its bias corrections.

    Scalars are formed in float64 as torch does in Python, then stored in the buffer's dtype.
    Parameters usually share a step count, so the powers are computed once per distinct count
    in a run (the same value, not an approximation). Returns the number of parameters with a
    gradient (0: the buffer has nothing to step).
    """
    n_present = 0
    last_step = -1
    a = 0.0
    b = 0.0
    for k in range(present.size):
        if present[k] != 0:
            n_present += 1
            steps[k] += 1
            if steps[k] != last_step:
                last_step = steps[k]
                a, b = _adam_bias_correction(last_step, lr, beta1, beta2)
            neg_step_size[k] = a
            bias_correction2_sqrt[k] = b
    return n_present


# ------------------------------------------------------------------------------------- SGD
@njit(inline="always", error_model="numpy")
def _sgd_span(p, g, buf, a, b, neg_lr, weight_decay, momentum, one_minus_dampening, is_first,
              has_weight_decay, has_momentum, nesterov, maximize):
    """Elements ``a`` to ``b`` (unsigned) of one parameter segment."""
    if has_momentum:
        for i in range(a, b):
            p[i], buf[i] = _sgd_rule(p[i], g[i], buf[i], is_first, neg_lr, weight_decay,
                                     momentum, one_minus_dampening, has_weight_decay, True,
                                     nesterov, maximize)
    else:  # the momentum buffer is neither read nor written
        for i in range(a, b):
            p[i], _ = _sgd_rule(p[i], g[i], neg_lr, False, neg_lr, weight_decay, momentum,
                                one_minus_dampening, has_weight_decay, False, False, maximize)


@njit(parallel=True, cache=True, error_model="numpy")
def sgd_step(p, g, buf, offsets, sizes, present, first, chunk_first, chunk_size, hyper,
             has_weight_decay, has_momentum, nesterov, maximize, serial=False):
    """SGD over one buffer. ``hyper = [-lr, weight_decay, momentum, 1 - dampening]`` in p's dtype.

    ``serial=True`` runs on the calling thread, parameter by parameter, with no parallel
    launch (for small buffers, see ``PARALLEL_MIN_ELEMENTS``); the arithmetic is the same.
    """
    neg_lr = hyper[0]
    weight_decay = hyper[1]
    momentum = hyper[2]
    one_minus_dampening = hyper[3]
    n_params = offsets.size
    total = p.size
    if serial:
        for k in range(n_params):
            if present[k] != 0:
                a = uint64(offsets[k])
                b = uint64(offsets[k] + sizes[k])
                _sgd_span(p, g, buf, a, b, neg_lr, weight_decay, momentum,
                          one_minus_dampening, first[k] != 0, has_weight_decay, has_momentum,
                          nesterov, maximize)
        return
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = uint64(max(lo, offsets[k]))
                b = uint64(min(hi, offsets[k] + sizes[k]))
                _sgd_span(p, g, buf, a, b, neg_lr, weight_decay, momentum,
                          one_minus_dampening, first[k] != 0, has_weight_decay, has_momentum,
                          nesterov, maximize)
            k += 1


# ------------------------------------------------------------------------------------ Adam
@njit(inline="always", error_model="numpy")
def _adam_span(p, g, m, v, v_max, a, b, step_size, bc2, lerp_coefficient, beta2,
               one_minus_beta2, eps, weight_decay, decay_factor, has_weight_decay, decoupled,
               amsgrad, maximize, lerp_from_end):
    """Elements ``a`` to ``b`` (unsigned) of one parameter segment."""
    if amsgrad:
        for i in range(a, b):
            p[i], m[i], v[i], v_max[i] = _adam_rule(
                p[i], g[i], m[i], v[i], v_max[i], step_size, bc2, lerp_coefficient, beta2,
                one_minus_beta2, eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                True, maximize, lerp_from_end)
    else:  # v_max is neither read nor written
        for i in range(a, b):
            p[i], m[i], v[i], _ = _adam_rule(
                p[i], g[i], m[i], v[i], eps, step_size, bc2, lerp_coefficient, beta2,
                one_minus_beta2, eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                False, maximize, lerp_from_end)


@njit(parallel=True, cache=True, error_model="numpy")
def adam_step(p, g, m, v, v_max, offsets, sizes, present, neg_step_size,
              bias_correction2_sqrt, chunk_first, chunk_size, hyper, has_weight_decay,
              decoupled, amsgrad, maximize, lerp_from_end, serial=False):
    """Adam/AdamW over one buffer.

    ``hyper = [lerp_coefficient, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay]``
    in p's dtype (see ``rules.adam_rule`` for the lerp). ``v_max`` is only read and written when ``amsgrad``. ``serial=True`` runs on
    the calling thread with no parallel launch (see ``PARALLEL_MIN_ELEMENTS``).
    """
    lerp_coefficient = hyper[0]
    beta2 = hyper[1]
    one_minus_beta2 = hyper[2]
    eps = hyper[3]
    weight_decay = hyper[4]
    decay_factor = hyper[5]
    n_params = offsets.size
    total = p.size
    if serial:
        for k in range(n_params):
            if present[k] != 0:
                a = uint64(offsets[k])
                b = uint64(offsets[k] + sizes[k])
                _adam_span(p, g, m, v, v_max, a, b, neg_step_size[k],
                           bias_correction2_sqrt[k], lerp_coefficient, beta2, one_minus_beta2,
                           eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                           amsgrad, maximize, lerp_from_end)
        return
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = uint64(max(lo, offsets[k]))
                b = uint64(min(hi, offsets[k] + sizes[k]))
                _adam_span(p, g, m, v, v_max, a, b, neg_step_size[k],
                           bias_correction2_sqrt[k], lerp_coefficient, beta2, one_minus_beta2,
                           eps, weight_decay, decay_factor, has_weight_decay, decoupled,
                           amsgrad, maximize, lerp_from_end)
            k += 1


def run_serially(n_elements: int) -> bool:
    """Whether a buffer of ``n_elements`` should skip the parallel launch."""
    return n_elements < PARALLEL_MIN_ELEMENTS or get_num_threads() == 1


__all__ = ["sgd_prepare", "adam_prepare", "sgd_step", "adam_step", "run_serially",
           "PARALLEL_MIN_ELEMENTS"]
