"""Arithmetic the rule bodies share across backends: ``fma(a, b, c)``, ``a * b + c`` rounded
once, where torch's CPU kernels fuse (ATen's ``add(self, other, alpha)`` is
``vec::fmadd(other, alpha, self)``, its ``lerp`` and ``addcmul`` fuse their last step, on
AVX2/AVX512; see ``../shared/reference/torch_optim_semantics.md``). A rule that matches torch
bit for bit calls it exactly where torch fuses and nowhere else.

On the CPU ``fma`` is LLVM's ``llvm.fma`` (one instruction with FMA hardware, correctly
rounded everywhere); the CUDA backend binds the name to ``numba.cuda.fma``, and Numba's CUDA
simulator to :func:`simulated_fma`. All three arguments must have one float type: a float64
scalar reaching a float32 kernel is a typing error, not a silent promotion.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def fma(typingctx, a, b, c):
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        kind = args[0].type
        function = builder.module.declare_intrinsic(
            "llvm.fma", [kind], ir.FunctionType(kind, [kind, kind, kind]))
        return builder.call(function, args)

    return a(a, b, c), codegen


def simulated_fma(a, b, c):
    """``a * b + c`` for the CUDA simulator (two roundings: its results are compared with a
    tolerance)."""
    return a * b + c


# Bit casts between float32 and its uint32 pattern, for the storage codec (``storage.py``).
# LLVM's ``bitcast``: the same on every Numba target (CPU and CUDA), no rounding, NaN payloads
# kept. Numba's CUDA simulator binds the names to the ``simulated_`` versions below.

@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bit pattern of a float32 ``x`` as a uint32 (a float64 is a typing error)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose IEEE bit pattern is the integer ``u`` (its low 32 bits; a narrower
    integer is zero-extended)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if u.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif u.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def byte_word(typingctx, raw, k):
    """The 32-bit word whose lowest byte is byte ``k`` of the uint8 array ``raw`` (bytes ``k``
    to ``k + 3``, little-endian, as every Numba CPU target is): one unaligned load, which
    a vector loop turns into a 32-bit gather (x86 gathers no bytes). ``raw`` must extend
    three bytes past every ``k`` read; ``word & 0xFF`` is ``raw[k]``. CPU only."""
    if not (isinstance(raw, types.Array) and raw.dtype == types.uint8
            and isinstance(k, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        word = builder.bitcast(builder.gep(data, [index], inbounds=True),
                               ir.IntType(32).as_pointer())
        return builder.load(word, align=1)

    return types.uint32(raw, k), codegen


def simulated_f32_bits(x):
    """``f32_bits`` for the CUDA simulator: the pattern through a numpy view."""
    import numpy as np
    return np.array([x], dtype=np.float32).view(np.uint32)[0]


def simulated_f32_from_bits(u):
    """``f32_from_bits`` for the CUDA simulator: the float through a numpy view."""
    import numpy as np
    return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


# The storage codec's per-element hash (``storage.mix32_at``): 32-bit arithmetic, so the CPU's
# vector loops multiply eight lanes at a time (Numba widens uint32 arithmetic to 64 bits, and
# a 64-bit multiply costs three instructions per vector lane group on x86).
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio
_LOWBIAS1, _LOWBIAS2 = 0x7FEB352D, 0x846CA68B  # Wellons' lowbias32 multipliers


_I32 = ir.IntType(32)


def _word(builder, value, kind):
    """The low 32 bits of an integer ``value`` of Numba type ``kind`` (an i32)."""
    if kind.bitwidth > 32:
        return builder.trunc(value, _I32)
    return builder.zext(value, _I32) if kind.bitwidth < 32 else value


@intrinsic
def hash32(typingctx, lo, hi):
    """``lowbias32(lo ^ hi * 0x9E3779B9)`` over the low 32 bits of the integers ``lo`` and
    ``hi``, as a uint32: Wellons' lowbias32 (``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
    x *= 0x846ca68b; x ^= x >> 16``), a bijection of 32-bit words with low avalanche bias.
    :func:`portable_hash32` is the same function in plain integer arithmetic."""
    if not (isinstance(lo, types.Integer) and isinstance(hi, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        def const(value):
            return ir.Constant(_I32, value)

        x = builder.xor(_word(builder, args[0], lo),
                        builder.mul(_word(builder, args[1], hi), const(_GOLDEN32)))
        x = builder.mul(builder.xor(x, builder.lshr(x, const(16))), const(_LOWBIAS1))
        x = builder.mul(builder.xor(x, builder.lshr(x, const(15))), const(_LOWBIAS2))
        return builder.xor(x, builder.lshr(x, const(16)))

    return types.uint32(lo, hi), codegen


@intrinsic
def add32(typingctx, a, b):
    """``(a + b) mod 2**32`` over the low 32 bits of two integers, as a uint32 (one 32-bit
    add: a vector loop keeps 32-bit lanes, where Numba's own integer arithmetic is 64-bit)."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        return builder.add(_word(builder, args[0], a), _word(builder, args[1], b))

    return types.uint32(a, b), codegen


_W = np.uint64(0xFFFFFFFF)
_W_GOLDEN, _W_LOWBIAS1, _W_LOWBIAS2 = (np.uint64(_GOLDEN32), np.uint64(_LOWBIAS1),
                                       np.uint64(_LOWBIAS2))
_W15, _W16 = np.uint64(15), np.uint64(16)


def portable_hash32(lo, hi):
    """:func:`hash32` in plain integer arithmetic (every product of two words below 2**32,
    masked back to 32 bits): what the CUDA backend and Numba's simulator bind the name to."""
    x = (np.uint64(lo) & _W) ^ (((np.uint64(hi) & _W) * _W_GOLDEN) & _W)
    x = ((x ^ (x >> _W16)) * _W_LOWBIAS1) & _W
    x = ((x ^ (x >> _W15)) * _W_LOWBIAS2) & _W
    return np.uint32(x ^ (x >> _W16))
