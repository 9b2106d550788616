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
from typing import NamedTuple

import numpy as np
from numba import njit, prange, uint32, uint64

from . import arithmetic, storage
from ._bind import bind, bind_functions, instantiate
from .arithmetic import add32, hash32
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
    """``row[:n]`` = the float32 values of elements ``[start, start + n)`` of ``raw``.

    The loops index with uint64 (as the CPU walk's spans do): with signed indices Numba's
    negative-index check stays in the loop and it does not vectorize."""
    u = uint64(start)
    m = uint64(n)
    if fmt == NATIVE:
        src = raw.view(np.float32)
        for i in range(m):
            row[i] = src[u + i]
    elif fmt == BF16:
        bits = raw.view(np.uint16)
        for i in range(m):
            row[i] = bf16_decode(bits[u + i])
    elif fmt == F16:
        bits = raw.view(np.uint16)
        for i in range(m):
            row[i] = f16_decode(bits[u + i])
    elif fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
        table = tables[fmt - Q8_SIGNED]
        for b in range(0, n, BLOCK):
            stop = min(b + BLOCK, n)
            q8_decode_block(raw, start + b, start + stop, table, scales[(start + b) // BLOCK],
                            row, b)


POSITIONS = 8
"""Stored arrays the walk takes, always: params, grads, up to four state slots, the master
copy and the Kahan compensation (unused ones are empty, ``UNUSED``), so every position is a
constant index."""
MASTER_AT, COMPENSATION_AT = 6, 7


def load_element(f32, u16, u8, fmt, scales, tables, e):
    """Element ``e`` as float32 from its array's views (``fmt`` a compile-time constant in the
    phases below, so every other branch folds away)."""
    if fmt == NATIVE:
        return f32[e]
    if fmt == BF16:
        return bf16_decode(u16[e])
    if fmt == F16:
        return f16_decode(u16[e])
    if fmt == Q8_SIGNED:
        return q8_decode(u8[e], tables[0], scales[e // BLOCK])
    if fmt == Q8_UNSIGNED:
        return q8_decode(u8[e], tables[1], scales[e // BLOCK])
    return np.float32(0)


def encode_half(fmt, x, stochastic, r):
    """float32 ``x`` as a 16-bit pattern of ``fmt`` (BF16 or F16), rounded to nearest or
    stochastically with the random word ``r`` (uint32)."""
    if fmt == BF16:
        if stochastic:
            return bf16_encode_stochastic(x, r)
        return bf16_encode_nearest(x)
    if stochastic:
        return f16_encode_stochastic(x, r)
    return f16_encode_nearest(x)


_LOW32 = np.uint64(0xFFFFFFFF)
_WRAP = np.uint64(1 << 32)
_HIGH = np.uint64(32)


def _store_drawn(u16, fmt, row, u, first, stop, lo, hi):
    """Stochastically rounded ``row[first:stop]`` into ``u16[u + first : u + stop]``, element
    ``i`` drawing ``hash32(lo + i, hi)``: 32-bit lanes (``hi`` is fixed over the run)."""
    for i in range(uint64(first), uint64(stop)):
        u16[u + i] = encode_half(fmt, row[i], True, hash32(add32(lo, i), hi))


def _store_row(f32, u16, fmt, stochastic, key, row, start, n, base):
    """``row[:n]`` into elements ``[start, start + n)`` of a NATIVE, BF16 or F16 array;
    stochastic rounding draws ``mix32_at(key, base + start + i)`` for row element ``i``. That
    is ``hash32`` of the words of ``key + base + start + i``: the run is cut where the low word
    wraps, and each part keeps its high word fixed (8-bit blocks are stored a block at a
    time: :func:`_store_slot`)."""
    u = uint64(start)
    m = uint64(n)
    if fmt == NATIVE:
        for i in range(m):
            f32[u + i] = row[i]
    elif not stochastic:
        for i in range(m):
            u16[u + i] = encode_half(fmt, row[i], False, uint32(0))
    else:
        x = key + uint64(base) + u
        lo, hi = x & _LOW32, x >> _HIGH
        before_wrap = min(m, _WRAP - lo)
        _store_drawn(u16, fmt, row, u, uint64(0), before_wrap, lo, hi)
        _store_drawn(u16, fmt, row, u, before_wrap, m, lo, hi + uint64(1))


def _load_phase(f32s, u16s, u8s, absmax, tables, scratch, start, n, scale_grads,
                grad_multiplier):
    """Rows 0-5 of ``scratch`` = the rule's arrays over ``[start, start + n)`` as float32, in
    one loop over every stored array (as many memory streams at once as the plain walk);
    row 6 = the parameters before the step (Kahan). ``FORMATS`` and ``MODE`` are constants
    bound per storage layout (``compile_coded``). Scaled gradients are stored back."""
    u = uint64(start)
    p, g, s0, s1, s2, s3, old = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], \
        scratch[5], scratch[6]
    for i in range(uint64(n)):
        e = u + i
        if MODE == MASTER:  # noqa: F821 (bound)
            x = f32s[MASTER_AT][e]
        else:
            x = load_element(f32s[0], u16s[0], u8s[0], FORMATS[0], absmax[0], tables, e)  # noqa: F821
        p[i] = x
        if MODE == KAHAN:  # noqa: F821
            old[i] = x
        y = load_element(f32s[1], u16s[1], u8s[1], FORMATS[1], absmax[1], tables, e)  # noqa: F821
        g[i] = y * grad_multiplier if scale_grads else y
        if FORMATS[2] != UNUSED:  # noqa: F821
            s0[i] = load_element(f32s[2], u16s[2], u8s[2], FORMATS[2], absmax[2], tables, e)  # noqa: F821
        if FORMATS[3] != UNUSED:  # noqa: F821
            s1[i] = load_element(f32s[3], u16s[3], u8s[3], FORMATS[3], absmax[3], tables, e)  # noqa: F821
        if FORMATS[4] != UNUSED:  # noqa: F821
            s2[i] = load_element(f32s[4], u16s[4], u8s[4], FORMATS[4], absmax[4], tables, e)  # noqa: F821
        if FORMATS[5] != UNUSED:  # noqa: F821
            s3[i] = load_element(f32s[5], u16s[5], u8s[5], FORMATS[5], absmax[5], tables, e)  # noqa: F821
    if scale_grads:  # the gradient buffer holds what the update used, as in the plain walk
        _store_row(f32s[1], u16s[1], FORMATS[1], False, uint64(0), g, start, n,  # noqa: F821
                   uint64(0))


def _store_slot(f32, u16, u8, scales, fmt, key, row, start, n, base):
    """State slot rows back: bfloat16 rounded stochastically, 8-bit a block at a time (a new
    scale per block), float32 as it is."""
    if fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
        for b in range(0, n, BLOCK):  # blocks start at each parameter (256-aligned offsets)
            scales[(start + b) // BLOCK] = q8_encode_block(row, b, min(b + BLOCK, n), u8,
                                                           start + b, fmt == Q8_SIGNED)
    elif fmt != UNUSED:
        _store_row(f32, u16, fmt, True, key, row, start, n, base)


def _store_phase(f32s, u16s, u8s, absmax, tables, keys, base, scratch, start, n):
    """The rows the rule updated, stored: the parameters as ``MODE`` says (with master
    weights the float32 master and its nearest 16-bit value; with Kahan summation the
    compensation; else rounded as ``ROUNDING``), then every state slot."""
    u = uint64(start)
    p, old = scratch[0], scratch[6]
    if MODE == MASTER:  # noqa: F821
        for i in range(uint64(n)):
            e = u + i
            x = p[i]
            f32s[MASTER_AT][e] = x
            u16s[0][e] = encode_half(FORMATS[0], x, False, uint32(0))  # noqa: F821
    elif MODE == KAHAN:  # noqa: F821
        for i in range(uint64(n)):
            e = u + i
            x = p[i]
            # torch-optimi's Kahan summation in float32, one rounding per stored value: the
            # compensation takes the update, the parameter moves by it, and what the 16-bit
            # parameter could not take stays in the compensation
            carry = load_element(f32s[7], u16s[7], u8s[7], FORMATS[0], absmax[7], tables, e) \
                + (x - old[i])  # noqa: F821
            q = encode_half(FORMATS[0], old[i] + carry, False, uint32(0))  # noqa: F821
            u16s[0][e] = q
            moved = load_element(f32s[0], u16s[0], u8s[0], FORMATS[0], absmax[0], tables,  # noqa: F821
                                 e) - old[i]
            u16s[COMPENSATION_AT][e] = encode_half(FORMATS[0], carry - moved, False,  # noqa: F821
                                                   uint32(0))
    else:
        _store_row(f32s[0], u16s[0], FORMATS[0], ROUNDING == STOCHASTIC, keys[0], p,  # noqa: F821
                   start, n, base)
    # each slot with its constant index, so its format folds
    _store_slot(f32s[2], u16s[2], u8s[2], absmax[2], FORMATS[2], keys[2], scratch[2],  # noqa: F821
                start, n, base)
    _store_slot(f32s[3], u16s[3], u8s[3], absmax[3], FORMATS[3], keys[3], scratch[3],  # noqa: F821
                start, n, base)
    _store_slot(f32s[4], u16s[4], u8s[4], absmax[4], FORMATS[4], keys[4], scratch[4],  # noqa: F821
                start, n, base)
    _store_slot(f32s[5], u16s[5], u8s[5], absmax[5], FORMATS[5], keys[5], scratch[5],  # noqa: F821
                start, n, base)


def _views(stored):
    """Each stored array's float32 and uint16 views (every one's byte length is a multiple of
    four), made once per call: a view made inside a loop costs a reference count there."""
    f32s = (stored[0].view(np.float32), stored[1].view(np.float32),
            stored[2].view(np.float32), stored[3].view(np.float32),
            stored[4].view(np.float32), stored[5].view(np.float32),
            stored[6].view(np.float32), stored[7].view(np.float32))
    u16s = (stored[0].view(np.uint16), stored[1].view(np.uint16),
            stored[2].view(np.uint16), stored[3].view(np.uint16),
            stored[4].view(np.uint16), stored[5].view(np.uint16),
            stored[6].view(np.uint16), stored[7].view(np.uint16))
    return f32s, u16s


def _keys(seed, draw):
    """The stochastic rounding key of each position for this step (``mix32``'s stream is the
    position)."""
    return (mix32_key(seed, draw, 0), mix32_key(seed, draw, 1), mix32_key(seed, draw, 2),
            mix32_key(seed, draw, 3), mix32_key(seed, draw, 4), mix32_key(seed, draw, 5),
            mix32_key(seed, draw, 6), mix32_key(seed, draw, 7))


def _coded_step_walk(stored, absmax, tables, seed, draw, base, scalars, columns, flags,
                     present, offsets, sizes, chunk_first, chunk_size, total, grad_multiplier,
                     scale_grads):
    """The plain walk's chunks and overlaps (``kernels/cpu.py``), each overlap in sub-blocks
    loaded, stepped by the rule's own span and stored."""
    n_params = offsets.size
    f32s, u16s = _views(stored)
    keys = _keys(seed, draw)
    one = uint64(1)
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        scratch = np.empty((POSITIONS - 1, SUB), np.float32)
        rows = as_rows(scratch)  # noqa: F821 (bound: the rule's arrays)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                first = max(lo, offsets[k])
                last = min(hi, offsets[k] + sizes[k])
                for start in range(first, last, SUB):
                    n = min(SUB, last - start)
                    load_phase(f32s, u16s, stored, absmax, tables, scratch, start, n,  # noqa: F821
                               scale_grads, grad_multiplier)
                    span(rows, scalars, columns, flags, k, uint64(0), uint64(n), one)  # noqa: F821
                    store_phase(f32s, u16s, stored, absmax, tables, keys, base,  # noqa: F821
                                scratch, start, n)
            k += 1


def _coded_reduce_walk(stored, absmax, tables, seed, draw, base, scalars, columns, flags,
                       present, offsets, sizes, chunk_first, chunk_size, total, sums,
                       grad_multiplier, scale_grads):
    """``kernels/cpu.py``'s reduce walk over loaded sub-blocks: partial totals per segment
    (each sub-block's added in order), combined per parameter in chunk order."""
    n_chunks = chunk_first.size
    n_params = offsets.size
    n_sums = sums.shape[1]
    f32s, u16s = _views(stored)
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
        scratch = np.empty((POSITIONS - 1, SUB), np.float32)
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
                    load_phase(f32s, u16s, stored, absmax, tables, scratch, start, n,  # noqa: F821
                               scale_grads, grad_multiplier)
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
ELEMENT_FUNCTIONS = (load_element, encode_half, _store_drawn, _store_row, _store_slot)
"""The CPU walk's element and row helpers over the codec (inlined where called)."""
CODEC = bind_functions("the storage codec", (*CODEC_FUNCTIONS, *ELEMENT_FUNCTIONS),
                       njit(inline="always", error_model="numpy"))
# called, not inlined: inlined into a parallel walk, the views confuse Numba's parfor
# array analysis ("Dimension mismatch")
CODEC.update(bind_functions("the storage codec's setup", (_views, _keys),
                            njit(cache=True, error_model="numpy"), primitives=CODEC))
CODEC["load_row"] = njit(cache=True, error_model="numpy")(
    instantiate(load_row, "load_row", **CODEC))
"""The codec compiled for the CPU, by name (and ``load_row``, for 16-bit gradient norms)."""
CODEC_FINGERPRINT = hashlib.sha256(
    (inspect.getsource(arithmetic) + inspect.getsource(storage)
     + inspect.getsource(sys.modules[__name__])).encode()
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


class Layout(NamedTuple):
    """How a buffer's arrays are stored, for the walks' constants: ``formats`` of the
    ``POSITIONS`` arrays, the parameters' ``mode`` and ``rounding``."""

    formats: tuple
    mode: int
    rounding: int

    @property
    def key(self) -> str:
        return "".join(map(str, self.formats)) + f"m{self.mode}r{self.rounding}"


class CodedKernels:
    """A rule's step (and reduce) walks over buffers stored as one :class:`Layout`
    (``arrays``: the leading arguments ``flatopt._codec.CodedPlan.arguments`` gives);
    prepare and finalize read only columns, so they are the plain kernels' (``plain``)."""

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


def compile_coded(rule: Rule, layout: Layout, overlaps, plain) -> CodedKernels:
    """The coded walks of ``rule`` for buffers stored as ``layout`` (one set per rule,
    fingerprint and layout, per process), beside its ``plain`` kernels; ``overlaps`` is the
    CPU walk's count of a chunk's parameters. The layout's formats are constants of the
    compiled phases, so each array's load and store is the one its format needs."""
    key = f"{rule.name}_{rule.fingerprint}_{CODEC_FINGERPRINT}_{layout.key}"
    compiled = _compiled.get(key)
    if compiled is None:
        n_arrays = 2 + len(rule.slots)
        if n_arrays not in ROWS:
            raise TypeError(f"rule {rule.name!r} has {n_arrays} arrays; the codec walk takes "
                            f"{min(ROWS)} to {max(ROWS)}")
        constants = {"FORMATS": tuple(layout.formats), "MODE": layout.mode,
                     "ROUNDING": layout.rounding, **CODEC}
        phases = {name: njit(cache=True, error_model="numpy")(
            instantiate(function, f"{name}_{layout.key}_{CODEC_FINGERPRINT}", **constants))
            for name, function in (("load_phase", _load_phase), ("store_phase", _store_phase))}
        functions = bind(rule, njit(inline="always", error_model="numpy"))
        helpers = {"as_rows": njit(inline="always")(ROWS[n_arrays]), "overlaps": overlaps,
                   **CODEC, **phases}
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
