"""The storage codec around a rule: the CPU walk for buffers stored in reduced precision.

A rule's span and reduce compute in float32 over arrays indexed element by element. When a
buffer stores its parameters, gradients or state otherwise (16-bit parameters, master
weights, Kahan compensation, bfloat16 or 8-bit state: ``flatopt/_storage.py``), this walk
hands the span *views* of the stored arrays (``kernels/coded_views.py``): reading element
``i`` decodes it, writing it encodes with the array's rounding, inside the span's own loop.
One pass, vectorized as the plain walk's, and memory traffic is the stored bytes. Only 8-bit
state, whose stores need the whole block (a new scale per 256 elements), goes through a
float32 scratch row: each sub-block (``STEP_SUB``: ``ROWS_SUB`` elements, else ``SUB``) is
decoded into it before the span and encoded from it, block by block, after.

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
from numba import njit, prange, uint64

from . import arithmetic, coded_views, segments, storage
from ._bind import bind, bind_functions, instantiate
from .coded_views import (half_view, kahan_view, keep_scaled, master_view, plain_view,
                          scaled_view)
from .rule import Rule
from .segments import add_segments, first_segments
from .storage import BLOCK, DYNAMIC_SIGNED, DYNAMIC_UNSIGNED
from .threads import Threaded
from .variants import VariantKernels, bits

# How each stored array is read and written.
UNUSED, NATIVE, BF16, F16, Q8_SIGNED, Q8_UNSIGNED = 0, 1, 2, 3, 4, 5
# How the parameters are written (formats[0] is their 16-bit format).
DIRECT, MASTER, KAHAN = 0, 1, 2
NEAREST, STOCHASTIC = 0, 1
KINDS = {BF16: "bf16", F16: "f16"}
"""The 16-bit formats by their ``kernels/coded_views.py`` kind."""

SUB = 2048
"""Elements per sub-block of the reduce walk: 8-bit state is decoded into float32 rows of
``SUB`` elements (in the core's cache) before the reduce; its totals are added a sub-block at
a time, so ``SUB`` is part of the reduce's bits. A multiple of ``BLOCK``."""
ROWS_SUB = 4096
"""Elements per sub-block of the step walk over 8-bit state (its bits do not depend on it):
twice the reduce's, since each sub-block pays a fixed cost (decoding and encoding calls, the
views, the loops' set-up) and the rows still fit the core's L2 cache (int8 AdamW, 16M
elements: 4% faster than 2048). Without 8-bit state the step walk keeps ``SUB`` (bf16 AdamW
was 5% slower with 4096)."""

TABLES = np.stack([DYNAMIC_SIGNED, DYNAMIC_UNSIGNED]).astype(np.float32)

POSITIONS = 8
"""Stored arrays the walk takes, always: params, grads, up to four state slots, the master
copy and the Kahan compensation (unused ones are empty, ``UNUSED``), so every position is a
constant index."""
MASTER_AT, COMPENSATION_AT = 6, 7
SPAN_ARRAYS = 6
"""Views the walk makes per span (positions 0-5); a rule takes the first two to six."""


def load_row(raw, fmt, scales, start, n, row):
    """``row[:n]`` = the float32 values of elements ``[start, start + n)`` of ``raw``.

    The loops index with uint64 (as the CPU walk's spans do): with signed indices Numba's
    negative-index check stays in the loop and it does not vectorize. 8-bit codes are looked
    up in ``TABLES``, a module constant Numba freezes into the code: the compiler then knows
    no store to ``row`` changes the table, and the lookup is a vector gather (a table passed
    as an argument might alias ``row``: the loop stayed scalar, 0.29 ns per element against
    0.16)."""
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
        table = TABLES[fmt - Q8_SIGNED]
        for b in range(0, n, BLOCK):
            stop = min(b + BLOCK, n)
            q8_decode_block(raw, start + b, start + stop, table, scales[(start + b) // BLOCK],
                            row, b)


def _encode_q8_row(codes, scales, fmt, row, start, n):
    """``row[:n]`` as the 8-bit codes of elements ``[start, start + n)``, a block at a time
    (a new scale per block; blocks start at each parameter: 256-aligned offsets)."""
    for b in range(0, n, BLOCK):
        scales[(start + b) // BLOCK] = q8_encode_block(row, b, min(b + BLOCK, n), codes,
                                                       start + b, fmt == Q8_SIGNED)


_LOW32 = np.uint64(0xFFFFFFFF)
_WRAP = np.uint64(1 << 32)
_HIGH = np.uint64(32)


def _draw_words(keys, at, first, n, words):
    """The words the views' stochastic stores draw from, for a span of a sub-block's elements
    ``[first, stop)`` (``at``: the buffer index of the sub-block's first element): row 0 the
    low word of ``keys[j] + at``, row 1 the high word of ``keys[j] + at + first``, per position
    ``j``. Returns ``stop`` (at most ``n``): before any position's low word wraps, so the high
    word is fixed over the span and ``mix32_at(keys[j], at + i)`` is ``hash32(add32(low, i),
    high)`` (32-bit vector lanes)."""
    stop = uint64(n)
    f = uint64(first)
    for j in range(POSITIONS):
        x = keys[j] + at
        words[0, j] = x & _LOW32
        y = x + f
        words[1, j] = y >> _HIGH
        stop = min(stop, f + (_WRAP - (y & _LOW32)))
    return stop


def _decode_rows(stored, absmax, scratch, start, n):
    """The 8-bit state slots of the sub-block into their scratch rows (``FORMATS`` bound per
    storage layout: the other branches fold away)."""
    if FORMATS[2] >= Q8_SIGNED:  # noqa: F821 (bound)
        load_row(stored[2], FORMATS[2], absmax[2], start, n, scratch[2])  # noqa: F821
    if FORMATS[3] >= Q8_SIGNED:  # noqa: F821
        load_row(stored[3], FORMATS[3], absmax[3], start, n, scratch[3])  # noqa: F821
    if FORMATS[4] >= Q8_SIGNED:  # noqa: F821
        load_row(stored[4], FORMATS[4], absmax[4], start, n, scratch[4])  # noqa: F821
    if FORMATS[5] >= Q8_SIGNED:  # noqa: F821
        load_row(stored[5], FORMATS[5], absmax[5], start, n, scratch[5])  # noqa: F821


def _encode_rows(stored, absmax, scratch, start, n):
    """The 8-bit state slots' rows back into codes and scales."""
    if FORMATS[2] >= Q8_SIGNED:  # noqa: F821
        _encode_q8_row(stored[2], absmax[2], FORMATS[2], scratch[2], start, n)  # noqa: F821
    if FORMATS[3] >= Q8_SIGNED:  # noqa: F821
        _encode_q8_row(stored[3], absmax[3], FORMATS[3], scratch[3], start, n)  # noqa: F821
    if FORMATS[4] >= Q8_SIGNED:  # noqa: F821
        _encode_q8_row(stored[4], absmax[4], FORMATS[4], scratch[4], start, n)  # noqa: F821
    if FORMATS[5] >= Q8_SIGNED:  # noqa: F821
        _encode_q8_row(stored[5], absmax[5], FORMATS[5], scratch[5], start, n)  # noqa: F821


def _span_views(f32s, u16s, scratch, start, words, multiplier):
    """Positions 0-5 over the sub-block from ``start`` as the span indexes them
    (``VIEW0``..``VIEW5`` bound per storage layout: :func:`_position_view`)."""
    return (VIEW0(f32s, u16s, scratch, start, words[0, 0], words[1, 0], multiplier),  # noqa: F821
            VIEW1(f32s, u16s, scratch, start, words[0, 1], words[1, 1], multiplier),  # noqa: F821
            VIEW2(f32s, u16s, scratch, start, words[0, 2], words[1, 2], multiplier),  # noqa: F821
            VIEW3(f32s, u16s, scratch, start, words[0, 3], words[1, 3], multiplier),  # noqa: F821
            VIEW4(f32s, u16s, scratch, start, words[0, 4], words[1, 4], multiplier),  # noqa: F821
            VIEW5(f32s, u16s, scratch, start, words[0, 5], words[1, 5], multiplier))  # noqa: F821


def _step_overlap(f32s, u16s, stored, absmax, keys, base, scratch, words, scalars,
                  columns, flags, k, first, last, multiplier, scale_grads):
    """Elements ``[first, last)`` of parameter ``k`` stepped, a sub-block at a time: 8-bit
    rows decoded, the rule's span over the views (cut where a draw's low word wraps), the
    scaled gradients kept, the 8-bit rows encoded."""
    one = uint64(1)
    for start in range(first, last, STEP_SUB):  # noqa: F821 (bound per layout)
        n = min(STEP_SUB, last - start)  # noqa: F821
        decode_rows(stored, absmax, scratch, start, n)  # noqa: F821 (bound)
        at = uint64(base) + uint64(start)
        done = uint64(0)
        while done < uint64(n):
            stop = _draw_words(keys, at, done, n, words)
            views = span_views(f32s, u16s, scratch, start, words, multiplier)  # noqa: F821
            span(as_arrays(views), scalars, columns, flags, k, done, stop, one)  # noqa: F821
            done = stop
        if scale_grads:
            keep_scaled(VIEW1(f32s, u16s, scratch, start, 0, 0, multiplier), n)  # noqa: F821
        encode_rows(stored, absmax, scratch, start, n)  # noqa: F821


def _reduce_overlap(f32s, u16s, stored, absmax, scratch, words, scalars, columns,
                    flags, k, first, last, multiplier, scale_grads, partial, segment):
    """``partial[segment]`` = the rule's reduce over elements ``[first, last)`` of parameter
    ``k``, each sub-block's totals added in order (the scaled gradients kept).

    Compiled with reassociation (for the reduce's sums, as the plain walk's); the views'
    loads, the gradients' multiply included, are overloads compiled with their own flags,
    so no loaded value is reassociated (the same bits as the step's loads)."""
    one = uint64(1)
    for j in range(partial.shape[1]):
        partial[segment, j] = 0.0
    for start in range(first, last, SUB):
        n = min(SUB, last - start)
        decode_rows(stored, absmax, scratch, start, n)  # noqa: F821
        views = span_views(f32s, u16s, scratch, start, words, multiplier)  # noqa: F821
        values = reduce(as_arrays(views), scalars, columns, flags, k, uint64(0),  # noqa: F821
                        uint64(n), one)
        for j in range(partial.shape[1]):
            partial[segment, j] += values[j]
        if scale_grads:
            keep_scaled(VIEW1(f32s, u16s, scratch, start, 0, 0, multiplier), n)  # noqa: F821


def _reinterpreted(stored):
    """Each stored array's bytes as float32 and as uint16 (every one's byte length is a
    multiple of four), made once per call: an array made inside a loop costs a reference
    count there."""
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


def _multiplier(grad_multiplier, scale_grads):
    """What the gradient views multiply by: the step's multiplier as float32, or one."""
    return np.float32(grad_multiplier) if scale_grads else np.float32(1.0)


def _coded_step_walk(stored, absmax, tables, seed, draw, base, scalars, columns, flags,
                     present, offsets, sizes, chunk_first, chunk_size, total, grad_multiplier,
                     scale_grads):
    """The plain walk's chunks and overlaps (``kernels/cpu.py``), each overlap stepped by
    :func:`_step_overlap`. ``tables`` is the plan's argument both backends take
    (``flatopt._codec.CodedPlan.arguments``); the CUDA walk reads its device copy, the CPU's
    code reads ``TABLES`` as a constant (:func:`load_row`)."""
    n_params = offsets.size
    f32s, u16s = _reinterpreted(stored)
    keys = _keys(seed, draw)
    multiplier = _multiplier(grad_multiplier, scale_grads)
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        scratch = np.empty((SPAN_ARRAYS, STEP_SUB), np.float32)  # noqa: F821 (bound)
        words = np.empty((2, POSITIONS), np.uint32)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                step_overlap(f32s, u16s, stored, absmax, keys, base, scratch,  # noqa: F821
                             words, scalars, columns, flags, k, max(lo, offsets[k]),
                             min(hi, offsets[k] + sizes[k]), multiplier, scale_grads)
            k += 1


def _coded_reduce_walk(stored, absmax, tables, seed, draw, base, scalars, columns, flags,
                       present, offsets, sizes, chunk_first, chunk_size, total, sums,
                       grad_multiplier, scale_grads):
    """``kernels/cpu.py``'s reduce walk over views: partial totals per segment
    (:func:`_reduce_overlap`), combined per parameter in chunk order (``tables`` unread, as
    in :func:`_coded_step_walk`)."""
    n_chunks = chunk_first.size
    n_params = offsets.size
    n_sums = sums.shape[1]
    f32s, u16s = _reinterpreted(stored)
    multiplier = _multiplier(grad_multiplier, scale_grads)
    first_segment = first_segments(offsets, chunk_first, chunk_size, total)
    partial = np.empty((first_segment[n_chunks], n_sums))  # rows of absent parameters unread
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        scratch = np.empty((SPAN_ARRAYS, SUB), np.float32)
        words = np.empty((2, POSITIONS), np.uint32)  # (reads draw nothing)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                reduce_overlap(f32s, u16s, stored, absmax, scratch, words,  # noqa: F821
                               scalars, columns, flags, k, max(lo, offsets[k]),
                               min(hi, offsets[k] + sizes[k]), multiplier, scale_grads,
                               partial, segment)
            k += 1
            segment += 1
    add_segments(sums, partial, first_segment, present, offsets, chunk_first, chunk_size,
                 total)


CODEC_FINGERPRINT = hashlib.sha256(
    (inspect.getsource(arithmetic) + inspect.getsource(storage) + inspect.getsource(segments)
     + inspect.getsource(coded_views) + inspect.getsource(sys.modules[__name__])).encode()
).hexdigest()[:12]
"""In every coded kernel's name (Numba's cache key, which checks only the kernel's own source
file): an edited codec never loads a stale kernel."""

CODEC = dict(coded_views.CODEC)
"""The codec compiled for the CPU, by name, with the walk's helpers over it (``load_row``,
compiled on its own, also loads 16-bit gradients for their norms)."""
CODEC.update(bind_functions("the coded walk's helpers",
                            (_encode_q8_row, _draw_words, _multiplier),
                            njit(inline="always", error_model="numpy"), primitives=CODEC))
# called, not inlined: inlined into a parallel walk, the views confuse Numba's parfor
# array analysis ("Dimension mismatch")
for _function in (_reinterpreted, _keys, load_row):
    CODEC[_function.__name__] = njit(cache=True, error_model="numpy")(
        instantiate(_function, f"{_function.__name__}_{CODEC_FINGERPRINT}", **CODEC))


def _position_view(layout, j):
    """The view the span gets at position ``j`` of buffers stored as ``layout``: a function
    ``(f32s, u16s, scratch, start, lo, hi, multiplier)`` of the sub-block from ``start``.
    Parameters by mode (master copy, Kahan, or a 16-bit array rounded as the layout says),
    gradients scaled, 16-bit state rounded stochastically, float32 arrays as they are, 8-bit
    state (and unused positions) as scratch rows."""
    fmt = layout.formats[j]
    kind = KINDS.get(fmt)
    if j == 0 and layout.mode == MASTER:
        make = master_view(kind)

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return make(start, u16s[0], f32s[MASTER_AT])
    elif j == 0 and layout.mode == KAHAN:
        make = kahan_view(kind)

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return make(start, u16s[0], u16s[COMPENSATION_AT])
    elif j == 1 and kind is None:
        make = scaled_view("f32")

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return make(start, f32s[1], multiplier)
    elif j == 1:
        make = scaled_view(kind)

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return make(start, u16s[1], multiplier)
    elif fmt == NATIVE:
        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return plain_view(start, f32s[j])
    elif kind is not None:
        make = half_view(kind, j >= 2 or layout.rounding == STOCHASTIC)  # state: stochastic

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return make(start, u16s[j], lo, hi)
    else:
        assert j >= 2 and fmt in (UNUSED, Q8_SIGNED, Q8_UNSIGNED), (j, fmt)

        def view(f32s, u16s, scratch, start, lo, hi, multiplier):
            return plain_view(0, scratch[j])
    return njit(inline="always", error_model="numpy")(view)


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
    prepare and finalize read only columns, so they are the plain kernels' (``plain``). The
    step walk is made per combination of the rule's flags (``step_kernel(flags)``, every flag
    read as a constant: ``kernels/variants.py``); the reduce walk reads them at run time."""

    def __init__(self, step: VariantKernels, reduce, plain):
        self.step_kernel, self.reduce_kernel = step, reduce
        self.prepare, self.finalize = plain.prepare, plain.finalize

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier, scale_grads):
        self.step_kernel(flags)(layout.length, *arrays, scalars, columns, flags, layout.present,
                         layout.offsets, layout.sizes, layout.chunk_first, layout.chunk_size,
                         layout.length, grad_multiplier, scale_grads)

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads):
        self.reduce_kernel(layout.length, *arrays, scalars, columns, flags, layout.present,
                           layout.offsets, layout.sizes, layout.chunk_first,
                           layout.chunk_size, layout.length, sums, grad_multiplier,
                           scale_grads)


_compiled: dict[str, CodedKernels] = {}


def compile_coded(rule: Rule, layout: Layout, plain) -> CodedKernels:
    """The coded walks of ``rule`` for buffers stored as ``layout`` (one set per rule,
    fingerprint and layout, per process), beside its ``plain`` kernels. The layout's formats
    are constants of the compiled functions, so each array's load and store is the one its
    format needs."""
    key = f"{rule.name}_{rule.fingerprint}_{CODEC_FINGERPRINT}_{layout.key}"
    compiled = _compiled.get(key)
    if compiled is None:
        n_arrays = 2 + len(rule.slots)
        if n_arrays not in ROWS:
            raise TypeError(f"rule {rule.name!r} has {n_arrays} arrays; the codec walk takes "
                            f"{min(ROWS)} to {max(ROWS)}")
        constants = {"FORMATS": tuple(layout.formats), **CODEC}
        step_sub = ROWS_SUB if max(layout.formats) >= Q8_SIGNED else SUB
        rows = {phase: njit(cache=True, error_model="numpy")(
            instantiate(function, f"{phase}_{layout.key}_{CODEC_FINGERPRINT}", **constants))
            for phase, function in (("decode_rows", _decode_rows),
                                    ("encode_rows", _encode_rows))}
        views = {f"VIEW{j}": _position_view(layout, j) for j in range(SPAN_ARRAYS)}
        helpers = {"span_views": njit(inline="always", error_model="numpy")(
            instantiate(_span_views, "span_views", **views)),
            "as_arrays": njit(inline="always")(ROWS[n_arrays]), "keep_scaled": keep_scaled,
            **views, **rows, **CODEC}
        functions = bind(rule, njit(inline="always", error_model="numpy"))

        def step_walk(values: dict[str, bool]) -> Threaded:
            bound = functions if not values else bind(
                rule, njit(inline="always", error_model="numpy"), constant_flags=values)
            # one overlap is compiled on its own (called, not inlined, from the parallel
            # walk: Numba's parfor passes do not see the views)
            step_overlap = njit(cache=True, error_model="numpy")(instantiate(
                _step_overlap, f"step_overlap_{key}{bits(values)}",
                span=bound[rule.span.__name__], STEP_SUB=step_sub, **helpers))
            return Threaded(_coded_step_walk, f"coded_step_{key}{bits(values)}", cache=True,
                            error_model="numpy",
                            bound={"step_overlap": step_overlap, "STEP_SUB": step_sub,
                                   **CODEC})

        step = VariantKernels(rule, step_walk, names=rule.flags._fields)
        reduce = None
        if rule.reduce is not None:
            reduce_overlap = njit(cache=True, error_model="numpy", fastmath={"reassoc"})(
                instantiate(_reduce_overlap, f"reduce_overlap_{key}",
                            reduce=functions[rule.reduce.__name__], **helpers))
            reduce = Threaded(_coded_reduce_walk, f"coded_reduce_{key}", cache=True,
                              error_model="numpy",
                              bound={"reduce_overlap": reduce_overlap, **CODEC})
        compiled = _compiled[key] = CodedKernels(step, reduce, plain)
    return compiled
