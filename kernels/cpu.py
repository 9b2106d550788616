"""The CPU backend: every rule compiled into Numba kernels over one flat buffer (prepare and
step; reduce and finalize for rules with per-parameter totals; the walks serial and parallel).

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
  separate loops in the span, and are the rule's ``variants``: the step walk is compiled per
  combination of their values a step uses, holding only its loop (``kernels/variants.py``;
  Adam's walk compiled in 0.6 s instead of 1.8 s).
- Every walk is a :class:`~.threads.Threaded` kernel: compiled once with threads and once
  without; small buffers (see :func:`~.threads.run_serially`) take the one without, which
  never touches Numba's thread pool, larger ones the way measured faster there. The threaded
  one's ``prange`` loop is its only parallel region (no ``np.zeros`` or ``.sum()`` in it:
  those would be parallel launches of their own).
- Kernels are cached on disk (``cache=True``) under the rule's name and source fingerprint,
  so a process loads them instead of compiling, and an edited rule compiles afresh.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from .._layout import aligned_zeros
from ._bind import bind, instantiate
from .coded import CODEC, SUB, compile_coded
from .rule import Rule
from . import segments
from .segments import add_segments, first_segments
from .threads import Threaded
from .variants import VariantKernels, suffix
from .tools import lerp_into


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
def _overlap(lo, hi, offset, size):
    """The overlap ``[a, b)`` of the chunk ``[lo, hi)`` and the segment of ``size`` elements
    at ``offset``, unsigned (the spans' index ranges)."""
    return uint64(max(lo, offset)), uint64(min(hi, offset + size))


@njit(inline="always", error_model="numpy")
def _scale(g, start, stop, multiplier):
    for i in range(start, stop):
        g[i] = g[i] * multiplier


def _step_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
               chunk_size, grad_multiplier, scale_grads):
    """``scale_grads``: each segment's gradients are first multiplied in place by
    ``grad_multiplier`` (loss-scale removal, clipping, averaging), while they are in cache."""
    n_params = offsets.size
    total = arrays[0].size
    one = uint64(1)
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a, b = _overlap(lo, hi, offsets[k], sizes[k])
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
    n_sums = sums.shape[1]
    first_segment = first_segments(offsets, chunk_first, chunk_size, total)
    partial = np.empty((first_segment[n_chunks], n_sums))  # rows of absent parameters unread
    one = uint64(1)
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                a, b = _overlap(lo, hi, offsets[k], sizes[k])
                if scale_grads:
                    _scale(arrays[1], a, b, grad_multiplier)
                values = reduce(arrays, scalars, columns, flags, k, a, b, one)  # noqa: F821
                for j in range(n_sums):
                    partial[segment, j] = values[j]
            k += 1
            segment += 1
    add_segments(sums, partial, first_segment, present, offsets, chunk_first, chunk_size,
                 total)


def _finalize_walk(present, columns, scalars, flags, sums):
    finalize(present, columns, scalars, flags, 0, present.size, 1, sums)  # noqa: F821


# Gradient reductions: what a norm or a non-finite check needs of the present gradients.
COUNT_NONFINITE, SUM_SQUARES, SUM_POWERS, MAX_ABS = 0, 1, 2, 3
MODE_NAMES = {COUNT_NONFINITE: "count_nonfinite", SUM_SQUARES: "sum_squares",
              SUM_POWERS: "sum_powers", MAX_ABS: "max_abs"}

# The functions below are templates compiled once per mode (``_by_mode``), ``MODE`` bound as
# a constant: Numba then drops the other modes' loops before compiling (an L2 clip compiles
# one loop, not four). MODE's value here only lets the module import.
MODE = SUM_SQUARES


def _reduce_segment(g, start, stop, power):
    """(sum of |g|**power or of g*g, or max |g|; how many values are NaN or infinite), in
    float64, over g[start:stop], per ``MODE``.

    Compiled with reassociation (only this function: the callers add segments and chunks up
    in order), so the sums vectorize: 12x on float32 squares here. Their order is then fixed
    by the build and the machine, not by the thread count. The values are counted only when
    the result is not finite, which a NaN or an infinity among them makes it."""
    a = uint64(start)
    b = uint64(stop)
    value = 0.0
    if MODE == SUM_SQUARES:
        for i in range(a, b):
            x = float(g[i])
            value += x * x
    elif MODE == SUM_POWERS:
        for i in range(a, b):
            value += abs(float(g[i])) ** power
    elif MODE == MAX_ABS:
        for i in range(a, b):
            x = abs(float(g[i]))
            if not (x <= value):  # NaN propagates, as torch's max does
                value = x
    else:
        for i in range(a, b):
            x = float(g[i])
            value += x - x  # 0, or NaN for a NaN or an infinity
    bad = 0
    if not (value - value == 0):
        for i in range(a, b):
            x = g[i]
            bad += not (x - x == 0)
    return (0.0 if MODE == COUNT_NONFINITE else value), bad


