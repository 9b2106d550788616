"""The storage codec around a rule: the CPU walk for buffers stored in reduced precision.

A rule's span and reduce compute in float32 over arrays of float32. When a buffer stores its
parameters, gradients or state otherwise (16-bit parameters, master weights, Kahan
compensation, bfloat16 or 8-bit state: ``flatopt/_storage.py``), this walk cuts each
chunk-parameter overlap into sub-blocks of ``SUB`` elements, *loads* every stored array of
the sub-block into a float32 scratch row (kept in the core's cache), runs the rule's own span
on the rows, and *stores* each row back with its format's rounding. Memory traffic is then
the stored bytes; the rule body is the same function the plain walk and CUDA compile.

Every stored array reaches the kernel as raw bytes (``uint8``), so the arrays form one
homogeneous tuple whatever their formats; ``formats[j]`` says how to read and write array
``j``: the rule's ``(params, grads, *slots)`` followed by the master copy and the Kahan
compensation. ``absmax[j]`` holds array ``j``'s 8-bit block scales (empty otherwise).

Stochastic rounding draws from ``mix32(seed, draw, stream, element)``: ``draw`` counts the
buffer's steps, ``stream`` is the array's position and ``element`` its index in the buffer,
so the bits do not depend on threads, chunking, sub-blocks or world size, and a resumed run
(which restores ``draw``) draws the same. The walk's arrays may be a ZeRO-1 rank's range of
the buffer (indexed from its start): ``base`` is then the range's first element, added to
the index each draw hashes.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import numpy as np
from numba import njit, prange, uint64

from . import storage
from ._bind import bind, bind_functions
from .rule import Rule
from .storage import BLOCK, DYNAMIC_SIGNED, DYNAMIC_UNSIGNED
from .threads import Threaded

# How each stored array is read and written.
UNUSED, NATIVE, BF16, F16, Q8_SIGNED, Q8_UNSIGNED = 0, 1, 2, 3, 4, 5
# How the parameters are written (formats[0] is their 16-bit format).
DIRECT, MASTER, KAHAN = 0, 1, 2
NEAREST, STOCHASTIC = 0, 1

SUB = 2048
"""Elements per sub-block: the float32 rows of one sub-block (up to eight arrays) stay in the
core's cache between loading, the rule and storing. A multiple of ``BLOCK``."""

TABLES = np.stack([DYNAMIC_SIGNED, DYNAMIC_UNSIGNED]).astype(np.float32)


