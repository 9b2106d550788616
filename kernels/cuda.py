"""The CUDA backend (numba-cuda): every rule compiled from the same functions as on the CPU.

The layout is the CPU's: one block per chunk of ``chunk_size`` elements (grid-striding over
chunks), ``chunk_first[c]`` the first parameter reaching into chunk ``c``; the threads of a
block stride over each parameter segment of the chunk (the span's ``stride``), so loads and
stores coalesce. Per-parameter bookkeeping runs first in a one-thread-per-parameter kernel.
Arguments are device arrays (or host arrays under the simulator, ``NUMBA_ENABLE_CUDASIM=1``)
with the same layouts and dtypes as for ``kernels.cpu``. Every launch takes the CUDA stream to
run on (0: the default stream).

Bit-exact kernels (``compile_rule(rule, exact=True)``): NVVM contracts a multiply followed by
an add into one fused multiply-add (one rounding instead of two), so a rule compiled as is
differs from the CPU kernel in the last bit of a few elements per thousand. ``fastmath=False``
does not stop it and numba-cuda has no flag for it, but libNVVM takes ``-fma=0``: kernels
compiled with ``exact=True`` carry a marker in their names, and a thin wrapper around
numba-cuda's ``nvvm.compile_ir`` adds ``fma=0`` to the options of any compilation unit holding
such a kernel (every other kernel compiles as before). The CPU kernels never contract (LLVM
does not without fast-math flags), so exact CUDA kernels give the CPU's bits.
"""

from __future__ import annotations

from typing import NamedTuple

import math

import numpy as np

from ._bind import bind, instantiate
from ._cuda_import import simulated
from .cpu import COUNT_NONFINITE, MAX_ABS, SUM_POWERS, SUM_SQUARES
from .coded import CODEC_FINGERPRINT, NATIVE
from .cuda_chunks import FINGERPRINT as CHUNKS_FINGERPRINT, chunk_walk, thread_elements
from .cuda_coded import CudaCodedKernels, codec, fma_primitive, half_kernels
from .cuda_coded import compile_coded as compile_coded_walks
from .cuda_launch import (MIN_BLOCKS, THREADS_PER_BLOCK, WIDE_MIN_BLOCKS, Source, cuda, grid,
                          launch, make)
from .rule import Rule


def _prepare_walk(present, columns, scalars, flags):
    k = cuda.grid(1)
    if k < present.size:
        prepare(present, columns, scalars, flags, k, k + 1, 1)  # noqa: F821 (bound per rule)


@cuda.jit(device=True, inline="always")
def _scaled_elements(arrays, start, stop, grad_multiplier, scale_grads):
    """This thread's elements of the overlap ``[start, stop)`` (``thread_elements``), its
    gradients among them first multiplied by ``grad_multiplier`` when ``scale_grads``: each
    thread scales the elements it then reads."""
    a, b, stride = thread_elements(start, stop)
    if scale_grads:
        g = arrays[1]
        for i in range(a, b, stride):
            g[i] = g[i] * grad_multiplier
    return a, b, stride


def _step_overlap(context, state, k, start, stop):
    arrays, scalars, columns, flags, grad_multiplier, scale_grads = context
    a, b, stride = _scaled_elements(arrays, start, stop, grad_multiplier, scale_grads)
    span(arrays, scalars, columns, flags, k, a, b, stride)  # noqa: F821 (bound per rule)
    return state


def _reduce_overlap(context, state, k, start, stop):
    """This thread's partial totals of the overlap, added into ``sums[k]`` atomically (the
    order of additions is not fixed, unlike the CPU's)."""
    arrays, scalars, columns, flags, sums, grad_multiplier, scale_grads = context
    a, b, stride = _scaled_elements(arrays, start, stop, grad_multiplier, scale_grads)
    if a < b:
        values = reduce(arrays, scalars, columns, flags, k, a, b, stride)  # noqa: F821
        for j in range(sums.shape[1]):
            cuda.atomic.add(sums, (k, j), values[j])
    return state


