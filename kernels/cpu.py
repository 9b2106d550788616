"""The CPU backend: every rule compiled into two Numba kernels over one flat buffer.

A buffer holds many parameters back to back (with alignment padding between them). Work is cut
into fixed-size element chunks, independent of parameter boundaries, so threads get even work
whether the buffer holds one huge tensor or thousands of small ones. ``chunk_first[c]`` is the
slot of the first parameter that reaches into chunk ``c``; a chunk walks the parameters it
overlaps and hands each overlap to the rule's ``span``, so padding is never touched. This walk
is written once (``_step_walk``); every rule plugs its span into it. Per-parameter bookkeeping
runs first, serially, in ``_prepare_walk`` (a parameter spanning several chunks is counted once).

How the element loops are kept fast (each point was measured; see ``bench/``):

- ``error_model="numpy"``: with Numba's default ("python") every float division checks for
  zero to raise ``ZeroDivisionError``, a branch per element that stops LLVM from vectorising.
  IEEE division is what torch does anyway.
- Spans run over unsigned (``uint64``) index ranges with a stride of one: with signed indices
  Numba's negative-index wraparound check could not be proved dead and the loop stayed scalar.
- Flags stay run-time arguments: once the loop vectorises, LLVM hoists or selects the rule's
  flag branches. Flags that change which arrays are written (AMSGrad, SGD's momentum) get
  separate loops in the span.
- Small buffers (below ``PARALLEL_MIN_ELEMENTS``), and any buffer when Numba runs on one
  thread, take a serial path inside the same kernel (``serial=True``, see :func:`run_serially`):
  the parallel launch's fixed cost exceeds the whole update of a small buffer.
- Kernels are cached on disk (``cache=True``) under the rule's name and source fingerprint,
  so a process loads them instead of compiling, and an edited rule compiles afresh.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import get_num_threads, njit, prange, uint64

from .._layout import aligned_zeros
from ._bind import bind, instantiate
from .rule import Rule

# Below this many elements a buffer is updated on the calling thread. In a back-to-back loop a
# parallel launch costs a few microseconds and pays off from ~32K elements, but in a training
# loop the forward and backward passes run between steps, the worker threads have gone to sleep
# and waking them costs tens of microseconds (more when BLAS threads compete for the cores):
# the demo's 74K-element buffer took 75-87 us serially against 80-650 us in parallel on 2 cores.
PARALLEL_MIN_ELEMENTS = 1 << 17


def _prepare_walk(present, columns, scalars, flags):
    """Prepare every parameter with a gradient, in order; returns how many there are."""
    n_present = 0
    for k in range(present.size):
        if present[k] != 0:
            n_present += 1
    if n_present:
        prepare(present, columns, scalars, flags, 0, present.size, 1)  # noqa: F821 (bound)
    return n_present


@njit(inline="always", error_model="numpy")
def _scale(g, start, stop, multiplier):
    for i in range(start, stop):
        g[i] = g[i] * multiplier


def _step_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
               chunk_size, serial, grad_multiplier, scale_grads):
    """``scale_grads``: each segment's gradients are first multiplied in place by
    ``grad_multiplier`` (loss-scale removal, clipping, averaging), while they are in cache."""
    n_params = offsets.size
    total = arrays[0].size
    one = uint64(1)
    if serial:
        for k in range(n_params):
            if present[k] != 0:
                a = uint64(offsets[k])
                b = uint64(offsets[k] + sizes[k])
                if scale_grads:
                    _scale(arrays[1], a, b, grad_multiplier)
                span(arrays, scalars, columns, flags, k, a, b, one)  # noqa: F821 (bound)
        return
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = uint64(max(lo, offsets[k]))
                b = uint64(min(hi, offsets[k] + sizes[k]))
                if scale_grads:
                    _scale(arrays[1], a, b, grad_multiplier)
                span(arrays, scalars, columns, flags, k, a, b, one)  # noqa: F821 (bound)
            k += 1


def _reduce_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
                 chunk_size, sums, grad_multiplier, scale_grads):
    """The rule's ``reduce`` over every present segment, in parallel over chunks; each
    segment's partial totals are kept apart and added into ``sums[k]`` in chunk order, so the
    totals do not depend on the thread count. Gradients are scaled here when asked (the step
    that follows then leaves them alone)."""
    n_chunks = chunk_first.size
    n_params = offsets.size
    total = arrays[0].size
    first_segment = np.zeros(n_chunks + 1, np.int64)
    for c in range(n_chunks):
        hi = min(c * chunk_size + chunk_size, total)
        k = chunk_first[c]
        count = 0
        while k < n_params and offsets[k] < hi:
            count += 1
            k += 1
        first_segment[c + 1] = first_segment[c] + count
    partial = np.zeros((first_segment[n_chunks], sums.shape[1]))
    one = uint64(1)
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a = uint64(max(lo, offsets[k]))
                b = uint64(min(hi, offsets[k] + sizes[k]))
                if scale_grads:
                    _scale(arrays[1], a, b, grad_multiplier)
                values = reduce(arrays, scalars, columns, flags, k, a, b, one)  # noqa: F821
                for j in range(sums.shape[1]):
                    partial[segment, j] = values[j]
            k += 1
            segment += 1
    sums[...] = 0.0
    for c in range(n_chunks):
        hi = min(c * chunk_size + chunk_size, total)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            for j in range(sums.shape[1]):
                sums[k, j] += partial[segment, j]
            k += 1
            segment += 1


def _finalize_walk(present, columns, scalars, flags, sums):
    finalize(present, columns, scalars, flags, 0, present.size, 1, sums)  # noqa: F821


# Gradient reductions: what a norm or a non-finite check needs of the present gradients.
COUNT_NONFINITE, SUM_SQUARES, SUM_POWERS, MAX_ABS = 0, 1, 2, 3


@njit(inline="always", error_model="numpy")
def _reduce_segment(g, start, stop, power, mode):
    """(sum of |g|**power or of g*g, or max |g|; how many values are NaN or infinite), in
    float64, over g[start:stop]."""
    value = 0.0
    bad = 0
    if mode == SUM_SQUARES:
        for i in range(start, stop):
            x = float(g[i])
            value += x * x
            bad += not (x - x == 0)
    elif mode == SUM_POWERS:
        for i in range(start, stop):
            x = abs(float(g[i]))
            value += x ** power
            bad += not (x - x == 0)
    elif mode == MAX_ABS:
        for i in range(start, stop):
            x = abs(float(g[i]))
            if not (x <= value):  # NaN propagates, as torch's max does
                value = x
            bad += not (x - x == 0)
    else:
        for i in range(start, stop):
            x = g[i]
            bad += not (x - x == 0)
    return value, bad


@njit(inline="always", error_model="numpy")
def _reduce_chunk(g, present, offsets, sizes, chunk_first, chunk_size, power, mode, c):
    lo = c * chunk_size
    hi = min(lo + chunk_size, g.size)
    k = chunk_first[c]
    value = 0.0
    bad = 0
    while k < offsets.size and offsets[k] < hi:
        if present[k] != 0:
            v, n = _reduce_segment(g, max(lo, offsets[k]), min(hi, offsets[k] + sizes[k]),
                                   power, mode)
            if mode == MAX_ABS:
                if not (v <= value):
                    value = v
            else:
                value += v
            bad += n
        k += 1
    return value, bad


@njit(parallel=True, cache=True, error_model="numpy")
def reduce_gradients(g, present, offsets, sizes, chunk_first, chunk_size, power, mode, serial):
    """One pass over the present gradients of a buffer: (value, non-finite count), ``value``
    per ``mode`` (see the constants). Partial results are combined in chunk order whatever the
    thread count, so the result does not depend on it."""
    n_chunks = chunk_first.size
    partial = np.zeros(n_chunks)
    partial_bad = np.zeros(n_chunks, np.int64)
    if serial:
        for c in range(n_chunks):
            partial[c], partial_bad[c] = _reduce_chunk(g, present, offsets, sizes, chunk_first,
                                                       chunk_size, power, mode, c)
    else:
        for c in prange(n_chunks):
            partial[c], partial_bad[c] = _reduce_chunk(g, present, offsets, sizes, chunk_first,
                                                       chunk_size, power, mode, c)
    value = 0.0
    for c in range(n_chunks):
        if mode == MAX_ABS:
            if not (partial[c] <= value):
                value = partial[c]
        else:
            value += partial[c]
    return value, partial_bad.sum()


def run_serially(n_elements: int) -> bool:
    """Whether a buffer of ``n_elements`` should skip the parallel launch."""
    return n_elements < PARALLEL_MIN_ELEMENTS or get_num_threads() == 1


class CompiledRule(NamedTuple):
    """A rule's CPU kernels (Numba dispatchers, compiled on first call or loaded from the
    cache): prepare and step, and reduce and finalize for rules with per-parameter totals."""

    prepare_kernel: object
    step_kernel: object
    reduce_kernel: object = None
    finalize_kernel: object = None
    serial_reduce_kernel: object = None
    """The same walk compiled without threads (``prange`` is then ``range``), for small
    buffers: the same segments summed in the same order, so the same totals."""

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads: bool) -> None:
        kernel = (self.serial_reduce_kernel if run_serially(layout.length)
                  else self.reduce_kernel)
        kernel(arrays, scalars, columns, flags, layout.present, layout.offsets,
                           layout.sizes, layout.chunk_first, layout.chunk_size, sums,
                           grad_multiplier, scale_grads)

    def finalize(self, present, columns, scalars, flags, sums) -> None:
        self.finalize_kernel(present, columns, scalars, flags, sums)

    def prepare(self, present, columns, scalars, flags) -> int:
        return self.prepare_kernel(present, columns, scalars, flags)

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier,
             scale_grads: bool) -> None:
        """``grad_multiplier`` is a scalar of the buffer's dtype."""
        self.step_kernel(arrays, scalars, columns, flags, layout.present, layout.offsets,
                         layout.sizes, layout.chunk_first, layout.chunk_size,
                         run_serially(layout.length), grad_multiplier, scale_grads)