def load_row(raw, fmt, scales, tables, start, n, row):
    """``row[:n]`` = the float32 values of elements ``[start, start + n)`` of ``raw``."""
    if fmt == NATIVE:
        src = raw.view(np.float32)
        for i in range(n):
            row[i] = src[start + i]
    elif fmt == BF16:
        bits = raw.view(np.uint16)
        for i in range(n):
            row[i] = bf16_decode(bits[start + i])
    elif fmt == F16:
        bits = raw.view(np.uint16)
        for i in range(n):
            row[i] = f16_decode(bits[start + i])
    elif fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
        table = tables[fmt - Q8_SIGNED]
        for b in range(0, n, BLOCK):
            stop = min(b + BLOCK, n)
            q8_decode_block(raw, start + b, start + stop, table, scales[(start + b) // BLOCK],
                            row, b)


def store_row(raw, fmt, rounding, scales, start, n, row, seed, draw, stream, base):
    """Elements ``[start, start + n)`` of ``raw`` = ``row[:n]`` in ``fmt``, rounded to
    nearest or stochastically (16-bit formats; element ``start + i`` draws as buffer element
    ``base + start + i``: ``raw`` may be a ZeRO-1 rank's range); 8-bit blocks get a new
    scale each."""
    if fmt == NATIVE:
        dst = raw.view(np.float32)
        for i in range(n):
            dst[start + i] = row[i]
    elif fmt == BF16 or fmt == F16:
        bits = raw.view(np.uint16)
        if rounding == STOCHASTIC:
            for i in range(n):
                r = mix32(seed, draw, stream, base + uint64(start + i))
                if fmt == BF16:
                    bits[start + i] = bf16_encode_stochastic(row[i], r)
                else:
                    bits[start + i] = f16_encode_stochastic(row[i], r)
        elif fmt == BF16:
            for i in range(n):
                bits[start + i] = bf16_encode_nearest(row[i])
        else:
            for i in range(n):
                bits[start + i] = f16_encode_nearest(row[i])
    elif fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
        signed = fmt == Q8_SIGNED
        for b in range(0, n, BLOCK):  # blocks start at each parameter (256-aligned offsets)
            scales[(start + b) // BLOCK] = q8_encode_block(row, b, min(b + BLOCK, n), raw,
                                                           start + b, signed)


def store_half(raw, fmt, scales, start, n, row):
    """Elements ``[start, start + n)`` of a 16-bit array = ``row[:n]`` rounded to nearest
    (``scales``: any float32 array, unread)."""
    store_row(raw, fmt, NEAREST, scales, start, n, row, uint64(0), uint64(0), uint64(0),
              uint64(0))


def _coded_segment(stored, formats, absmax, tables, rounding, mode, seed, draw, base,
                   scratch, start, n, scale_grads, grad_multiplier, n_arrays):
    """Load the rule's rows of one sub-block (the gradients scaled, and stored back, when
    asked)."""
    if mode == MASTER:
        load_row(stored[n_arrays], NATIVE, absmax[0], tables, start, n, scratch[0])
    else:
        load_row(stored[0], formats[0], absmax[0], tables, start, n, scratch[0])
        if mode == KAHAN:
            for i in range(n):
                scratch[n_arrays][i] = scratch[0][i]
    load_row(stored[1], formats[1], absmax[1], tables, start, n, scratch[1])
    if scale_grads:
        for i in range(n):
            scratch[1][i] = scratch[1][i] * grad_multiplier
        store_row(stored[1], formats[1], NEAREST, absmax[1], start, n, scratch[1], seed,
                  draw, uint64(1), base)
    for j in range(2, n_arrays):
        load_row(stored[j], formats[j], absmax[j], tables, start, n, scratch[j])


def _store_segment(stored, formats, absmax, tables, rounding, mode, seed, draw, base, scratch,
                   start, n, n_arrays):
    """Store the rows the rule updated: the parameters (as ``mode`` says) and the state."""
    p = scratch[0]
    if mode == MASTER:
        store_row(stored[n_arrays], NATIVE, NEAREST, absmax[0], start, n, p, seed, draw,
                  uint64(0), base)
        store_half(stored[0], formats[0], absmax[0], start, n, p)
    elif mode == KAHAN:
        # torch-optimi's Kahan summation in float32, one rounding per stored value: the
        # compensation takes the update, the parameter moves by it, and what the 16-bit
        # parameter could not take stays in the compensation
        old = scratch[n_arrays]
        carry = scratch[n_arrays + 1]
        load_row(stored[n_arrays + 1], formats[0], absmax[0], tables, start, n, carry)
        for i in range(n):
            carry[i] = carry[i] + (p[i] - old[i])
            p[i] = old[i] + carry[i]
        store_half(stored[0], formats[0], absmax[0], start, n, p)
        load_row(stored[0], formats[0], absmax[0], tables, start, n, p)
        for i in range(n):
            carry[i] = carry[i] - (p[i] - old[i])
        store_half(stored[n_arrays + 1], formats[0], absmax[0], start, n, carry)
    else:
        store_row(stored[0], formats[0], rounding, absmax[0], start, n, p, seed, draw,
                  uint64(0), base)
    for j in range(2, n_arrays):
        if formats[j] != UNUSED:
            store_row(stored[j], formats[j], STOCHASTIC, absmax[j], start, n, scratch[j],
                      seed, draw, uint64(j), base)


def _coded_step_walk(stored, formats, absmax, tables, rounding, mode, seed, draw, base, scalars,
                     columns, flags, present, offsets, sizes, chunk_first, chunk_size, total,
                     grad_multiplier, scale_grads):
    """The plain walk's chunks and overlaps (``kernels/cpu.py``), each overlap in sub-blocks
    loaded, stepped by the rule's span and stored."""
    n_params = offsets.size
    n_arrays = len(formats) - 2
    one = uint64(1)
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        scratch = np.empty((n_arrays + 2, SUB), np.float32)
        rows = as_rows(scratch)  # noqa: F821 (bound: the rule's arrays)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                first = max(lo, offsets[k])
                last = min(hi, offsets[k] + sizes[k])
                for start in range(first, last, SUB):
                    n = min(SUB, last - start)
                    _coded_segment(stored, formats, absmax, tables, rounding, mode, seed, draw,
                                   base, scratch, start, n, scale_grads, grad_multiplier,
                                   n_arrays)
                    span(rows, scalars, columns, flags, k, uint64(0), uint64(n), one)  # noqa: F821
                    _store_segment(stored, formats, absmax, tables, rounding, mode, seed,
                                   draw, base, scratch, start, n, n_arrays)
            k += 1


def _coded_reduce_walk(stored, formats, absmax, tables, rounding, mode, seed, draw, base,
                       scalars,
                       columns, flags, present, offsets, sizes, chunk_first, chunk_size, total,
                       sums, grad_multiplier, scale_grads):
    """``kernels/cpu.py``'s reduce walk over loaded sub-blocks: partial totals per segment
    (each sub-block's added in order), combined per parameter in chunk order."""
    n_chunks = chunk_first.size
    n_params = offsets.size
    n_arrays = len(formats) - 2
    n_sums = sums.shape[1]
    first_segment = np.empty(n_chunks + 1, np.int64)
    first_segment[0] = 0
    for c in range(n_chunks):
        first_segment[c + 1] = first_segment[c] + overlaps(offsets, chunk_first,  # noqa: F821
                                                           chunk_size, total, c)
    partial = np.empty((first_segment[n_chunks], n_sums))  # rows of absent parameters unread
    one = uint64(1)
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        scratch = np.empty((n_arrays + 2, SUB), np.float32)
        rows = as_rows(scratch)  # noqa: F821
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                first = max(lo, offsets[k])
                last = min(hi, offsets[k] + sizes[k])
                for j in range(n_sums):
                    partial[segment, j] = 0.0
                for start in range(first, last, SUB):
                    n = min(SUB, last - start)
                    _coded_segment(stored, formats, absmax, tables, rounding, mode, seed, draw,
                                   base, scratch, start, n, scale_grads, grad_multiplier,
                                   n_arrays)
                    values = reduce(rows, scalars, columns, flags, k, uint64(0),  # noqa: F821
                                    uint64(n), one)
                    for j in range(n_sums):
                        partial[segment, j] += values[j]
            k += 1
            segment += 1
    for k in range(n_params):
        for j in range(n_sums):
            sums[k, j] = 0.0
    for c in range(n_chunks):
        hi = min(c * chunk_size + chunk_size, total)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                for j in range(n_sums):
                    sums[k, j] += partial[segment, j]
            k += 1
            segment += 1


def _functions(module) -> list:
    return [f for _, f in inspect.getmembers(module, inspect.isfunction)
            if f.__module__ == module.__name__]


CODEC_FUNCTIONS = tuple(_functions(storage))
"""The codec: ``kernels/storage.py``'s formats, plain functions compiled for each backend as
rules are (``kernels/_bind.py``)."""
ROW_FUNCTIONS = (load_row, store_row, store_half, _coded_segment, _store_segment)
"""The CPU's loops over sub-blocks of rows. Compiled once (not inlined into every rule's
walk): inlining every format's loop at every call site made each rule's walk take a minute
to compile; a call per 2,048-element row costs nothing measurable."""
CODEC = bind_functions("the storage codec", CODEC_FUNCTIONS,
                       njit(inline="always", error_model="numpy"))
CODEC.update(bind_functions("the storage codec's rows", ROW_FUNCTIONS,
                            njit(cache=True, error_model="numpy"), primitives=CODEC))
"""The codec and its row loops compiled for the CPU, by name."""
CODEC_FINGERPRINT = hashlib.sha256(
    (inspect.getsource(storage) + inspect.getsource(sys.modules[__name__])).encode()
).hexdigest()[:12]
"""In every coded kernel's name (Numba's cache key): an edited codec never loads a stale
kernel."""


# The rule's arrays as a tuple of scratch rows, by how many there are.
def _rows2(s):
    return (s[0], s[1])


def _rows3(s):
    return (s[0], s[1], s[2])


def _rows4(s):
    return (s[0], s[1], s[2], s[3])


def _rows5(s):
    return (s[0], s[1], s[2], s[3], s[4])


def _rows6(s):
    return (s[0], s[1], s[2], s[3], s[4], s[5])


ROWS = {2: _rows2, 3: _rows3, 4: _rows4, 5: _rows5, 6: _rows6}


class CodedKernels:
    """A rule's step (and reduce) walks over coded buffers (``arrays``: the leading arguments
    ``flatopt._codec.CodedPlan.arguments`` gives); prepare and finalize read only columns,
    so they are the plain kernels' (``plain``)."""

    def __init__(self, step, reduce, plain):
        self.step_kernel, self.reduce_kernel = step, reduce
        self.prepare, self.finalize = plain.prepare, plain.finalize

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier, scale_grads):
        self.step_kernel(layout.length, *arrays, scalars, columns, flags, layout.present,
                         layout.offsets, layout.sizes, layout.chunk_first, layout.chunk_size,
                         layout.length, grad_multiplier, scale_grads)

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads):
        self.reduce_kernel(layout.length, *arrays, scalars, columns, flags, layout.present,
                           layout.offsets, layout.sizes, layout.chunk_first,
                           layout.chunk_size, layout.length, sums, grad_multiplier,
                           scale_grads)