def _combined(value, v):
    """A running ``value`` and a partial ``v`` combined per ``MODE``: the larger for MAX_ABS
    (a NaN kept: ``not (v <= value)``), else the sum."""
    if MODE == MAX_ABS:
        return v if not (v <= value) else value
    return value + v


def _total(partial, partial_bad):
    """The chunks' partials combined in chunk order (the same value at any thread count)."""
    value = 0.0
    bad = 0
    for c in range(partial.size):
        value = _combined(value, partial[c])
        bad += partial_bad[c]
    return value, bad


def _reduce_chunk(g, present, offsets, sizes, chunk_first, chunk_size, total, power, c):
    """(value, non-finite count) of chunk ``c``'s present gradients: each overlap of the
    chunk and a present parameter taken into the running pair by ``_add_overlap`` (bound:
    :func:`_add_segment`, or :func:`_add_coded_segment` over 16-bit gradients), in order."""
    lo = c * chunk_size
    hi = min(lo + chunk_size, total)
    k = chunk_first[c]
    value = 0.0
    bad = 0
    while k < offsets.size and offsets[k] < hi:
        if present[k] != 0:
            value, bad = _add_overlap(g, max(lo, offsets[k]),  # noqa: F821 (bound)
                                      min(hi, offsets[k] + sizes[k]), power, value, bad)
        k += 1
    return value, bad


def _add_segment(g, start, stop, power, value, bad):
    """The running (value, non-finite count) with ``g[start:stop]``'s taken in."""
    v, n = _reduce_segment(g, start, stop, power)
    return _combined(value, v), bad + n


_load_row = CODEC["load_row"]


@njit(inline="always")
def _coded(raw, fmt):
    """The 16-bit gradients as :func:`_add_coded_segment` takes them, with a row of their
    own (one per chunk: a chunk's segments load into it in turn)."""
    return raw, fmt, np.empty(SUB, np.float32), np.empty(0, np.float32)


def _add_coded_segment(coded, start, stop, power, value, bad):
    """:func:`_add_segment` over 16-bit gradients, ``coded`` = (their bytes, their format, a
    float32 row of ``SUB`` elements, no block scales): loaded as float32 in sub-blocks, each
    taken in in turn."""
    raw, fmt, row, scales = coded
    for first in range(start, stop, SUB):
        n = min(SUB, stop - first)
        _load_row(raw, fmt, scales, first, n, row)
        v, count = _reduce_segment(row, 0, n, power)
        value = _combined(value, v)
        bad += count
    return value, bad


def _reduce_gradients(g, present, offsets, sizes, chunk_first, chunk_size, power, partial,
                      partial_bad):
    n_chunks = chunk_first.size
    for c in prange(n_chunks):
        partial[c], partial_bad[c] = _reduce_chunk(g, present, offsets, sizes, chunk_first,
                                                   chunk_size, g.size, power, c)
    return _total(partial, partial_bad)


def _reduce_coded_gradients(raw, fmt, present, offsets, sizes, chunk_first, chunk_size, total,
                            power):
    n_chunks = chunk_first.size
    partial = np.empty(n_chunks)
    partial_bad = np.empty(n_chunks, np.int64)
    for c in prange(n_chunks):
        partial[c], partial_bad[c] = _reduce_coded_chunk(  # noqa: F821 (bound)
            _coded(raw, fmt), present, offsets, sizes, chunk_first, chunk_size, total, power, c)
    return _total(partial, partial_bad)


def _coded_gradient_chunk_partials(raw, fmt, present, offsets, sizes, chunk_first, chunk_size,
                                   total, power, first_chunk, stop_chunk):
    n = stop_chunk - first_chunk
    partial = np.empty(n)
    bad = np.empty(n, np.int64)
    for j in prange(n):
        partial[j], bad[j] = _reduce_coded_chunk(  # noqa: F821 (bound)
            _coded(raw, fmt), present, offsets, sizes, chunk_first, chunk_size, total, power,
            first_chunk + j)
    return partial, bad


def _gradient_chunk_partials(g, present, offsets, sizes, chunk_first, chunk_size, power,
                             first_chunk, partial, bad):
    for j in prange(partial.size):
        partial[j], bad[j] = _reduce_chunk(g, present, offsets, sizes, chunk_first,
                                           chunk_size, g.size, power, first_chunk + j)


_mode_helpers: dict[int, dict] = {}
_mode_kernels: dict[tuple[str, int], Threaded] = {}


