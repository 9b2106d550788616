"""CUDA kernels (numba-cuda) over one flat buffer, compiled from the same rule bodies as the CPU.

The layout is the CPU's: one block per chunk of ``chunk_size`` elements (grid-striding over
chunks), ``chunk_first[c]`` the first parameter reaching into chunk ``c``; the threads of a
block stride over each parameter segment of the chunk, so loads and stores coalesce. Per-
parameter bookkeeping runs first in a one-thread-per-parameter kernel. Arguments are device
arrays (or host arrays under the simulator, ``NUMBA_ENABLE_CUDASIM=1``); ``hyper`` holds the
same scalars, in the same order and dtype, as for ``kernels.cpu``.
"""

from numba import cuda

from . import rules

_sgd_rule = cuda.jit(device=True)(rules.sgd_rule)
_adam_rule = cuda.jit(device=True)(rules.adam_rule)
_adam_bias_correction = cuda.jit(device=True)(rules.adam_bias_correction)

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535


@cuda.jit
def _sgd_prepare(present, momentum_initialized, first, track_momentum):
    k = cuda.grid(1)
    if k < present.size:
        active = present[k] != 0
        first[k] = 1 if (active and momentum_initialized[k] == 0) else 0
        if active and track_momentum:
            momentum_initialized[k] = 1


@cuda.jit
def _adam_prepare(present, steps, neg_step_size, bias_correction2_sqrt, lr, beta1, beta2):
    k = cuda.grid(1)
    if k < present.size and present[k] != 0:
        steps[k] += 1
        neg_step_size[k], bias_correction2_sqrt[k] = _adam_bias_correction(steps[k], lr, beta1,
                                                                           beta2)


@cuda.jit
def _sgd_step(p, g, buf, offsets, sizes, present, first, chunk_first, chunk_size, hyper,
              has_weight_decay, has_momentum, nesterov, maximize):
    neg_lr = hyper[0]
    weight_decay = hyper[1]
    momentum = hyper[2]
    one_minus_dampening = hyper[3]
    n_params = offsets.size
    for c in range(cuda.blockIdx.x, chunk_first.size, cuda.gridDim.x):
        lo = c * chunk_size
        hi = min(lo + chunk_size, p.size)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k])
                b = min(hi, offsets[k] + sizes[k])
                is_first = first[k] != 0
                for i in range(a + cuda.threadIdx.x, b, cuda.blockDim.x):
                    new_p, new_buf = _sgd_rule(p[i], g[i], buf[i], is_first, neg_lr,
                                               weight_decay, momentum, one_minus_dampening,
                                               has_weight_decay, has_momentum, nesterov,
                                               maximize)
                    p[i] = new_p
                    if has_momentum:
                        buf[i] = new_buf
            k += 1


@cuda.jit
def _adam_step(p, g, m, v, v_max, offsets, sizes, present, neg_step_size,
               bias_correction2_sqrt, chunk_first, chunk_size, hyper, has_weight_decay,
               decoupled, amsgrad, maximize, lerp_from_end):
    lerp_coefficient = hyper[0]
    beta2 = hyper[1]
    one_minus_beta2 = hyper[2]
    eps = hyper[3]
    weight_decay = hyper[4]
    decay_factor = hyper[5]
    n_params = offsets.size
    for c in range(cuda.blockIdx.x, chunk_first.size, cuda.gridDim.x):
        lo = c * chunk_size
        hi = min(lo + chunk_size, p.size)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k])
                b = min(hi, offsets[k] + sizes[k])
                step_size = neg_step_size[k]
                bc2 = bias_correction2_sqrt[k]
                for i in range(a + cuda.threadIdx.x, b, cuda.blockDim.x):
                    new_p, new_m, new_v, new_v_max = _adam_rule(
                        p[i], g[i], m[i], v[i], v_max[i], step_size, bc2, lerp_coefficient,
                        beta2, one_minus_beta2, eps, weight_decay, decay_factor,
                        has_weight_decay, decoupled, amsgrad, maximize, lerp_from_end)
                    p[i] = new_p
                    m[i] = new_m
                    v[i] = new_v
                    if amsgrad:
                        v_max[i] = new_v_max
            k += 1


def _grid(n_chunks: int, threads: int) -> tuple[int, int]:
    return max(1, min(n_chunks, MAX_BLOCKS)), threads


def sgd_prepare(present, momentum_initialized, first, track_momentum):
    """CUDA twin of ``kernels.cpu.sgd_prepare``."""
    n = present.size
    if n:
        _sgd_prepare[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](
            present, momentum_initialized, first, track_momentum)


def adam_prepare(present, steps, neg_step_size, bias_correction2_sqrt, lr, beta1, beta2):
    """CUDA twin of ``kernels.cpu.adam_prepare``."""
    n = present.size
    if n:
        _adam_prepare[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](
            present, steps, neg_step_size, bias_correction2_sqrt, float(lr), float(beta1),
            float(beta2))


def sgd_step(p, g, buf, offsets, sizes, present, first, chunk_first, chunk_size, hyper,
             has_weight_decay, has_momentum, nesterov, maximize, threads=THREADS_PER_BLOCK):
    """CUDA twin of ``kernels.cpu.sgd_step`` (same arguments)."""
    if chunk_first.size:
        _sgd_step[_grid(chunk_first.size, threads)](
            p, g, buf, offsets, sizes, present, first, chunk_first, chunk_size, hyper,
            has_weight_decay, has_momentum, nesterov, maximize)


def adam_step(p, g, m, v, v_max, offsets, sizes, present, neg_step_size, bias_correction2_sqrt,
              chunk_first, chunk_size, hyper, has_weight_decay, decoupled, amsgrad, maximize,
              lerp_from_end, threads=THREADS_PER_BLOCK):
    """CUDA twin of ``kernels.cpu.adam_step`` (same arguments)."""
    if chunk_first.size:
        _adam_step[_grid(chunk_first.size, threads)](
            p, g, m, v, v_max, offsets, sizes, present, neg_step_size, bias_correction2_sqrt,
            chunk_first, chunk_size, hyper, has_weight_decay, decoupled, amsgrad, maximize,
            lerp_from_end)
