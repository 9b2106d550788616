"""Matrix products with bfloat16 operands and float32 sums, on the CPU's AMX tile units.

What Muon's Newton-Schulz iteration needs to run at torch's speed on the CPU: torch runs it
in bfloat16, whose products oneDNN computes with AMX where the CPU has it (Intel Xeon from
Sapphire Rapids on), 3-4x faster than a float32 product; NumPy's BLAS has no bfloat16 product.

:func:`matmul` computes ``round(a) @ round(b)`` where ``round`` is float32 -> bfloat16 to
nearest, ties to even (:func:`kernels.storage.bf16_encode_nearest`), every product of two
bfloat16 values exact in float32 and the sums in float32. With AMX (:func:`available`) the
operands are packed into bfloat16 tiles (the right one in AMX's pair-interleaved layout,
zero-padded to whole tiles) and a parallel kernel walks 32 x 32 blocks of the result, each
with four accumulator tiles over the inner dimension 32 at a time (``TDPBF16PS``); the sums
of a block run in one fixed order, so the result does not depend on the thread count.
Without AMX the same rounded operands go to NumPy's float32 product: the same products,
summed in BLAS's order (results agree to float32 rounding of the sums, not bit for bit).

AMX needs the kernel's permission per process (Linux's ``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
asked once by :func:`available`); the tile intrinsics are LLVM's, which take the tile
registers as constants.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
import numba
from numba import njit, prange, types, uint64
from numba.extending import intrinsic

from .coded_views import CODEC
from .threads import USABLE_CORES, threaded

_bf16_encode_nearest = CODEC["bf16_encode_nearest"]
_bf16_decode = CODEC["bf16_decode"]

TILE_ROWS = 16
"""Rows of every tile: a 16 x 16 float32 accumulator, a 16 x 32 bfloat16 operand."""
BLOCK = 32
"""The result's blocks (2 x 2 accumulator tiles) and the inner dimension's steps (32
bfloat16 values, one 64-byte tile row); operands are zero-padded to multiples of it."""
_TILE_BYTES = 64

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def available() -> bool:
    """Whether this process can run the AMX kernel: an x86-64 Linux CPU with AMX-BF16 (as
    LLVM sees the host) whose kernel grants the tile data permission."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    features = llvm.get_host_cpu_features()
    if not (features.get("amx-bf16") and features.get("amx-tile")):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


# --- the tile intrinsics ---------------------------------------------------------------------

_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_BYTES = _I8.as_pointer()


def _declare(builder, name, arguments):
    function = builder.module.globals.get(name)
    if function is None:
        function = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), arguments), name)
    return function


def _tile(kind) -> int | None:
    return kind.literal_value if isinstance(kind, types.IntegerLiteral) else None


def _address(context, builder, array_type, array, row, col):
    """The byte address of ``array[row, col]`` (a C-contiguous 2-D array) and its row stride."""
    a = context.make_array(array_type)(context, builder, array)
    stride = builder.extract_value(a.strides, 0)
    itemsize = context.get_constant(types.intp, array_type.dtype.bitwidth // 8)
    offset = builder.add(builder.mul(row, stride), builder.mul(col, itemsize))
    return builder.gep(builder.bitcast(a.data, _BYTES), [offset]), stride


@intrinsic
def _tile_config(typingctx, config):
    """Load the tile configuration ``config`` (64 bytes, :func:`_configuration`)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        builder.call(_declare(builder, "llvm.x86.ldtilecfg", [_BYTES]),
                     [builder.bitcast(data, _BYTES)])
        return context.get_dummy_value()

    return types.void(config), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, signature, args):
        builder.call(_declare(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _tile_zero(typingctx, tile):
    if _tile(tile) is None:
        return None

    def codegen(context, builder, signature, args):
        builder.call(_declare(builder, "llvm.x86.tilezero", [_I8]),
                     [ir.Constant(_I8, _tile(tile))])
        return context.get_dummy_value()

    return types.void(tile), codegen


def _tile_move(name):
    """A tile load or store at ``array[row, col]``, rows ``array``'s stride apart."""
    @intrinsic
    def move(typingctx, tile, array, row, col):
        if _tile(tile) is None or not isinstance(array, types.Array):
            return None

        def codegen(context, builder, signature, args):
            r = context.cast(builder, args[2], signature.args[2], types.intp)
            c = context.cast(builder, args[3], signature.args[3], types.intp)
            address, stride = _address(context, builder, signature.args[1], args[1], r, c)
            builder.call(_declare(builder, name, [_I8, _BYTES, _I64]),
                         [ir.Constant(_I8, _tile(tile)), address, stride])
            return context.get_dummy_value()

        return types.void(tile, array, row, col), codegen

    return move


_tile_load = _tile_move("llvm.x86.tileloadd64")
_tile_store = _tile_move("llvm.x86.tilestored64")


@intrinsic
def _tile_dot(typingctx, sums, left, right):
    """``sums += left @ right`` (float32 += bfloat16 pairs, ``TDPBF16PS``)."""
    if None in (_tile(sums), _tile(left), _tile(right)):
        return None

    def codegen(context, builder, signature, args):
        builder.call(_declare(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8]),
                     [ir.Constant(_I8, _tile(t)) for t in (sums, left, right)])
        return context.get_dummy_value()

    return types.void(sums, left, right), codegen