def _by_mode(template, mode: int) -> Threaded:
    """The threaded kernel of ``template`` with ``MODE`` = ``mode`` (made once per process;
    Numba compiles it on its first call)."""
    kernel = _mode_kernels.get((template.__name__, mode))
    if kernel is None:
        if mode not in MODE_NAMES:
            raise ValueError(f"unknown gradient reduction mode {mode!r}")
        helpers = _mode_helpers.get(mode)
        if helpers is None:
            name = MODE_NAMES[mode]
            segment = njit(fastmath={"reassoc"}, error_model="numpy")(
                instantiate(_reduce_segment, f"_reduce_segment_{name}", MODE=mode))
            inline = njit(inline="always", error_model="numpy")
            combined = inline(instantiate(_combined, f"_combined_{name}", MODE=mode))
            bound = {"MODE": mode, "_reduce_segment": segment, "_combined": combined}
            add = inline(instantiate(_add_segment, f"_add_segment_{name}", **bound))
            add_coded = inline(instantiate(_add_coded_segment, f"_add_coded_segment_{name}",
                                           **bound))
            helpers = _mode_helpers[mode] = {
                **bound, "_total": inline(instantiate(_total, f"_total_{name}", **bound)),
                "_reduce_chunk": inline(instantiate(_reduce_chunk, f"_reduce_chunk_{name}",
                                                    _add_overlap=add)),
                "_reduce_coded_chunk": inline(instantiate(
                    _reduce_chunk, f"_reduce_coded_chunk_{name}", _add_overlap=add_coded))}
        kernel = _mode_kernels[template.__name__, mode] = Threaded(
            template, f"cpu.{template.__name__.lstrip('_')}_{MODE_NAMES[mode]}", cache=True,
            error_model="numpy", bound=helpers)
    return kernel


def reduce_gradients(n_elements, g, present, offsets, sizes, chunk_first, chunk_size, power,
                     mode):
    """One pass over the present gradients of a buffer: (value, non-finite count), ``value``
    per ``mode`` (see the constants). Partial results are combined in chunk order whatever the
    thread count, so the result does not depend on it. (A :class:`Threaded` call: the first
    argument is the element count that picks the way.)"""
    # the partial results' arrays come from here: np.empty compiled into the kernel would
    # cost its first compile 0.1 s more
    n_chunks = chunk_first.size
    return _by_mode(_reduce_gradients, mode)(n_elements, g, present, offsets, sizes,
                                             chunk_first, chunk_size, power,
                                             np.empty(n_chunks), np.empty(n_chunks, np.int64))


def reduce_coded_gradients(n_elements, raw, fmt, present, offsets, sizes, chunk_first,
                           chunk_size, total, power, mode):
    """reduce_gradients over 16-bit gradients (``raw``: their bytes, ``fmt`` their
    ``kernels.coded`` format): each segment loaded as float32 in sub-blocks; the partial
    results of a chunk combined in order, then the chunks' in chunk order."""
    return _by_mode(_reduce_coded_gradients, mode)(n_elements, raw, fmt, present, offsets,
                                                   sizes, chunk_first, chunk_size, total, power)


def coded_gradient_chunk_partials(n_elements, raw, fmt, present, offsets, sizes, chunk_first,
                                  chunk_size, total, power, mode, first_chunk, stop_chunk):
    """gradient_chunk_partials over 16-bit gradients (a ZeRO-1 rank's chunks)."""
    return _by_mode(_coded_gradient_chunk_partials, mode)(
        n_elements, raw, fmt, present, offsets, sizes, chunk_first, chunk_size, total, power,
        first_chunk, stop_chunk)


def gradient_chunk_partials(n_elements, g, present, offsets, sizes, chunk_first, chunk_size,
                            power, mode, first_chunk, stop_chunk):
    """reduce_gradients' per-chunk partial values and non-finite counts for the chunks
    ``[first_chunk, stop_chunk)`` of the buffer, left for the caller to combine in order (a
    ZeRO-1 rank's range: ``flatopt.distributed``)."""
    partial, bad = np.empty(stop_chunk - first_chunk), np.empty(stop_chunk - first_chunk, np.int64)
    _by_mode(_gradient_chunk_partials, mode)(
        n_elements, g, present, offsets, sizes, chunk_first, chunk_size, power, first_chunk,
        partial, bad)
    return partial, bad