_compiled: dict[tuple[str, bool], CompiledRule] = {}


def compile_rule(rule: Rule, cache: bool = True) -> CompiledRule:
    """The rule's CPU kernels (one pair per rule and fingerprint, per process). ``cache=False``
    gives kernels that always compile in this process (to inspect their LLVM IR)."""
    key = f"{rule.name}_{rule.fingerprint}"
    compiled = _compiled.get((key, cache))
    if compiled is None:
        functions = bind(rule, njit(inline="always", error_model="numpy"))
        prepare = njit(cache=cache)(instantiate(
            _prepare_walk, f"prepare_{key}", prepare=functions[rule.prepare.__name__]))
        step = njit(parallel=True, cache=cache, error_model="numpy")(instantiate(
            _step_walk, f"step_{key}", span=functions[rule.span.__name__]))
        reduce = finalize = serial_reduce = None
        if rule.reduce is not None:
            # reassociation lets the sums vectorize (4x here); reduce stores nothing, so
            # no stored value depends on it (kernels/rule.py)
            reduce, serial_reduce = (
                njit(parallel=parallel, cache=cache, error_model="numpy",
                     fastmath={"reassoc"})(instantiate(
                         _reduce_walk, f"reduce_{'parallel' if parallel else 'serial'}_{key}",
                         reduce=functions[rule.reduce.__name__]))
                for parallel in (True, False))
            finalize = njit(cache=cache)(instantiate(
                _finalize_walk, f"finalize_{key}", finalize=functions[rule.finalize.__name__]))
        compiled = _compiled[key, cache] = CompiledRule(prepare, step, reduce, finalize,
                                                        serial_reduce)
    return compiled


class CpuBackend:
    """Buffers in host memory, stepped by the kernels above."""

    name = "cpu"

    @staticmethod
    def compile(rule: Rule) -> CompiledRule:
        return compile_rule(rule)

    @staticmethod
    def zeros(n_elements: int, dtype):
        """A zero-filled buffer, 64-byte aligned (see ``flatopt._layout``)."""
        return aligned_zeros(n_elements, dtype)

    def __repr__(self) -> str:
        return "CpuBackend()"


__all__ = ["CpuBackend", "CompiledRule", "compile_rule", "run_serially",
           "PARALLEL_MIN_ELEMENTS"]
