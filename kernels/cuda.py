"""The CUDA backend (numba-cuda): every rule compiled from the same functions as on the CPU.

The layout is the CPU's: one block per chunk of ``chunk_size`` elements (grid-striding over
chunks), ``chunk_first[c]`` the first parameter reaching into chunk ``c``; the threads of a
block stride over each parameter segment of the chunk (the span's ``stride``), so loads and
stores coalesce. Per-parameter bookkeeping runs first in a one-thread-per-parameter kernel.
Arguments are device arrays (or host arrays under the simulator, ``NUMBA_ENABLE_CUDASIM=1``)
with the same layouts and dtypes as for ``kernels.cpu``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from ._bind import bind, instantiate
from .rule import Rule

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535


def _prepare_walk(present, columns, scalars, flags):
    k = cuda.grid(1)
    if k < present.size:
        prepare(present, columns, scalars, flags, k, k + 1, 1)  # noqa: F821 (bound per rule)


def _step_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
               chunk_size, grad_multiplier, scale_grads):
    n_params = offsets.size
    total = arrays[0].size
    g = arrays[1]
    for c in range(cuda.blockIdx.x, chunk_first.size, cuda.gridDim.x):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k]) + cuda.threadIdx.x
                b = min(hi, offsets[k] + sizes[k])
                if scale_grads:  # each thread scales the elements its span then reads
                    for i in range(a, b, cuda.blockDim.x):
                        g[i] = g[i] * grad_multiplier
                span(arrays, scalars, columns, flags, k, a, b,  # noqa: F821 (bound per rule)
                     cuda.blockDim.x)
            k += 1


def _reduce_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
                 chunk_size, sums, grad_multiplier, scale_grads):
    """Each thread reduces its strided elements of each segment and adds its partial totals
    into ``sums[k]`` atomically (the order of additions is not fixed, unlike the CPU's)."""
    n_params = offsets.size
    total = arrays[0].size
    g = arrays[1]
    for c in range(cuda.blockIdx.x, chunk_first.size, cuda.gridDim.x):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = max(lo, offsets[k]) + cuda.threadIdx.x
                b = min(hi, offsets[k] + sizes[k])
                if scale_grads:
                    for i in range(a, b, cuda.blockDim.x):
                        g[i] = g[i] * grad_multiplier
                if a < b:
                    values = reduce(arrays, scalars, columns, flags, k, a, b,  # noqa: F821
                                    cuda.blockDim.x)
                    for j in range(sums.shape[1]):
                        cuda.atomic.add(sums, (k, j), values[j])
            k += 1


def _finalize_walk(present, columns, scalars, flags, sums):
    k = cuda.grid(1)
    if k < present.size:
        finalize(present, columns, scalars, flags, k, k + 1, 1, sums)  # noqa: F821 (bound)


class CompiledRule(NamedTuple):
    """A rule's CUDA kernels, with the launch configuration."""

    prepare_kernel: object
    step_kernel: object
    reduce_kernel: object = None
    finalize_kernel: object = None

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads, threads=THREADS_PER_BLOCK) -> None:
        sums[...] = 0.0
        n_chunks = layout.chunk_first.size
        if n_chunks:
            self.reduce_kernel[max(1, min(n_chunks, MAX_BLOCKS)), threads](
                arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
                layout.chunk_first, layout.chunk_size, sums, grad_multiplier, scale_grads)

    def finalize(self, present, columns, scalars, flags, sums) -> None:
        n = present.size
        if n:
            self.finalize_kernel[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](
                present, columns, scalars, flags, sums)

    def prepare(self, present, columns, scalars, flags) -> int:
        n_present = int(np.count_nonzero(present))  # presence lives on the host
        if n_present:
            n = present.size
            self.prepare_kernel[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](
                present, columns, scalars, flags)
        return n_present

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier, scale_grads,
             threads=THREADS_PER_BLOCK) -> None:
        n_chunks = layout.chunk_first.size
        if n_chunks:
            self.step_kernel[max(1, min(n_chunks, MAX_BLOCKS)), threads](
                arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
                layout.chunk_first, layout.chunk_size, grad_multiplier, scale_grads)


_compiled: dict[str, CompiledRule] = {}


def compile_rule(rule: Rule) -> CompiledRule:
    key = f"{rule.name}_{rule.fingerprint}"
    compiled = _compiled.get(key)
    if compiled is None:
        functions = bind(rule, cuda.jit(device=True))
        prepare = cuda.jit(instantiate(_prepare_walk, f"prepare_{key}",
                                       prepare=functions[rule.prepare.__name__]))
        step = cuda.jit(instantiate(_step_walk, f"step_{key}",
                                    span=functions[rule.span.__name__]))
        reduce = finalize = None
        if rule.reduce is not None:
            reduce = cuda.jit(instantiate(_reduce_walk, f"reduce_{key}",
                                          reduce=functions[rule.reduce.__name__]))
            finalize = cuda.jit(instantiate(_finalize_walk, f"finalize_{key}",
                                            finalize=functions[rule.finalize.__name__]))
        compiled = _compiled[key] = CompiledRule(prepare, step, reduce, finalize)
    return compiled


class CudaBackend:
    """The rules' CUDA kernels. The optimizer classes still keep their buffers in host memory
    (which the simulator accepts); device-resident buffers are the device issue's work."""

    name = "cuda"

    @staticmethod
    def compile(rule: Rule) -> CompiledRule:
        return compile_rule(rule)

    @staticmethod
    def zeros(n_elements: int, dtype):
        return np.zeros(n_elements, dtype)

    def __repr__(self) -> str:
        return "CudaBackend()"


__all__ = ["CudaBackend", "CompiledRule", "compile_rule", "THREADS_PER_BLOCK"]