_compiled: dict[str, CodedKernels] = {}


def compile_coded(rule: Rule, overlaps, plain) -> CodedKernels:
    """The coded walks of ``rule`` (one set per rule and fingerprint, per process), beside its
    ``plain`` kernels; ``overlaps`` is the CPU walk's count of a chunk's parameters."""
    key = f"{rule.name}_{rule.fingerprint}_{CODEC_FINGERPRINT}"
    compiled = _compiled.get(key)
    if compiled is None:
        n_arrays = 2 + len(rule.slots)
        if n_arrays not in ROWS:
            raise TypeError(f"rule {rule.name!r} has {n_arrays} arrays; the codec walk takes "
                            f"{min(ROWS)} to {max(ROWS)}")
        functions = bind(rule, njit(inline="always", error_model="numpy"))
        helpers = {"as_rows": njit(inline="always")(ROWS[n_arrays]), "overlaps": overlaps,
                   **CODEC}
        step = Threaded(_coded_step_walk, f"coded_step_{key}", cache=True,
                        error_model="numpy",
                        bound={"span": functions[rule.span.__name__], **helpers})
        reduce = None
        if rule.reduce is not None:
            reduce = Threaded(_coded_reduce_walk, f"coded_reduce_{key}", cache=True,
                              error_model="numpy", fastmath={"reassoc"},
                              bound={"reduce": functions[rule.reduce.__name__], **helpers})
        compiled = _compiled[key] = CodedKernels(step, reduce, plain)
    return compiled