class CompiledRule:
    """A rule's CPU kernels (Numba dispatchers, compiled on first call or loaded from the
    cache): prepare, step, and reduce and finalize for rules with per-parameter totals.
    ``step`` and ``reduce`` are :class:`Threaded` walks; a rule with ``Rule.variants`` has
    one step walk per combination of those flags' values, made the first time a step uses it
    (``step_kernel(flags)``)."""

    __slots__ = ("rule", "key", "cache", "functions", "prepare_kernel", "reduce_kernel",
                 "finalize_kernel", "step_kernel")

    def __init__(self, rule: Rule, key: str, cache: bool, functions: dict, prepare_kernel,
                 reduce_kernel=None, finalize_kernel=None):
        self.rule, self.key, self.cache, self.functions = rule, key, cache, functions
        self.prepare_kernel = prepare_kernel
        self.reduce_kernel = reduce_kernel
        self.finalize_kernel = finalize_kernel
        self.step_kernel = VariantKernels(rule, self._step_walk)

    @property
    def step_kernels(self) -> dict[tuple, Threaded]:
        """The step walks made so far, by the values of the rule's variant flags."""
        return self.step_kernel.kernels

    def _step_walk(self, values: dict[str, bool]) -> Threaded:
        functions = self.functions
        if values:
            functions = bind(self.rule, njit(inline="always", error_model="numpy"),
                             constant_flags=values)
        return Threaded(_step_walk, f"step_{self.key}{suffix(values)}", cache=self.cache,
                        error_model="numpy", bound={"span": functions[self.rule.span.__name__]})

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads: bool) -> None:
        self.reduce_kernel(
            layout.length, arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
            layout.chunk_first, layout.chunk_size, sums, grad_multiplier, scale_grads)

    def finalize(self, present, columns, scalars, flags, sums) -> None:
        self.finalize_kernel(present, columns, scalars, flags, sums)

    def prepare(self, present, columns, scalars, flags) -> int:
        return self.prepare_kernel(present, columns, scalars, flags)

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier,
             scale_grads: bool) -> None:
        """``grad_multiplier`` is a scalar of the buffer's dtype."""
        self.step_kernel(flags)(
            layout.length, arrays, scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
            layout.chunk_first, layout.chunk_size, grad_multiplier, scale_grads)


_compiled: dict[tuple[str, bool], CompiledRule] = {}


def compile_rule(rule: Rule, cache: bool = True) -> CompiledRule:
    """The rule's CPU kernels (one set per rule and fingerprint, per process). ``cache=False``
    gives kernels that always compile in this process (to inspect their LLVM IR)."""
    key = f"{rule.name}_{rule.fingerprint}"
    compiled = _compiled.get((key, cache))
    if compiled is None:
        functions = bind(rule, njit(inline="always", error_model="numpy"))
        # NumPy's error model: a prepare that divides by zero gives inf, never stops the
        # walk with some parameters' step counts advanced (a user rule's per_step)
        prepare = njit(cache=cache, error_model="numpy")(instantiate(
            _prepare_walk, f"prepare_{key}", prepare=functions[rule.prepare.__name__]))
        reduce = finalize = None
        if rule.reduce is not None:
            # reassociation lets the sums vectorize (4x here); reduce stores nothing, so
            # no stored value depends on it (kernels/rule.py)
            reduce = Threaded(_reduce_walk, f"reduce_{key}_{segments.FINGERPRINT}", cache=cache,
                              error_model="numpy", fastmath={"reassoc"},
                              bound={"reduce": functions[rule.reduce.__name__]})
            if rule.finalize is not None:  # none with global reductions
                finalize = njit(cache=cache, error_model="numpy")(instantiate(
                    _finalize_walk, f"finalize_{key}",
                    finalize=functions[rule.finalize.__name__]))
        compiled = _compiled[key, cache] = CompiledRule(rule, key, cache, functions, prepare,
                                                        reduce, finalize)
    return compiled


class CpuBackend:
    """Buffers in host memory, stepped by the kernels above."""

    name = "cpu"
    reduce_gradients = staticmethod(reduce_gradients)
    reduce_coded_gradients = staticmethod(reduce_coded_gradients)
    gradient_chunk_partials = staticmethod(gradient_chunk_partials)
    coded_gradient_chunk_partials = staticmethod(coded_gradient_chunk_partials)
    lerp = staticmethod(lerp_into)

    @staticmethod
    def compile(rule: Rule) -> CompiledRule:
        return compile_rule(rule)

    @staticmethod
    def compile_coded(rule: Rule, layout):
        """The rule's walks over reduced-precision buffers stored as ``layout``
        (``kernels/coded.py``)."""
        return compile_coded(rule, layout, compile_rule(rule))

    @staticmethod
    def zeros(n_elements: int, dtype):
        """A zero-filled buffer, 64-byte aligned (see ``flatopt._layout``)."""
        return aligned_zeros(n_elements, dtype)

    def __repr__(self) -> str:
        return "CpuBackend()"


__all__ = ["CpuBackend", "CompiledRule", "compile_rule", "reduce_gradients",
           "gradient_chunk_partials", "coded_gradient_chunk_partials"]