def _configuration() -> np.ndarray:
    """Palette 1, eight tiles of ``TILE_ROWS`` rows of 64 bytes: 0-1 the left operand's
    rows, 2-3 the right operand's pairs, 4-7 the block's accumulators."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    config[16:32].view(np.uint16)[:8] = _TILE_BYTES
    config[48:56] = TILE_ROWS
    return config


_CONFIG = _configuration()


# --- operands and the product ---------------------------------------------------------------
# An operand is packed tile by tile, each tile's 16 rows of 64 bytes contiguous (a tile load
# then reads 1 KiB in a row: loads of rows a matrix's stride apart, 1-2 KiB at 512 columns,
# fell into a few L1 sets and took twice as long), as bfloat16 patterns of a matrix whose
# dimensions are multiples of BLOCK (the caller zero-pads):
# - a left operand (m x k): ``left[i // 16, k // 32, i % 16, k % 32]``;
# - a right operand (k x n), in AMX's layout of two rows interleaved:
#   ``right[k // 32, j // 16, (k % 32) // 2, 2 (j % 16) + k % 2]``.

@njit(inline="always", error_model="numpy")
def encode_one(value):
    """A float32 as the nearest bfloat16 pattern (for a fused pass that makes an operand)."""
    return _bf16_encode_nearest(value)


@njit(inline="always", error_model="numpy")
def decode_one(bits):
    """The float32 value of a bfloat16 pattern."""
    return _bf16_decode(bits)


def left_shape(m: int, k: int) -> tuple:
    return (m // TILE_ROWS, k // BLOCK, TILE_ROWS, BLOCK)


def right_shape(k: int, n: int) -> tuple:
    return (k // BLOCK, n // TILE_ROWS, TILE_ROWS, BLOCK)


@njit(inline="always", error_model="numpy")
def put_left(out, i, k, bits):
    """Element ``(i, k)`` of a left operand ``out``."""
    out[i // TILE_ROWS, k // BLOCK, i % TILE_ROWS, k % BLOCK] = bits


@njit(inline="always", error_model="numpy")
def store_block(bits, i, j, left, right, transposed):
    """The ``BLOCK x BLOCK`` patterns ``bits`` (C-contiguous) of a matrix's block at
    ``(i, j)`` into its left operand, its right operand and its transpose's right operand
    (each skipped where empty), a tile at a time. The loops index flat views with unsigned
    offsets computed once per tile row: a slice per row (``left[a, b, r]``) costs more than
    the row's 64 bytes, and a signed index keeps Numba's negative-index check in the loop,
    which then does not vectorize."""
    half = TILE_ROWS
    width = uint64(half)
    flat = bits.reshape(bits.size)
    if left.size:  # a left tile is 16 of the block's rows, contiguous in both
        out = left.reshape(left.size)
        for t in range(2):
            base = uint64(((i // half + t) * left.shape[1] + j // BLOCK) * half * BLOCK)
            source = uint64(t * half * BLOCK)
            for e in range(uint64(half * BLOCK)):
                out[base + e] = flat[source + e]
    # a right operand's tile row holds 16 pairs, each a 32-bit word (the pair's first
    # element in the low half): built and moved as words, half the stores
    if right.size:  # rows 2r and 2r + 1 of the block, paired, 16 columns per tile
        out = right.reshape(right.size).view(np.uint32)
        for t in range(2):
            base = ((i // BLOCK) * right.shape[1] + j // half + t) * half * half
            for r in range(half):
                target = uint64(base + r * half)
                even = uint64(2 * r * BLOCK + t * half)
                odd = even + uint64(BLOCK)
                for c in range(width):
                    out[target + c] = (np.uint32(flat[even + c])
                                       | (np.uint32(flat[odd + c]) << np.uint32(16)))
    if transposed.size:  # the block's transpose: its row r's pairs are column r's words
        out = transposed.reshape(transposed.size).view(np.uint32)
        words = flat.view(np.uint32)  # BLOCK x 16 words: row c's pairs
        for t in range(2):
            base = ((j // BLOCK) * transposed.shape[1] + i // half + t) * half * half
            for r in range(half):
                target = uint64(base + r * half)
                column = uint64(t * half * half + r)
                for c in range(width):
                    out[target + c] = words[column + c * width]


@threaded(cache=True, error_model="numpy")
def _pack(a, left, right, transposed):
    """:func:`pack`, its arguments checked (``a`` C-contiguous)."""
    cols = a.shape[1]
    flat = a.reshape(a.size)
    for strip in prange(a.shape[0] // BLOCK):
        bits = np.empty((BLOCK, BLOCK), np.uint16)
        row_bits = bits.reshape(bits.size)
        i = strip * BLOCK
        for j in range(0, cols, BLOCK):
            for r in range(BLOCK):
                source, target = uint64((i + r) * cols + j), uint64(r * BLOCK)
                for c in range(uint64(BLOCK)):
                    row_bits[target + c] = _bf16_encode_nearest(flat[source + c])
            store_block(bits, i, j, left, right, transposed)


def pack(a: np.ndarray, left: np.ndarray, right: np.ndarray, transposed: np.ndarray) -> None:
    """The operands of float32 ``a`` (any strides, its dimensions multiples of ``BLOCK``),
    rounded: its left operand, its right operand and its transpose's right operand, each
    skipped where given empty. Misshapen arrays are refused (``ValueError``) before anything
    is written: the kernel does not check its indices."""
    if a.dtype != np.float32 or a.ndim != 2 or a.shape[0] % BLOCK or a.shape[1] % BLOCK:
        raise ValueError(f"a must be a float32 matrix of multiples of {BLOCK}, got "
                         f"{a.dtype} {a.shape}")
    m, n = a.shape
    for name, out, shape in (("left", left, left_shape(m, n)), ("right", right, right_shape(m, n)),
                             ("transposed", transposed, right_shape(n, m))):
        if out.size and (out.dtype != np.uint16 or out.shape != shape
                         or not out.flags.c_contiguous):
            raise ValueError(f"{name} must be empty or a C-contiguous uint16 array of shape "
                             f"{shape}, got {out.dtype} {out.shape}")
    _pack(a.size, np.ascontiguousarray(a), left, right, transposed)


DEPTH_STEPS = 8
"""Inner-dimension steps (of ``BLOCK``) per pass over a panel: a strip's left operand for
one pass, 2 x 8 tiles (16 KiB), stays in L1 while the panel's right tiles stream by."""
PANEL_TILES = 64
"""Right-operand tile columns per panel (1024 columns): a panel of ``DEPTH_STEPS`` steps is
512 KiB, in a core's L2 while every strip of the thread passes over it (the whole right
operand, 4.5 MiB at 768 x 3072, came from L3 once per strip)."""