def _step_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
               chunk_size, grad_multiplier, scale_grads):
    walk(present, offsets, sizes, chunk_first, chunk_size, arrays[0].size,  # noqa: F821
         (arrays, scalars, columns, flags, grad_multiplier, scale_grads), None)


def _reduce_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
                 chunk_size, sums, grad_multiplier, scale_grads):
    walk(present, offsets, sizes, chunk_first, chunk_size, arrays[0].size,  # noqa: F821
         (arrays, scalars, columns, flags, sums, grad_multiplier, scale_grads), None)


def _finalize_walk(present, columns, scalars, flags, sums):
    k = cuda.grid(1)
    if k < present.size:
        finalize(present, columns, scalars, flags, k, k + 1, 1, sums)  # noqa: F821 (bound)


class CompiledRule(NamedTuple):
    """A rule's CUDA kernels, with the launch configuration. The element walks come twice:
    over float32 data, and (``wide_``) over float64 data with lower launch bounds
    (``cuda_launch.WIDE_MIN_BLOCKS``); prepare and finalize compute in float64 either way."""

    prepare_kernel: object
    step_kernel: object
    wide_step_kernel: object
    reduce_kernel: object = None
    wide_reduce_kernel: object = None
    finalize_kernel: object = None

    def _walk(self, scalars, narrow, wide):
        """The walk for data in ``scalars``' dtype (the buffer's)."""
        return wide if np.dtype(scalars.dtype).itemsize == 8 else narrow

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads, threads=THREADS_PER_BLOCK, stream=0, zero_sums=True) -> None:
        """``zero_sums=False``: ``sums`` is already zero (a device array zeroed by the
        caller, which cannot be assigned to from the host)."""
        if zero_sums:
            sums[...] = 0.0
        n_chunks = layout.chunk_first.size
        if n_chunks:
            launch(self._walk(scalars, self.reduce_kernel, self.wide_reduce_kernel),
                   grid(n_chunks), threads, stream, arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
                   layout.chunk_first, layout.chunk_size, sums, grad_multiplier, scale_grads)

    def finalize(self, present, columns, scalars, flags, sums, stream=0) -> None:
        n = present.size
        if n:
            launch(self.finalize_kernel, -(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK, stream,
                   present, columns, scalars, flags, sums)

    def prepare(self, present, columns, scalars, flags) -> int:
        n_present = int(np.count_nonzero(present))  # presence lives on the host
        if n_present:
            n = present.size
            launch(self.prepare_kernel, -(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK, 0,
                   present, columns, scalars, flags)
        return n_present

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier, scale_grads,
             threads=THREADS_PER_BLOCK, stream=0) -> None:
        n_chunks = layout.chunk_first.size
        if n_chunks:
            launch(self._walk(scalars, self.step_kernel, self.wide_step_kernel), grid(n_chunks),
                   threads, stream, arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes, layout.chunk_first,
                   layout.chunk_size, grad_multiplier, scale_grads)


_compiled: dict[str, CompiledRule] = {}

# In the name of every kernel compiled with exact=True (see the module's docstring).
NO_FMA_MARKER = "flatoptnofma"


def no_fma_options(llvmir, options: dict) -> dict:
    """NVVM ``options`` for compiling ``llvmir`` (one module's text or a list of them): with
    ``fma=False`` added when a kernel in it carries NO_FMA_MARKER."""
    texts = [llvmir] if isinstance(llvmir, str) else llvmir
    if any(isinstance(text, str) and NO_FMA_MARKER in text for text in texts):
        return {**options, "fma": False}
    return options


def _install_no_fma_compile() -> None:
    """Wrap numba-cuda's NVVM entry point once so that units holding a kernel marked with
    NO_FMA_MARKER compile with ``-fma=0``. A no-op under the simulator (no NVVM)."""
    if simulated():
        return
    from numba.cuda.cudadrv import nvvm
    if getattr(nvvm.compile_ir, "flatopt_no_fma", False):
        return
    original = nvvm.compile_ir

    def compile_ir(llvmir, **options):
        return original(llvmir, **no_fma_options(llvmir, options))
    compile_ir.flatopt_no_fma = True
    nvvm.compile_ir = compile_ir


def _key(rule: Rule, exact: bool) -> str:
    """The name of a rule's kernels (and their cache key); ``exact`` ones carry the marker."""
    key = f"{rule.name}_{rule.fingerprint}"
    if exact:
        _install_no_fma_compile()
        key = f"{key}_{NO_FMA_MARKER}"
    return key


class LayoutKernels:
    """The CUDA coded walks for buffers stored as one ``kernels.coded.Layout``: they take
    the formats, mode and rounding as arguments (the CPU compiles them in), so this puts
    them between the CPU walk's leading arguments ``(stored, absmax, tables, seed, draw,
    base)``. ``base`` is 0 on one device (ZeRO-1 is host-only)."""

    def __init__(self, kernels: CudaCodedKernels, layout):
        self.kernels, self.layout = kernels, layout
        self.prepare, self.finalize = kernels.prepare, kernels.finalize

    def _arguments(self, arrays) -> tuple:
        stored, absmax, tables, seed, draw, _ = arrays
        layout = self.layout
        return (stored, layout.formats, absmax, tables, layout.rounding, layout.mode, seed,
                draw)

    def step(self, arrays, *args, **options) -> None:
        self.kernels.step(self._arguments(arrays), *args, **options)

    def reduce(self, arrays, *args, **options) -> None:
        self.kernels.reduce(self._arguments(arrays), *args, **options)


def compile_coded(rule: Rule, layout, exact: bool = False) -> LayoutKernels:
    """The rule's walks over reduced-precision buffers stored as ``layout``
    (``kernels/cuda_coded.py``)."""
    return LayoutKernels(compile_coded_walks(rule, compile_rule(rule, exact), _key(rule, exact),
                                             Source(compile_coded, (rule, layout, exact))),
                         layout)


def compile_rule(rule: Rule, exact: bool = False) -> CompiledRule:
    """The rule's CUDA kernels; ``exact=True``: compiled without multiply-add contraction."""
    key = _key(rule, exact)
    compiled = _compiled.get(key)
    if compiled is None:
        functions = bind(rule, cuda.jit(device=True), {"fma": fma_primitive()})
        source = Source(compile_rule, (rule, exact))

        def kernel(template, name, min_blocks=MIN_BLOCKS, **bound):
            return make(instantiate(template, f"{name}_{key}", **bound), source, min_blocks)
        prepare = functions[rule.prepare.__name__]
        step_walk = chunk_walk(_step_overlap, f"step_{key}", span=functions[rule.span.__name__])
        compiled = CompiledRule(kernel(_prepare_walk, "prepare", prepare=prepare),
                                kernel(_step_walk, "step", walk=step_walk),
                                kernel(_step_walk, "wide_step", WIDE_MIN_BLOCKS, walk=step_walk))
        if rule.reduce is not None:
            reduce_walk = chunk_walk(_reduce_overlap, f"reduce_{key}",
                                     reduce=functions[rule.reduce.__name__])
            compiled = compiled._replace(
                reduce_kernel=kernel(_reduce_walk, "reduce", walk=reduce_walk),
                wide_reduce_kernel=kernel(_reduce_walk, "wide_reduce", WIDE_MIN_BLOCKS,
                                          walk=reduce_walk))
            if rule.finalize is not None:  # none with global reductions
                compiled = compiled._replace(finalize_kernel=kernel(
                    _finalize_walk, "finalize", finalize=functions[rule.finalize.__name__]))
        _compiled[key] = compiled
    return compiled


# ----------------------------------------------------------------------------- tool kernels
def _lerp(average, value, weight, from_end):
    """``kernels.tools.lerp_into`` on the device (the EMA of a device-resident optimizer)."""
    for i in range(cuda.grid(1), average.size, cuda.gridsize(1)):
        if from_end:
            average[i] = value[i] + weight * (value[i] - average[i])
        else:
            average[i] = average[i] + weight * (value[i] - average[i])


def fill_kernel(target, value):
    """``target[...] = value`` (zeroing gradients without a host copy)."""
    for i in range(cuda.grid(1), target.size, cuda.gridsize(1)):
        target[i] = value


def add_kernel(target, value):
    """``target += value`` (gradient accumulation into the flat gradient buffer)."""
    for i in range(cuda.grid(1), target.size, cuda.gridsize(1)):
        target[i] = target[i] + value[i]


lerp_kernel = make(instantiate(_lerp, "lerp_kernel"), cache=True)
fill_kernel, add_kernel = (make(function, cache=True) for function in (fill_kernel, add_kernel))
_exact_lerp: list = []


def exact_lerp_kernel():
    """:func:`lerp_kernel` without multiply-add contraction (compiled once): the EMA of a
    ``bit_exact`` device, which then averages as ``lerp_into`` does on the CPU (NVVM fuses
    ``a + w * (v - a)`` into one rounding otherwise)."""
    if not _exact_lerp:
        _install_no_fma_compile()
        _exact_lerp.append(make(instantiate(_lerp, f"lerp_kernel_{NO_FMA_MARKER}"),
                                Source(exact_lerp_kernel), cache=True))
    return _exact_lerp[0]


def _totals_overlap(context, state, k, start, stop):
    """This thread's elements of the overlap added (or maxed) into the running ``state``
    (value, non-finite count, NaN seen), in float64."""
    g, fmt, power, mode = context
    value, bad, nan = state
    a, b, stride = thread_elements(start, stop)
    for i in range(a, b, stride):
        # in the gradient's dtype, as kernels.cpu computes the terms (its float(g[i]) keeps
        # a float32 a float32); the sum is float64
        x = abs(gradient_value(g, fmt, i))  # noqa: F821 (bound)
        if not (x - x == 0):
            bad += 1.0
            if x != x:
                nan = 1.0
        if mode == SUM_SQUARES:
            value += x * x
        elif mode == SUM_POWERS:
            value += x ** power
        elif mode == MAX_ABS:
            if x > value:
                value = x
    return value, bad, nan


def _gradient_totals(g, fmt, present, offsets, sizes, chunk_first, chunk_size, power, mode,
                     out):
    """``kernels.cpu.reduce_gradients`` on the device: each thread reduces its strided
    elements of the present segments in float64 and adds (or maxes) them into ``out``:
    [value, non-finite count, NaN seen]. The order of the additions is not fixed. ``g[i]``
    is read by ``gradient_value``: as it is, or 16-bit patterns in format ``fmt`` as
    float32 (``kernels.cpu.reduce_coded_gradients``)."""
    value, bad, nan = walk(present, offsets, sizes, chunk_first,  # noqa: F821 (bound)
                           chunk_size, g.size, (g, fmt, power, mode), (0.0, 0.0, 0.0))
    if mode == MAX_ABS:
        cuda.atomic.max(out, 0, value)
    elif mode != COUNT_NONFINITE:
        cuda.atomic.add(out, 0, value)
    if bad:
        cuda.atomic.add(out, 1, bad)
    if nan:
        out[2] = 1.0


def stored_value(g, fmt, i):
    """A plain gradient buffer's element (``fmt`` is unused)."""
    return g[i]


reduce_gradients_kernel = make(instantiate(
    _gradient_totals, f"reduce_gradients_kernel_{CHUNKS_FINGERPRINT}", walk=chunk_walk(
        _totals_overlap, "reduce_gradients", gradient_value=cuda.jit(device=True)(stored_value))),
    cache=True)
_reduce_half_gradients: list = []


def reduce_half_gradients_kernel():
    """:func:`_gradient_totals` over 16-bit gradients (uint16 patterns), compiled once."""
    if not _reduce_half_gradients:
        name = f"reduce_half_gradients_{CODEC_FINGERPRINT}"
        walk = chunk_walk(_totals_overlap, name, gradient_value=codec()["half_value"])
        _reduce_half_gradients.append(make(instantiate(_gradient_totals, name, walk=walk),
                                           Source(reduce_half_gradients_kernel)))
    return _reduce_half_gradients[0]


def launch_elementwise(kernel, n: int, stream, *args) -> None:
    """Launch a grid-striding element-wise kernel over ``n`` elements."""
    if n:
        launch(kernel, grid(-(-n // THREADS_PER_BLOCK)), THREADS_PER_BLOCK, stream, *args)


def reduce_gradients(layout, g, present, power: float, mode: int, out, stream=0, fmt=NATIVE):
    """Launch :func:`reduce_gradients_kernel` over one buffer into ``out`` (zeroed by the
    caller); the caller reads ``out`` back once for all buffers. ``fmt``: a
    ``kernels.coded`` 16-bit format when ``g`` holds 16-bit patterns (uint16)."""
    n_chunks = layout.chunk_first.size
    if n_chunks:
        kernel = reduce_gradients_kernel if fmt == NATIVE else reduce_half_gradients_kernel()
        launch(kernel, grid(n_chunks), THREADS_PER_BLOCK, stream, g, fmt, present,
               layout.offsets, layout.sizes, layout.chunk_first, layout.chunk_size,
               float(power), mode, out)


def combine_reduction(out: np.ndarray, mode: int) -> tuple[float, int]:
    """(value, non-finite count) from :func:`reduce_gradients`'s ``out``: a NaN seen makes
    the max-norm NaN, as torch's max propagates it."""
    value = float(out[0])
    if mode == MAX_ABS and out[2]:
        value = math.nan
    return value, int(out[1])


class CudaBackend:
    """The rules' CUDA kernels, over whatever arrays they are given: the device-resident
    optimizer (``flatopt._device``) gives them device arrays; tests may give them the host
    arrays of a CPU optimizer under the simulator (``Optimizer._set_backend("cuda")``)."""

    name = "cuda"
    cuda = cuda  # the numba.cuda module (its arrays, streams and copies)
    reduce_gradients = staticmethod(reduce_gradients)
    combine_reduction = staticmethod(combine_reduction)
    launch_elementwise = staticmethod(launch_elementwise)
    fill_kernel = staticmethod(fill_kernel)
    add_kernel = staticmethod(add_kernel)
    lerp_kernel = staticmethod(lerp_kernel)
    exact_lerp_kernel = staticmethod(exact_lerp_kernel)
    half_kernels = staticmethod(half_kernels)

    @staticmethod
    def compile(rule: Rule, exact: bool = False) -> CompiledRule:
        return compile_rule(rule, exact)

    @staticmethod
    def compile_coded(rule: Rule, layout, exact: bool = False) -> LayoutKernels:
        """The rule's walks over reduced-precision buffers stored as ``layout``
        (``kernels/cuda_coded.py``)."""
        return compile_coded(rule, layout, exact)

    @staticmethod
    def zeros(n_elements: int, dtype):
        return np.zeros(n_elements, dtype)

    def __repr__(self) -> str:
        return "CudaBackend()"


__all__ = ["CudaBackend", "CompiledRule", "compile_rule", "compile_coded", "THREADS_PER_BLOCK", "NO_FMA_MARKER",
           "no_fma_options", "lerp_kernel", "exact_lerp_kernel", "add_kernel", "fill_kernel", "reduce_gradients", "combine_reduction",
           "launch_elementwise"]
