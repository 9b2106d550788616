"""Muon (torch.optim.Muon): momentum, then Newton-Schulz orthogonalisation of each 2-D update.

The orthogonalisation needs whole matrices, so this rule's update is ``muon_update``, a NumPy
function run per present parameter (``Rule.per_parameter``); its kernels only mark which
parameters have a momentum buffer."""

import math
import threading
from typing import NamedTuple

import numpy as np
from numba import njit, prange, uint64

from .. import amx
from ..layouts import positions
from ..rule import Rule
from ..threads import threaded


class Columns(NamedTuple):
    momentum_initialized: int


C = positions(Columns)


def muon_prepare(present, columns, scalars, flags, start, stop, stride):
    initialized = columns[C.momentum_initialized]
    for k in range(start, stop, stride):
        if present[k] != 0:
            initialized[k] = 1


def muon_span(arrays, scalars, columns, flags, k, start, stop, stride):
    pass  # the update is muon_update, per parameter


def torch_lerp(start, end, weight, dtype):
    """torch's lerp, from the nearer end, with the weight in the tensors' dtype."""
    w = dtype.type(weight)
    if abs(float(w)) < 0.5:
        return start + w * (end - start)
    return end - (dtype.type(1) - w) * (end - start)


def zeropower_via_newtonschulz(update: np.ndarray, coefficients, steps: int, eps: float,
                               products: str | None = None, scratch: bool = False) -> np.ndarray:
    """torch's ``_zeropower_via_newtonschulz``: in the update's own dtype (``products``
    None), or with the matrix products' operands rounded to bfloat16 and summed in float32,
    the rest in float32 (``"bfloat16"``: torch's choice, :func:`newtonschulz_bfloat16`,
    ``scratch`` as there)."""
    if products == "bfloat16":
        return newtonschulz_bfloat16(update, coefficients, steps, eps,
                                     scratch=scratch).astype(update.dtype, copy=False)
    a, b, c = (update.dtype.type(x) for x in coefficients)
    x = update.T if update.shape[0] > update.shape[1] else update
    x = x / max(update.dtype.type(np.linalg.norm(x)), update.dtype.type(eps))
    # x = a x + (b G + c G G) x with G = x x^T, in three work arrays allocated once: the same
    # operations in the same order as the expression, so the same bits, without a new
    # temporary per operation and iteration
    gram = np.empty((x.shape[0], x.shape[0]), x.dtype)
    gram_squared = np.empty_like(gram)
    product = np.empty_like(x)
    for _ in range(steps):
        np.matmul(x, x.T, out=gram)
        np.matmul(gram, gram, out=gram_squared)
        gram_squared *= c
        gram *= b
        gram += gram_squared
        np.matmul(gram, x, out=product)
        x *= a
        x += product
    return x.T if update.shape[0] > update.shape[1] else x


