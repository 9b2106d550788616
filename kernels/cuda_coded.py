"""The storage codec around a rule on CUDA: ``kernels/coded.py``'s walk, per element.

The arguments are the CPU coded walk's (``flatopt._codec.CodedPlan.arguments``): every stored
array as raw bytes in one tuple, its format, its 8-bit block scales, the code tables, the
rounding, the parameter mode (direct, master weights, Kahan), the seed and the draw. The
codec is ``kernels/storage.py``'s plain functions compiled with ``cuda.jit(device=True)``,
with libdevice's bit casts (the simulator's ``simulated_`` ones under the simulator).

A GPU thread owns one element at a time, so the sub-block rows of the CPU walk become rows of
one element in the thread's local memory: the thread loads its element of every stored array
as float32, runs the rule's own span over that one element (``start=0, stop=1``), and stores
each value back in its format. The chunk walk is the plain CUDA walk's (blocks grid-stride
over chunks, threads stride over each overlap).

8-bit state needs the whole block: its scale is the largest ``|new value|`` of the 256
elements. Buffers with an 8-bit slot are walked by blocks of ``BLOCK`` threads, one 8-bit
block at a time (thread ``t`` owns element ``t``): each thread computes its new values, the
block reduces the absmax in shared memory, then each thread encodes its element. The CPU
computes the same float32 values and takes the same maximum (NaN skipped, order-free), so the
codes and scales are the CPU's bit for bit given the same float32 values.

Stochastic rounding draws ``mix32(seed, draw, stream, element)`` as on the CPU: the bits do
not depend on the block or grid size. Where the rule itself rounds differently (the
simulator's ``fma`` rounds twice; a GPU contracts multiply-adds unless compiled exact), the
float32 inputs of the codec differ and so may its outputs.
"""

from __future__ import annotations

import numpy as np
from numba import float32, float64, uint32, int32, uint64

from ._bind import bind, bind_functions, instantiate
from ._cuda_import import simulated
from .arithmetic import (portable_hash32, simulated_f32_bits, simulated_f32_from_bits,
                         simulated_fma)
from .coded import (BF16, CODEC_FINGERPRINT, F16, KAHAN, MASTER, NATIVE, NEAREST, Q8_SIGNED,
                    Q8_UNSIGNED, ROWS, SPAN_ARRAYS, STOCHASTIC)
from .coded_views import CODEC_FUNCTIONS
from .cuda_chunks import chunk_walk, thread_elements
from .cuda_launch import Source, cuda, grid, launch, make
from .rule import Rule
from .storage import BLOCK

ROWS_MAX = 8
"""Rows of a thread's scratch: params, grads, up to four slots, the old parameter and the
Kahan compensation (``ROWS`` takes two to six arrays)."""
SUMS_MAX = 4
"""Per-parameter totals a coded reduce pass may return (LAMB, caution: two)."""
STATE_ROWS = SPAN_ARRAYS - 2
"""State slots a span takes (a constant: the 8-bit walk's shared array is this shape)."""


def cuda_f32_bits(x):
    """``f32_bits`` on a GPU: libdevice's ``float_as_int``, as the unsigned pattern."""
    return uint32(cuda.libdevice.float_as_int(x))


def cuda_f32_from_bits(u):
    """``f32_from_bits`` on a GPU: libdevice's ``int_as_float`` of the low 32 bits."""
    return cuda.libdevice.int_as_float(int32(uint32(u)))


def cuda_fma(a, b, c):
    """``fma`` on a GPU. A device function around ``cuda.fma``: numba-cuda 0.30 types the
    intrinsic as an attribute of the module, not as a global name bound to it."""
    return cuda.fma(a, b, c)


def fma_primitive():
    """What ``fma`` is bound to in rule functions compiled for CUDA."""
    return simulated_fma if simulated() else cuda.jit(device=True)(cuda_fma)


