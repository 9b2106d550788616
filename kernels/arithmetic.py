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


def simulated_f32_bits(x):
    """``f32_bits`` for the CUDA simulator: the pattern through a numpy view."""
    import numpy as np
    return np.array([x], dtype=np.float32).view(np.uint32)[0]


def simulated_f32_from_bits(u):
    """``f32_from_bits`` for the CUDA simulator: the float through a numpy view."""
    import numpy as np
    return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]