@threaded(cache=True, error_model="numpy")
def _dot(left, right, sums, config, threads):
    """``sums`` = ``left @ right``, the rows' strips of 32 split evenly among the threads.
    Each thread walks panels of the right operand (``DEPTH_STEPS`` x ``PANEL_TILES`` tiles),
    and for each of its strips the panel's 32 x 32 blocks, a block's sums loaded from
    ``sums`` (zero at the first panel of the inner dimension) and stored back; each block's
    inner dimension runs in order, so the sums do not depend on the thread count. The tiles
    are configured once per thread (``threads``: the caller's ``numba.get_num_threads()``,
    an argument so that the kernel can be cached)."""
    strips = left.shape[0] // 2
    tiles = right.shape[1]
    depth = left.shape[1]
    parts = min(threads, strips)
    for part in prange(parts):
        first, last = part * strips // parts, (part + 1) * strips // parts
        _tile_config(config)
        for k0 in range(0, depth, DEPTH_STEPS):
            k1 = min(k0 + DEPTH_STEPS, depth)
            for j0 in range(0, tiles, PANEL_TILES):
                for strip in range(first, last):
                    i = 2 * strip
                    row = i * TILE_ROWS
                    for j in range(j0, min(j0 + PANEL_TILES, tiles), 2):
                        col = j * TILE_ROWS
                        if k0 == 0:
                            _tile_zero(4)
                            _tile_zero(5)
                            _tile_zero(6)
                            _tile_zero(7)
                        else:
                            _tile_load(4, sums, row, col)
                            _tile_load(5, sums, row, col + TILE_ROWS)
                            _tile_load(6, sums, row + TILE_ROWS, col)
                            _tile_load(7, sums, row + TILE_ROWS, col + TILE_ROWS)
                        for k in range(k0, k1):
                            # each load just before the first product that needs it, so
                            # that the products start while the other tiles load (3% faster
                            # than the four loads first)
                            _tile_load(0, left[i, k], 0, 0)
                            _tile_load(2, right[k, j], 0, 0)
                            _tile_dot(4, 0, 2)
                            _tile_load(3, right[k, j + 1], 0, 0)
                            _tile_dot(5, 0, 3)
                            _tile_load(1, left[i + 1, k], 0, 0)
                            _tile_dot(6, 1, 2)
                            _tile_dot(7, 1, 3)
                        _tile_store(4, sums, row, col)
                        _tile_store(5, sums, row, col + TILE_ROWS)
                        _tile_store(6, sums, row + TILE_ROWS, col)
                        _tile_store(7, sums, row + TILE_ROWS, col + TILE_ROWS)
        _tile_release()