# ----------------------------------------------------------------------------- elements
def load_value(raw, fmt, scales, tables, i):
    """The float32 value of element ``i`` of ``raw`` (0 for an unused array)."""
    if fmt == NATIVE:
        return raw.view(np.float32)[i]
    if fmt == BF16:
        return bf16_decode(raw.view(np.uint16)[i])  # noqa: F821 (bound: the codec)
    if fmt == F16:
        return f16_decode(raw.view(np.uint16)[i])  # noqa: F821
    if fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
        return q8_decode(raw[i], tables[fmt - Q8_SIGNED],  # noqa: F821
                         scales[i // uint64(BLOCK)])
    return float32(0.0)


def store_value(raw, fmt, rounding, i, x, seed, draw, stream):
    """Element ``i`` of a float32 or 16-bit ``raw`` = ``x``, rounded to nearest or
    stochastically with the CPU's bits (``mix32`` of the element's index in the buffer)."""
    if fmt == NATIVE:
        raw.view(np.float32)[i] = x
    elif fmt == BF16 or fmt == F16:
        bits = raw.view(np.uint16)
        if rounding == STOCHASTIC:
            r = mix32(seed, draw, stream, uint64(i))  # noqa: F821
            if fmt == BF16:
                bits[i] = bf16_encode_stochastic(x, r)  # noqa: F821
            else:
                bits[i] = f16_encode_stochastic(x, r)  # noqa: F821
        elif fmt == BF16:
            bits[i] = bf16_encode_nearest(x)  # noqa: F821
        else:
            bits[i] = f16_encode_nearest(x)  # noqa: F821


def half_value(bits, fmt, i):
    """The float32 value of element ``i`` of 16-bit patterns ``bits`` (uint16) in ``fmt``."""
    if fmt == BF16:
        return bf16_decode(bits[i])  # noqa: F821
    return f16_decode(bits[i])  # noqa: F821


def half_bits(fmt, x):
    """The 16-bit pattern in ``fmt`` nearest to ``x``."""
    if fmt == BF16:
        return bf16_encode_nearest(x)  # noqa: F821
    return f16_encode_nearest(x)  # noqa: F821


def half_nearest(fmt, x):
    """``x`` rounded to nearest in 16-bit ``fmt`` and read back (float32)."""
    if fmt == BF16:
        return bf16_decode(bf16_encode_nearest(x))  # noqa: F821
    return f16_decode(f16_encode_nearest(x))  # noqa: F821


def load_element(stored, formats, absmax, tables, mode, seed, draw, scratch, i, scale_grads,
                 grad_multiplier, n_arrays):
    """``scratch[j, 0]`` = element ``i`` of the rule's arrays (``kernels/coded.py``'s
    ``_coded_segment`` for one element: the gradient scaled and stored back when asked)."""
    if mode == MASTER:
        scratch[0, 0] = load_value(stored[n_arrays], NATIVE, absmax[0], tables, i)
    else:
        scratch[0, 0] = load_value(stored[0], formats[0], absmax[0], tables, i)
        if mode == KAHAN:
            scratch[n_arrays, 0] = scratch[0, 0]
    g = load_value(stored[1], formats[1], absmax[1], tables, i)
    if scale_grads:
        g = g * grad_multiplier
        store_value(stored[1], formats[1], NEAREST, i, g, seed, draw, uint64(1))
    scratch[1, 0] = g
    for j in range(2, n_arrays):
        scratch[j, 0] = load_value(stored[j], formats[j], absmax[j], tables, i)


def store_element(stored, formats, absmax, tables, rounding, mode, seed, draw, scratch, i,
                  n_arrays):
    """Store element ``i`` of the rows the rule updated: the parameter (as ``mode`` says) and
    the float32 and bfloat16 state (8-bit state is the block's: see the walks)."""
    p = scratch[0, 0]
    fmt = formats[0]
    if mode == MASTER:
        store_value(stored[n_arrays], NATIVE, NEAREST, i, p, seed, draw, uint64(0))
        store_value(stored[0], fmt, NEAREST, i, p, seed, draw, uint64(0))
    elif mode == KAHAN:  # as kernels/coded.py's _store_segment, one element
        old = scratch[n_arrays, 0]
        carry = load_value(stored[n_arrays + 1], fmt, absmax[0], tables, i)
        carry = carry + (p - old)
        p = old + carry
        store_value(stored[0], fmt, NEAREST, i, p, seed, draw, uint64(0))
        carry = carry - (half_nearest(fmt, p) - old)
        store_value(stored[n_arrays + 1], fmt, NEAREST, i, carry, seed, draw, uint64(0))
    else:
        store_value(stored[0], fmt, rounding, i, p, seed, draw, uint64(0))
    for j in range(2, n_arrays):
        if formats[j] == NATIVE or formats[j] == BF16 or formats[j] == F16:
            store_value(stored[j], formats[j], STOCHASTIC, i, scratch[j, 0], seed, draw,
                        uint64(j))


def store_code(stored, fmt, j, i, value, largest):
    """Element ``i`` of the 8-bit array ``j`` = the code of ``value`` in a block whose
    largest magnitude is ``largest``."""
    stored[j][i] = q8_code(value * q8_scale(largest), fmt == Q8_SIGNED)  # noqa: F821


def block_absmax(shared, value, active):
    """The largest ``|value|`` over the ``BLOCK`` threads of the block (all must call),
    counting only ``active`` threads, NaN skipped: ``storage.q8_block_absmax``'s maximum,
    which does not depend on the order."""
    t = cuda.threadIdx.x
    a = abs(value)
    shared[t] = a if active and a == a else float32(0.0)
    cuda.syncthreads()
    s = BLOCK // 2
    while s > 0:
        if t < s and shared[t] < shared[t + s]:
            shared[t] = shared[t + s]
        cuda.syncthreads()
        s //= 2
    largest = shared[0]
    cuda.syncthreads()  # everyone has read it before the next block writes
    return largest


ELEMENT_FUNCTIONS = (load_value, store_value, half_value, half_bits, half_nearest,
                     load_element, store_element, store_code, block_absmax)


# ----------------------------------------------------------------------------- 16-bit arrays
# What a device-resident optimizer does to whole 16-bit arrays outside the step (bit
# patterns: Numba has no bfloat16), with NumPy's and ml_dtypes' arithmetic: in float32,
# rounded to nearest once.
def _half_add(target, source, fmt):
    """``target += source`` (gradient accumulation)."""
    for i in range(cuda.grid(1), target.size, cuda.gridsize(1)):
        target[i] = half_bits(fmt, half_value(target, fmt, i)  # noqa: F821 (bound)
                              + half_value(source, fmt, i))  # noqa: F821


def _half_decode(out, bits, fmt):
    """``out = float32(bits)`` (an EMA's view of 16-bit parameters)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = half_value(bits, fmt, i)  # noqa: F821


def _half_encode(bits, values, fmt):
    """``bits = values`` rounded to nearest (an EMA's averages put into the parameters)."""
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        bits[i] = half_bits(fmt, values[i])  # noqa: F821


_half_kernels: dict = {}


def half_kernels() -> dict:
    """``add``, ``decode`` and ``encode`` over 16-bit patterns, compiled once."""
    if not _half_kernels:
        functions = codec()
        for name, template in (("add", _half_add), ("decode", _half_decode),
                               ("encode", _half_encode)):
            _half_kernels[name] = make(instantiate(
                template, f"half_{name}_{CODEC_FINGERPRINT}", half_value=functions["half_value"],
                half_bits=functions["half_bits"]), Source(half_kernels))
    return _half_kernels


# ----------------------------------------------------------------------------- walks
def step_element(stored, formats, absmax, tables, rounding, mode, seed, draw, scalars,
                 columns, flags, scratch, k, i, grad_multiplier, scale_grads):
    """Element ``i`` of parameter ``k`` stepped: loaded into ``scratch``, the rule's span
    over it, stored (8-bit state is left in ``scratch``: its block stores it). Bound per rule
    (``span``, ``as_rows``) and shared by the walks and ``bench/cuda_traffic.py``'s probes."""
    n_arrays = len(formats) - 2
    load_element(stored, formats, absmax, tables, mode, seed, draw, scratch, i, scale_grads,
                 grad_multiplier, n_arrays)
    span(as_rows(scratch), scalars, columns, flags, k, 0, 1, 1)  # noqa: F821 (bound)
    store_element(stored, formats, absmax, tables, rounding, mode, seed, draw, scratch, i,
                  n_arrays)


def _coded_step_overlap(context, state, k, start, stop):
    (stored, formats, absmax, tables, rounding, mode, seed, draw, scalars, columns, flags,
     scratch, grad_multiplier, scale_grads) = context
    a, b, stride = thread_elements(start, stop)
    for i in range(a, b, stride):
        step_element(stored, formats, absmax, tables, rounding, mode, seed, draw,  # noqa: F821
                     scalars, columns, flags, scratch, k, i, grad_multiplier, scale_grads)
    return state


def _coded_step_walk(stored, formats, absmax, tables, rounding, mode, seed, draw, scalars,
                     columns, flags, present, offsets, sizes, chunk_first, chunk_size, total,
                     grad_multiplier, scale_grads):
    """Buffers without 8-bit state: each thread loads, steps and stores its elements."""
    scratch = cuda.local.array((ROWS_MAX, 1), float32)
    walk(present, offsets, sizes, chunk_first, chunk_size, total,  # noqa: F821 (bound)
         (stored, formats, absmax, tables, rounding, mode, seed, draw, scalars, columns, flags,
          scratch, grad_multiplier, scale_grads), None)


def _coded_block_overlap(context, state, k, start, stop):
    """The overlap in 8-bit blocks from its start, thread ``t`` owning element ``t`` of each
    (every thread of the block comes here: the absmax reductions wait for all)."""
    (stored, formats, absmax, tables, rounding, mode, seed, draw, scalars, columns, flags,
     scratch, shared, kept, grad_multiplier, scale_grads) = context
    n_arrays = len(formats) - 2
    t = cuda.threadIdx.x
    block = uint64(BLOCK)
    last = uint64(stop)
    for first in range(uint64(start), last, block):
        i = first + uint64(t)
        active = i < last
        if active:
            step_element(stored, formats, absmax, tables, rounding,  # noqa: F821
                         mode, seed, draw, scalars, columns, flags, scratch, k, i,
                         grad_multiplier, scale_grads)
            for j in range(2, n_arrays):
                kept[j - 2, t] = scratch[j, 0]
        for j in range(2, n_arrays):
            fmt = formats[j]
            if fmt == Q8_SIGNED or fmt == Q8_UNSIGNED:
                largest = block_absmax(shared, kept[j - 2, t], active)  # noqa: F821
                if active:
                    store_code(stored, fmt, j, i, kept[j - 2, t], largest)  # noqa: F821
                if t == 0:
                    absmax[j][first // block] = largest
    return state


def _coded_block_walk(stored, formats, absmax, tables, rounding, mode, seed, draw, scalars,
                      columns, flags, present, offsets, sizes, chunk_first, chunk_size, total,
                      grad_multiplier, scale_grads):
    """Buffers with 8-bit state, launched with ``BLOCK`` threads: the overlaps in 8-bit
    blocks (as the CPU cuts them: from the overlap's start, which parameters and chunks
    align to ``BLOCK``), thread ``t`` owning element ``t`` of the block. Each thread keeps
    its new state values in shared memory (``kept``) while the block reduces each 8-bit slot's
    absmax, rather than in registers across the reductions (which made the walk spill)."""
    scratch = cuda.local.array((ROWS_MAX, 1), float32)
    shared = cuda.shared.array(BLOCK, float32)
    kept = cuda.shared.array((STATE_ROWS, BLOCK), float32)
    walk(present, offsets, sizes, chunk_first, chunk_size, total,  # noqa: F821 (bound)
         (stored, formats, absmax, tables, rounding, mode, seed, draw, scalars, columns, flags,
          scratch, shared, kept, grad_multiplier, scale_grads), None)


def _coded_reduce_overlap(context, state, k, start, stop):
    """This thread's partial totals of the overlap, added into ``sums[k]`` atomically."""
    (stored, formats, absmax, tables, mode, seed, draw, scalars, columns, flags, scratch,
     rows, partial, sums, grad_multiplier, scale_grads) = context
    n_arrays = len(formats) - 2
    for j in range(SUMS_MAX):
        partial[j] = 0.0
    a, b, stride = thread_elements(start, stop)
    for i in range(a, b, stride):
        load_element(stored, formats, absmax, tables, mode, seed, draw, scratch,  # noqa: F821
                     i, scale_grads, grad_multiplier, n_arrays)
        values = reduce(rows, scalars, columns, flags, k, 0, 1, 1)  # noqa: F821
        for j in range(len(values)):
            partial[j] += values[j]
    for j in range(SUMS_MAX):
        if j < sums.shape[1]:
            cuda.atomic.add(sums, (k, j), partial[j])
    return state


def _coded_reduce_walk(stored, formats, absmax, tables, rounding, mode, seed, draw, scalars,
                       columns, flags, present, offsets, sizes, chunk_first, chunk_size, total,
                       sums, grad_multiplier, scale_grads):
    """The rule's reduce over loaded elements: each thread's partial totals per segment,
    added into ``sums[k]`` atomically (in no fixed order, as the plain CUDA reduce). The
    partial totals are indexed only by constants once the loops over ``SUMS_MAX`` unroll, so
    they stay in registers (a runtime index puts an array in local memory)."""
    scratch = cuda.local.array((ROWS_MAX, 1), float32)
    partial = cuda.local.array(SUMS_MAX, float64)
    walk(present, offsets, sizes, chunk_first, chunk_size, total,  # noqa: F821 (bound)
         (stored, formats, absmax, tables, mode, seed, draw, scalars, columns, flags, scratch,
          as_rows(scratch), partial, sums, grad_multiplier, scale_grads), None)  # noqa: F821


# ----------------------------------------------------------------------------- compiling
def _bit_casts() -> dict:
    if simulated():
        return {"f32_bits": simulated_f32_bits, "f32_from_bits": simulated_f32_from_bits,
                "hash32": portable_hash32}
    device = cuda.jit(device=True)
    return {"f32_bits": device(cuda_f32_bits), "f32_from_bits": device(cuda_f32_from_bits),
            "hash32": device(portable_hash32)}


_codec: dict = {}


def codec() -> dict:
    """The codec and the per-element functions compiled for CUDA, by name (once)."""
    if not _codec:
        device = cuda.jit(device=True)
        _codec.update(bind_functions("the storage codec", CODEC_FUNCTIONS, device,
                                     _bit_casts()))
        _codec.update(bind_functions("the CUDA codec's elements", ELEMENT_FUNCTIONS, device,
                                     primitives=dict(_codec)))
    return _codec


def _launch(kernel, layout, blocks, threads, stream, *args) -> None:
    n_chunks = layout.chunk_first.size
    if n_chunks:
        launch(kernel, grid(n_chunks) if blocks is None else blocks, threads, stream, *args)


class CudaCodedKernels:
    """A rule's coded walks on CUDA (``arrays``: ``CodedPlan.arguments``, device arrays on a
    GPU); prepare and finalize are the plain kernels' (``plain``). ``blocks`` overrides the
    grid size and ``threads`` the block size of walks without 8-bit state (tests: the
    results do not depend on them); walks with 8-bit state always run ``BLOCK`` threads."""

    def __init__(self, step, block_step, reduce, plain):
        self.step_kernel, self.block_kernel, self.reduce_kernel = step, block_step, reduce
        self.prepare, self.finalize = plain.prepare, plain.finalize

    def step(self, arrays, scalars, columns, flags, layout, grad_multiplier, scale_grads,
             threads=BLOCK, stream=0, blocks=None) -> None:
        formats = arrays[1]
        blockwise = Q8_SIGNED in formats or Q8_UNSIGNED in formats
        kernel = self.block_kernel if blockwise else self.step_kernel
        _launch(kernel, layout, blocks, BLOCK if blockwise else threads, stream, *arrays,
                scalars, columns, flags, layout.present, layout.offsets, layout.sizes,
                layout.chunk_first, layout.chunk_size, layout.length, grad_multiplier,
                scale_grads)

    def reduce(self, arrays, scalars, columns, flags, layout, sums, grad_multiplier,
               scale_grads, threads=BLOCK, stream=0, zero_sums=True, blocks=None) -> None:
        """``zero_sums=False``: ``sums`` is a device array the caller zeroed."""
        if zero_sums:
            sums[...] = 0.0
        _launch(self.reduce_kernel, layout, blocks, threads, stream, *arrays, scalars,
                columns, flags, layout.present, layout.offsets, layout.sizes,
                layout.chunk_first, layout.chunk_size, layout.length, sums, grad_multiplier,
                scale_grads)


_compiled: dict[str, CudaCodedKernels] = {}


def coded_functions(rule: Rule) -> dict:
    """The device functions the coded walks of ``rule`` call, by name: the codec, the
    per-element functions, the rule's span and reduce, and ``step_element`` over them."""
    device = cuda.jit(device=True)
    functions = bind(rule, device, {"fma": fma_primitive()})
    bound = {"as_rows": device(ROWS[2 + len(rule.slots)]), **codec(),
             "span": functions[rule.span.__name__]}
    if rule.reduce is not None:
        bound["reduce"] = functions[rule.reduce.__name__]
    bound["step_element"] = device(instantiate(step_element, "step_element", **bound))
    return bound


def compile_coded(rule: Rule, plain, key: str, source: Source) -> CudaCodedKernels:
    """The coded walks of ``rule`` on CUDA beside its ``plain`` CUDA kernels, once per
    ``key`` (the plain kernels' key: rule, fingerprint, exactness); ``source`` makes them
    again (``kernels.cuda.compile_coded``)."""
    key = f"{key}_{CODEC_FINGERPRINT}"
    compiled = _compiled.get(key)
    if compiled is None:
        n_arrays = 2 + len(rule.slots)
        if n_arrays not in ROWS or len(rule.reductions) > SUMS_MAX:
            raise TypeError(f"rule {rule.name!r}: the CUDA codec walk takes {min(ROWS)} to "
                            f"{max(ROWS)} arrays and at most {SUMS_MAX} reductions")
        if n_arrays + 2 > ROWS_MAX:
            raise TypeError(f"rule {rule.name!r}: too many arrays for the CUDA codec walk")
        bound = coded_functions(rule)

        def kernel(template, visit, name):
            walk = chunk_walk(visit, f"{name}_{key}", **bound)
            return make(instantiate(template, f"{name}_{key}", walk=walk, **bound), source)
        step = kernel(_coded_step_walk, _coded_step_overlap, "coded_step")
        block_step = kernel(_coded_block_walk, _coded_block_overlap, "coded_block")
        reduce = None
        if rule.reduce is not None:
            reduce = kernel(_coded_reduce_walk, _coded_reduce_overlap, "coded_reduce")
        compiled = _compiled[key] = CudaCodedKernels(step, block_step, reduce, plain)
    return compiled


__all__ = ["CudaCodedKernels", "compile_coded", "coded_functions", "codec", "fma_primitive",
           "half_kernels", "step_element", "ELEMENT_FUNCTIONS"]