def newtonschulz_bfloat16(update: np.ndarray, coefficients, steps: int, eps: float,
                          tiles: bool | None = None, scratch: bool = False) -> np.ndarray:
    """The Newton-Schulz iteration with bfloat16 products (``r``: rounding to the nearest
    bfloat16; every product of two of them is exact in float32, where the sums run)::

        x = u / max(||u||, eps)                 (u in float32, its wide orientation)
        G = r(r(x) @ r(x)^T)
        x = a r(x) + r(b G + c (G @ G)) @ r(x)      (ns_steps times)

    torch's bfloat16 iteration (``_zeropower_via_newtonschulz``), less its roundings of the
    sums ``a x + ...`` before the last one: each term's operands are the same rounded
    matrices, so the polynomial stays consistent (rounding ``G`` for its square but not in
    ``b G``, or ``x`` in the products but not in ``a x``, took the result about 1.4x farther
    from the float64 iteration's than torch's; this is as close as torch's). With ``tiles``
    (default: where ``amx.available()``) the products run on the AMX kernel over zero-padded
    work arrays made once, each rounding fused into the pass that makes its operand;
    otherwise as NumPy's float32 products of the rounded operands (the same values up to the
    order of the sums). With ``scratch`` the tiles path returns a view of this thread's work
    buffer (:func:`work_arrays`), valid until the thread's next call, instead of a copy."""
    f32 = np.float32
    a, b, c = (f32(x) for x in coefficients)
    tall = update.shape[0] > update.shape[1]
    source = update.astype(f32, copy=False)
    source = source.T if tall else source
    scale = max(f32(np.linalg.norm(source)), f32(eps))
    if tiles is None:
        tiles = amx.available()
    if tiles and source.size:
        x = _newtonschulz_tiles(np.ascontiguousarray(update, f32), tall, scale, a, b, c, steps)
        x = x if scratch else x.copy()
    else:
        x = np.empty(source.shape, f32)
        np.divide(source, scale, out=x)
        for _ in range(steps):
            rounded = np.empty_like(x)
            amx.round_bfloat16(x, rounded)
            gram = np.empty((x.shape[0], x.shape[0]), f32)
            np.matmul(rounded, rounded.T, out=gram)
            amx.round_bfloat16(gram, gram)  # element by element: in place is safe
            combined = b * gram + c * (gram @ gram)
            amx.round_bfloat16(combined, combined)
            x = a * rounded + combined @ rounded
    return x.T if tall else x


