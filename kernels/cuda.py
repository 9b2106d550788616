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


class CompiledRule(NamedTuple):
    """A rule's two CUDA kernels, with the launch configuration."""

    prepare_kernel: object
    step_kernel: object

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
        compiled = _compiled[key] = CompiledRule(prepare, step)
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
