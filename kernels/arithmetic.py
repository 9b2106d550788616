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