@threaded(cache=True, error_model="numpy")
def _start(update, tall, scale, left, right, transposed, empty):
    """The three operands (``kernels/amx.py``) of ``r(x)``, ``x = u / scale`` in its wide
    orientation (``update`` C-contiguous, ``x`` its transpose where ``tall``), zero-padded to
    the operands' whole blocks. A block is read along ``update``'s rows, so that the division
    and rounding run as vector loops (a transposed ``np.divide`` over GPT-2's 3072 x 768
    matrix alone took 16 ms); a tall update's block is its transpose ``tb``, whose right
    operand is ``x``'s transposed one and vice versa (``store_block`` with the block's
    coordinates swapped, ``empty`` for its left operand), ``x``'s left operand gathered from
    it."""
    rows, cols = update.shape
    flat, out = update.reshape(update.size), left.reshape(left.size)
    for strip in prange(left.shape[0] // 2):
        bits = np.empty((amx.BLOCK, amx.BLOCK), np.uint16)
        flat_bits = bits.reshape(bits.size)
        i = strip * amx.BLOCK
        for j in range(0, left.shape[1] * amx.BLOCK, amx.BLOCK):
            # the block of update read here: its rows r0.., its columns c0..
            r0, c0 = (j, i) if tall else (i, j)
            height, width = min(amx.BLOCK, rows - r0), min(amx.BLOCK, cols - c0)
            if height < amx.BLOCK or width < amx.BLOCK:
                for e in range(amx.BLOCK * amx.BLOCK):
                    flat_bits[e] = 0
            for r in range(height):
                source, target = uint64((r0 + r) * cols + c0), uint64(r * amx.BLOCK)
                for col in range(uint64(width)):
                    flat_bits[target + col] = amx.encode_one(flat[source + col] / scale)
            if not tall:
                amx.store_block(bits, i, j, left, right, transposed)
                continue
            amx.store_block(bits, j, i, empty, transposed, right)
            for t in range(2):
                for r in range(amx.TILE_ROWS):
                    base = uint64((((i // amx.TILE_ROWS + t) * left.shape[1] + j // amx.BLOCK)
                                   * amx.TILE_ROWS + r) * amx.BLOCK)
                    column = uint64(t * amx.TILE_ROWS + r)
                    for col in range(uint64(amx.BLOCK)):
                        out[base + col] = flat_bits[col * uint64(amx.BLOCK) + column]


@threaded(cache=True, error_model="numpy")
def _combine(gram_left, gram_squared, b, c, out):
    """``out`` = the left operand (``kernels/amx.py``) of ``r(b r(G) + c G2)``, ``r(G)``
    read from its own left operand ``gram_left``: the same layout as ``out``, a tile row of
    32 elements a row of ``gram_squared``. (Flat views and unsigned offsets, as
    ``amx.store_block``'s.)"""
    rows, depth = gram_squared.shape[0] // amx.TILE_ROWS, gram_left.shape[1]
    width = gram_squared.shape[1]
    g, g2, target = gram_left.reshape(gram_left.size), gram_squared.reshape(gram_squared.size), \
        out.reshape(out.size)
    for tile in prange(rows):
        for step in range(depth):
            for r in range(amx.TILE_ROWS):
                packed = uint64(((tile * depth + step) * amx.TILE_ROWS + r) * amx.BLOCK)
                row = uint64((tile * amx.TILE_ROWS + r) * width + step * amx.BLOCK)
                for col in range(uint64(amx.BLOCK)):
                    target[packed + col] = amx.encode_one(b * amx.decode_one(g[packed + col])
                                                          + c * g2[row + col])


@threaded(cache=True, error_model="numpy")
def _advance(x, product, a, left, right, transposed, last):
    """``x = a r(x) + product``, ``r(x)`` read from its left operand ``left``: the next
    iteration's three operands of ``r(x)`` (``left`` and ``right``, ``x^T``'s right:
    ``kernels/amx.py``), or at the ``last`` iteration the float32 ``x`` itself (the operands
    are not needed after it, nor ``x`` before: ``x`` enters the iteration rounded)."""
    cols, depth = x.shape[1], left.shape[1]
    flat_x, flat_product = x.reshape(x.size), product.reshape(product.size)
    flat_left = left.reshape(left.size)
    for strip in prange(x.shape[0] // amx.BLOCK):
        bits = np.empty((amx.BLOCK, amx.BLOCK), np.uint16)
        flat_bits = bits.reshape(bits.size)
        i = strip * amx.BLOCK
        for j in range(0, cols, amx.BLOCK):
            for r in range(amx.BLOCK):
                row = uint64((i + r) * cols + j)
                packed = uint64((((i + r) // amx.TILE_ROWS * depth + j // amx.BLOCK)
                                 * amx.TILE_ROWS + r % amx.TILE_ROWS) * amx.BLOCK)
                if last:
                    for col in range(uint64(amx.BLOCK)):
                        flat_x[row + col] = (a * amx.decode_one(flat_left[packed + col])
                                             + flat_product[row + col])
                else:
                    target = uint64(r * amx.BLOCK)
                    for col in range(uint64(amx.BLOCK)):
                        flat_bits[target + col] = amx.encode_one(
                            a * amx.decode_one(flat_left[packed + col]) + flat_product[row + col])
            if not last:  # the block's left tiles were read above: overwritten after
                amx.store_block(bits, i, j, left, right, transposed)


PASS_WORK = 4
"""What one element of the iteration's passes (``_start``, ``_combine``, ``_advance``) weighs
against one of a streaming step (the unit of ``threads.PARALLEL_MIN_ELEMENTS``): a rounding,
a decoding and up to three operands' stores each. With it the passes over issue 32's 128 x 512
matrix try threads too (that model's step: medians 5.6-6.4 -> 5.3-5.9 ms back to back, four
interleaved runs each); right after matmuls the timings still choose the calling thread."""
WORK_BYTES_KEPT = 256 << 20
"""The largest work buffer a thread keeps from one step to the next (about 40 MiB for the
iteration over GPT-2 small's largest matrix); a larger one is made per call and let go."""
_WORK_ALIGN = 64
_work = threading.local()


def work_arrays(use: str, *specs) -> list[np.ndarray]:
    """Uninitialized C-contiguous arrays of the ``(shape, dtype)`` pairs ``specs``, each on a
    64-byte boundary, carved from this thread's work buffer for ``use`` (``"update"``,
    ``"iteration"``: one buffer per use, so that one's arrays outlive the other's call): kept
    between calls (up to ``WORK_BYTES_KEPT``), so that a step does not fault in fresh pages
    (18 ms of a GPT-2 block's 190 ms step did) and NumPy's 16-byte aligned allocations do not
    split tile rows across cache lines. Valid until the thread's next call for ``use``; one
    set per thread, so optimizers stepping in several threads do not share them."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    spans = [-(-size // _WORK_ALIGN) * _WORK_ALIGN for size in sizes]
    total = sum(spans) + _WORK_ALIGN
    buffers = _work.__dict__.setdefault("buffers", {})
    buffer = buffers.get(use)
    if buffer is None or buffer.size < total:
        buffer = np.empty(total, np.uint8)
        if total <= WORK_BYTES_KEPT:
            buffers[use] = buffer
    offset = (-buffer.ctypes.data) % _WORK_ALIGN
    arrays = []
    for (shape, dtype), size, span in zip(specs, sizes, spans):
        arrays.append(buffer[offset:offset + size].view(dtype).reshape(shape))
        offset += span
    return arrays


def _newtonschulz_tiles(update: np.ndarray, tall: bool, scale, a, b, c,
                        steps: int) -> np.ndarray:
    """:func:`newtonschulz_bfloat16`'s loop on AMX from ``x = update / scale`` (``update``
    float32, C-contiguous, transposed where ``tall``), returned as a view of the work buffer
    (:func:`work_arrays`): the matrices zero-padded to whole blocks (the padding stays zero:
    every product and combination of zeros is zero), the operands packed (and rounded) by
    the passes that make their matrices; the float32 ``x`` is written by the last pass only
    (each iteration reads ``r(x)``, from its left operand)."""
    m, n = update.shape[::-1] if tall else update.shape
    rows, cols = amx.padded(m), amx.padded(n)
    u16, f32 = np.uint16, np.float32
    (padded, product, x_left, x_right, x_transposed, gram, gram_squared, gram_left,
     gram_right, combined) = work_arrays(
        "iteration", ((rows, cols), f32), ((rows, cols), f32), (amx.left_shape(rows, cols), u16),
        (amx.right_shape(rows, cols), u16), (amx.right_shape(cols, rows), u16),
        ((rows, rows), f32), ((rows, rows), f32), (amx.left_shape(rows, rows), u16),
        (amx.right_shape(rows, rows), u16), (amx.left_shape(rows, rows), u16))
    if steps == 0:
        np.divide(update.T if tall else update, scale, out=padded[:m, :n])
    none = np.empty((0, 0, 0, 0), u16)
    _start(PASS_WORK * padded.size, update, tall, scale, x_left, x_right, x_transposed, none)
    for step in range(steps):
        amx.dot(x_left, x_transposed, gram)
        amx.pack(gram, gram_left, gram_right, none)
        amx.dot(gram_left, gram_right, gram_squared)
        _combine(PASS_WORK * gram.size, gram_left, gram_squared, b, c, combined)
        amx.dot(combined, x_right, product)
        _advance(PASS_WORK * padded.size, padded, product, a, x_left, x_right, x_transposed,
                 step == steps - 1)
    return padded[:m, :n]


def adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    else:  # "match_rms_adamw"
        ratio = 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


@njit(inline="always", error_model="numpy")
def _lerp(start, end, weight, from_start, one_minus_weight):
    """:func:`torch_lerp` of one element, its end chosen by the caller."""
    difference = end - start
    return start + weight * difference if from_start else end - one_minus_weight * difference


@threaded(cache=True, error_model="numpy")
def _momentum(buf, grad, lerps, from_start, nesterov, update):
    """``buf = lerp(buf, grad, lerps[0])`` and, with ``nesterov``, ``update = lerp(grad,
    buf, lerps[2])`` (``lerps[1]``, ``lerps[3]``: one minus each weight; ``from_start``:
    each lerp's end) in one pass, as :func:`torch_lerp`'s NumPy passes round them."""
    for i in prange(buf.shape[0]):
        b, g, u = buf[i], grad[i], update[i]
        for j in range(uint64(buf.shape[1])):
            value = _lerp(b[j], g[j], lerps[0], from_start[0], lerps[1])
            b[j] = value
            if nesterov:
                u[j] = _lerp(g[j], value, lerps[2], from_start[1], lerps[3])


@threaded(cache=True, error_model="numpy")
def _apply(param, ortho, stride, transposed, decay, step):
    """``param = param * decay + step * o``, rounded as NumPy's ``param *= decay; param +=
    step * o``: ``param`` C-contiguous, ``o[i, j]`` at ``ortho[i * stride + j]`` (flat), or
    at ``ortho[j * stride + i]`` where ``transposed`` (a tall matrix's, orthogonalised in its
    wide orientation: read by blocks of ``amx.BLOCK`` squared, which stay in L1)."""
    rows, cols = param.shape
    flat = param.reshape(param.size)
    for strip in prange((rows + amx.BLOCK - 1) // amx.BLOCK):
        i0 = strip * amx.BLOCK
        i1 = min(i0 + amx.BLOCK, rows)
        if not transposed:
            for i in range(i0, i1):
                p, o = uint64(i * cols), uint64(i * stride)
                for j in range(uint64(cols)):
                    flat[p + j] = flat[p + j] * decay + step * ortho[o + j]
            continue
        for j0 in range(0, cols, amx.BLOCK):
            j1 = min(j0 + amx.BLOCK, cols)
            for i in range(i0, i1):
                p = uint64(i * cols)
                for j in range(j0, j1):
                    flat[p + j] = flat[p + j] * decay + step * ortho[uint64(j * stride + i)]


def _apply_update(param: np.ndarray, ortho: np.ndarray, decay, step) -> None:
    """:func:`_apply` of ``ortho``, a param-shaped view whose rows or columns are contiguous
    (a result, or a result's transpose, within a possibly wider work array; any other
    layout is copied first)."""
    if ortho.itemsize not in (ortho.strides[1], ortho.strides[0]) or min(ortho.strides) < 0:
        ortho = np.ascontiguousarray(ortho)
    transposed = ortho.strides[1] != ortho.itemsize
    wide = ortho.T if transposed else ortho
    stride = wide.strides[0] // wide.itemsize
    extent = (wide.shape[0] - 1) * stride + wide.shape[1]  # the elements the rows span
    flat = np.lib.stride_tricks.as_strided(wide, (extent,), (wide.itemsize,), writeable=False)
    _apply(param.size, param, flat, stride, transposed, decay, step)


def muon_update(param, grad, state, settings, columns):
    """One parameter's step (torch's ``_single_tensor_muon``)::

        buf = lerp(buf, g, 1 - momentum)
        u = lerp(g, buf, momentum) if nesterov else buf
        O = NewtonSchulz(u)
        p = p * (1 - lr * weight_decay) - adjusted_lr * O

    the element-wise parts in one pass each (:func:`_momentum`, :func:`_apply`: the same
    roundings as NumPy's expressions, without their temporaries)."""
    if param.size == 0:
        return  # nothing to move (torch divides by zero adjusting lr for a 3 x 0 matrix)
    t = param.dtype.type
    buf = state["momentum_buffer"]
    momentum = settings["momentum"]
    weights = (t(1.0 - momentum), t(momentum))
    lerps = np.array([weights[0], t(1) - weights[0], weights[1], t(1) - weights[1]],
                     param.dtype)
    from_start = np.array([abs(float(w)) < 0.5 for w in weights])
    nesterov = bool(settings["nesterov"])
    update = work_arrays("update", (buf.shape, buf.dtype))[0] if nesterov else buf
    _momentum(buf.size, buf, grad, lerps, from_start, nesterov, update)
    ortho = zeropower_via_newtonschulz(update, settings["ns_coefficients"],
                                       settings["ns_steps"], settings["eps"],
                                       settings["ns_dtype"], scratch=True)
    _apply_update(param, ortho, t(1.0 - settings["lr"] * settings["weight_decay"]),
                  t(-adjusted_lr(settings["lr"], settings["adjust_lr_fn"], param.shape)))


RULE = Rule(name="muon", span=muon_span, prepare=muon_prepare, helpers=(),
            slots=("momentum_buffer",), columns={"momentum_initialized": "uint8"},
            per_parameter=muon_update)