def dot(left: np.ndarray, right: np.ndarray, sums: np.ndarray) -> None:
    """``sums`` (float32, m x n, C-contiguous) = the product of the packed operands
    ``left`` (uint16, C-contiguous, :func:`left_shape` ``(m, k)``) and ``right`` (the same,
    :func:`right_shape` ``(k, n)``); only where :func:`available` (a CPU without AMX stops
    at an illegal instruction). Anything else is refused before a tile is touched: the
    tiles read and write whole rows of 64 bytes, so a wrong dtype or layout would read or
    write past the arrays."""
    if not available():
        raise RuntimeError("this CPU or process cannot run AMX tile instructions")
    for name, array, dtype in (("left", left, np.uint16), ("right", right, np.uint16),
                               ("sums", sums, np.float32)):
        if array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype)} array, got "
                             f"{array.dtype} {'C' if array.flags.c_contiguous else 'strided'}")
    if left.ndim != 4 or right.ndim != 4 or sums.ndim != 2:
        raise ValueError(f"operands {left.shape} and {right.shape} into {sums.shape}: not "
                         f"packed operands and a matrix")
    m, n = sums.shape
    k = left.shape[1] * BLOCK
    if (left.shape != left_shape(m, k) or right.shape != right_shape(k, n)
            or m % BLOCK or n % BLOCK):
        raise ValueError(f"operands {left.shape} and {right.shape} into {sums.shape}: not "
                         f"packed products of multiples of {BLOCK}")
    _dot(m * n * (k // BLOCK), left, right, sums, _CONFIG,
         min(numba.get_num_threads(), USABLE_CORES))


@threaded(cache=True, error_model="numpy")
def _round(a, out):
    flat_in = a.reshape(-1)
    flat_out = out.reshape(-1)
    for i in prange(flat_in.size):
        flat_out[i] = _bf16_decode(_bf16_encode_nearest(flat_in[i]))


def round_bfloat16(a: np.ndarray, out: np.ndarray) -> None:
    """``out`` = ``a`` (float32, C-contiguous) rounded to the nearest bfloat16, as float32."""
    _round(a.size, a, out)


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of ``BLOCK``."""
    return -(-n // BLOCK) * BLOCK


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, amx: bool | None = None) -> None:
    """``out`` = ``round(a) @ round(b)``: float32 ``a`` (m x k) and ``b`` (k x n), any
    strides, each element rounded to bfloat16, the products summed in float32, into the
    float32 ``out`` (m x n). ``amx``: whether to use the AMX kernel (default: where
    :func:`available`); without it, NumPy's float32 product of the rounded operands."""
    if amx is None:
        amx = available()
    (m, k), n = a.shape, b.shape[1]
    if not amx:
        left, right = np.empty((m, k), np.float32), np.empty((k, n), np.float32)
        round_bfloat16(np.ascontiguousarray(a, np.float32), left)
        round_bfloat16(np.ascontiguousarray(b, np.float32), right)
        np.matmul(left, right, out=out)
        return
    pa = np.zeros((padded(m), padded(k)), np.float32)
    pb = np.zeros((padded(k), padded(n)), np.float32)
    pa[:m, :k], pb[:k, :n] = a, b
    left = np.empty(left_shape(*pa.shape), np.uint16)
    right = np.empty(right_shape(*pb.shape), np.uint16)
    none = np.empty((0, 0, 0, 0), np.uint16)
    pack(pa, left, none, none)
    pack(pb, none, right, none)
    sums = np.empty((pa.shape[0], pb.shape[1]), np.float32)
    dot(left, right, sums)
    out[...] = sums[:m, :n]
