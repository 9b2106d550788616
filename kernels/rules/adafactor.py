"""Adafactor (torch.optim.Adafactor): second moments factored into row and column means.

A parameter of shape ``(..., R, C)`` keeps ``row_var`` ``(..., R, 1)`` and ``col_var``
``(..., 1, C)`` instead of a full second moment (shaped slots, ``Slot.shape``); a vector or a
0-d parameter keeps ``variance`` of its own shape. The update needs whole-matrix totals (row
and column sums of g², ||p||, ||update||), so it is ``adafactor_update``, run per present
parameter (``Rule.per_parameter``): matrices through the three Numba passes below (parallel
over rows and column blocks; every total summed in float64 in an order that does not depend on
the thread count), vectors and 0-d parameters in one serial Numba call each."""

import math
from typing import NamedTuple

import numba
import numpy as np

from ..elementwise import element_prepare
from ..rule import Rule
from ..threads import threaded
from .muon import torch_lerp

# Rows per unit of parallel work in the pass that sums squares (GPT-2's 768 x 3072 matrices
# give 12 units, its 50257-row embedding 786), and the most float64 column sums the units of
# one matrix may keep.
ROW_BLOCK = 64
COLUMN_PARTS_LIMIT = 1 << 22


class Columns(NamedTuple):
    step: int


adafactor_prepare = element_prepare("adafactor_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (``adafactor_update`` reads it)."""


def adafactor_span(arrays, scalars, columns, flags, k, start, stop, stride):
    pass  # the update is adafactor_update, per parameter


def rows_per_block(n_rows: int, n_cols: int) -> int:
    """Rows per unit of work of :func:`_square_sums`: 64, or more for a huge matrix, so that
    the per-block column sums stay within 4M float64. A function of the shape alone, so the
    order of every sum is too."""
    return max(ROW_BLOCK, -(-n_rows * n_cols // COLUMN_PARTS_LIMIT))


@threaded(cache=True, fastmath={"reassoc"}, error_model="numpy")
def _square_sums(p, g, block):
    """One pass over each ``(R, C)`` matrix of ``p`` and ``g`` (``(L, R, C)``), blocks of
    ``block`` rows in parallel: per row the sums of g² and of p², per block the column sums of
    g², all in float64 (the caller adds blocks up in block order). The sums reassociate (so
    they vectorize), in an order fixed for a given build, machine and shape."""
    n_lead, n_rows, n_cols = g.shape
    n_blocks = (n_rows + block - 1) // block
    g_sums = np.empty((n_lead, n_rows))
    p_sums = np.empty(n_lead * n_rows)
    column_parts = np.empty((n_lead, n_blocks, n_cols))
    for i in numba.prange(n_lead * n_blocks):
        lead, b = i // n_blocks, i % n_blocks
        columns = column_parts[lead, b]
        for c in range(n_cols):
            columns[c] = 0.0
        for r in range(b * block, min(n_rows, (b + 1) * block)):
            g_total = 0.0
            p_total = 0.0
            for c in range(n_cols):
                x = np.float64(g[lead, r, c])
                y = np.float64(p[lead, r, c])
                g_total += x * x
                p_total += y * y
                columns[c] += x * x
            g_sums[lead, r] = g_total
            p_sums[lead * n_rows + r] = p_total
    return g_sums, p_sums, column_parts


@threaded(cache=True, fastmath={"reassoc"}, error_model="numpy")
def _update_square_sums(g, row_var, col_var, row_mean, floor, one, negate):
    """Per row, the sum of u² of ``u = g / sqrt(max(row_var * col_var / row_mean, floor))``
    (float64, rows in parallel; the caller adds them up in row order)."""
    n_lead, n_rows, n_cols = g.shape
    parts = np.empty(n_lead * n_rows)
    for i in numba.prange(n_lead * n_rows):
        lead, r = i // n_rows, i % n_rows
        total = 0.0
        for c in range(n_cols):
            u = _factored(g[lead, r, c], row_var[lead, r], col_var[lead, c], row_mean[lead],
                          floor, one, negate)
            total += np.float64(u) * np.float64(u)
        parts[i] = total
    return parts


@threaded(cache=True, error_model="numpy")
def _apply(p, g, row_var, col_var, row_mean, floor, one, negate, decay, apply_decay, step):
    """``p = p * decay`` (when ``apply_decay``), then ``p = p + step * u`` (u as above)."""
    n_lead, n_rows, n_cols = g.shape
    for i in numba.prange(n_lead * n_rows):
        lead, r = i // n_rows, i % n_rows
        for c in range(n_cols):
            u = _factored(g[lead, r, c], row_var[lead, r], col_var[lead, c], row_mean[lead],
                          floor, one, negate)
            x = p[lead, r, c]
            if apply_decay:
                x = x * decay
            p[lead, r, c] = x + step * u


@numba.njit(cache=True, error_model="numpy")
def _vector_update(p, g, variance, weight, floor, one, negate, decay, apply_decay, eps2, rho,
                   d):
    """The whole step of a vector (or a flattened 0-d) parameter in one call: ||p||, the
    variance's lerp, ||u||, then the update (torch's order, sums in float64)."""
    n = p.size
    p_total = 0.0
    for i in range(n):
        y = np.float64(p[i])
        p_total += y * y
    rms = np.sqrt(p_total) / np.sqrt(n)
    alpha = (rms if rms > eps2 else eps2) * rho  # Python's max, argument order and NaN alike
    u_total = 0.0
    for i in range(n):
        x = -g[i] if negate else g[i]
        v = variance[i]
        target = x * x
        if abs(weight) < 0.5:  # torch's lerp, from the nearer end
            v = v + weight * (target - v)
        else:
            v = target - (one - weight) * (target - v)
        variance[i] = v
        u = one / np.sqrt(_clamp_min(v, floor)) * x
        u_total += np.float64(u) * np.float64(u)
    step = np.empty(1, p.dtype)
    ratio = np.sqrt(u_total) / (np.sqrt(n) * d)
    step[0] = -alpha / (ratio if ratio > 1.0 else 1.0)  # rounded to the dtype
    for i in range(n):
        x = -g[i] if negate else g[i]
        u = one / np.sqrt(_clamp_min(variance[i], floor)) * x
        q = p[i] * decay if apply_decay else p[i]
        p[i] = q + step[0] * u


@numba.njit(inline="always", cache=True, error_model="numpy")
def _clamp_min(value, low):
    """torch's clamp(min=low): NaN stays NaN."""
    return low if value < low else value


@numba.njit(inline="always", cache=True, error_model="numpy")
def _factored(g, row, col, mean, floor, one, negate):
    """torch's order: var = row @ col, var / mean, clamp to floor, rsqrt, times g (``one``
    is 1 in the parameter's dtype, so float32 stays float32)."""
    u = one / np.sqrt(_clamp_min((row * col) / mean, floor))
    return -(u * g) if negate else u * g


def adafactor_update(param, grad, state, settings, columns):
    """One parameter's step (torch 2.13's ``_single_tensor_adafactor``), with ``t`` its own
    step count (already advanced by prepare)::

        g = -grad if maximize else grad
        beta2_t = t ** beta2_decay                   (torch's one_minus_beta2_t)
        rho = min(lr, 1 / sqrt(t))
        alpha = max(eps2, ||p|| / sqrt(numel)) * rho
        p = p * (1 - lr * weight_decay)              when weight_decay != 0
        matrices (..., R, C):
            row_var = lerp(row_var, mean(g², over C), beta2_t)     (..., R, 1)
            col_var = lerp(col_var, mean(g², over R), beta2_t)     (..., 1, C)
            var = row_var @ col_var / max(mean(row_var, over R), eps1)
        vectors and 0-d:
            variance = lerp(variance, g², beta2_t);  var = variance
        u = g / sqrt(max(var, eps1²))
        p = p - alpha / max(1, ||u|| / (sqrt(numel) * d)) * u

    ``eps1`` None means the machine epsilon of the parameter's dtype. A zero-size parameter
    is left alone (torch divides by zero there).
    """
    if param.size == 0:
        return
    dtype = param.dtype.type
    step = float(columns["step"])
    eps1, eps2 = settings["eps"]
    if eps1 is None:
        eps1 = float(np.finfo(param.dtype).eps)
    # Python floats, formed as torch forms them, then cast: not float32 kernel arithmetic
    beta2_t = step ** settings["beta2_decay"]
    rho = min(settings["lr"], 1 / step ** 0.5)
    lr, weight_decay, negate = settings["lr"], settings["weight_decay"], settings["maximize"]
    decay = dtype(1 - lr * weight_decay)
    if param.ndim >= 2:
        rows, cols = param.shape[-2:]
        p3 = param.reshape(-1, rows, cols)
        g3 = grad.reshape(-1, rows, cols)
        row_var = state["row_var"].reshape(-1, rows)
        col_var = state["col_var"].reshape(-1, cols)
        n = param.size
        row_sums, p_parts, column_parts = _square_sums(n, p3, g3, rows_per_block(rows, cols))
        col_sums = column_parts.sum(axis=1)
        # torch: norm (a float32 value), squared, divided by the count, in the param's dtype
        row_var[...] = torch_lerp(row_var, np.square(np.sqrt(row_sums).astype(dtype))
                                  / dtype(cols), beta2_t, param.dtype)
        col_var[...] = torch_lerp(col_var, np.square(np.sqrt(col_sums).astype(dtype))
                                  / dtype(rows), beta2_t, param.dtype)
        row_mean = np.maximum(row_var.mean(axis=1, dtype=dtype), dtype(eps1))
        floor = dtype(eps1 * eps1)
        alpha = max(eps2, math.sqrt(p_parts.sum()) / math.sqrt(param.size)) * rho
        u_norm = math.sqrt(_update_square_sums(n, g3, row_var, col_var, row_mean, floor,
                                               dtype(1), negate).sum())
        denom = max(1.0, u_norm / (math.sqrt(param.size) * settings["d"]))
        _apply(n, p3, g3, row_var, col_var, row_mean, floor, dtype(1), negate, decay,
               weight_decay != 0, dtype(-alpha / denom))
        return
    _vector_update(param.reshape(-1), grad.reshape(-1), state["variance"].reshape(-1),
                   dtype(beta2_t), dtype(eps1 * eps1), dtype(1), negate, decay,
                   weight_decay != 0, eps2, rho, settings["d"])


def row_shape(shape: tuple) -> tuple | None:
    """``row_var``'s shape: ``(..., R, 1)`` for a parameter ``(..., R, C)``."""
    return (*shape[:-1], 1) if len(shape) >= 2 else None


def column_shape(shape: tuple) -> tuple | None:
    """``col_var``'s shape: ``(..., 1, C)`` for a parameter ``(..., R, C)``."""
    return (*shape[:-2], 1, shape[-1]) if len(shape) >= 2 else None


def vector_shape(shape: tuple) -> tuple | None:
    """``variance``'s shape: the parameter's own, for vectors and 0-d parameters."""
    return tuple(shape) if len(shape) < 2 else None


RULE = Rule(name="adafactor", span=adafactor_span, prepare=adafactor_prepare, helpers=(),
            slots=("row_var", "col_var", "variance"), columns={"step": "int64"},
            per_parameter=adafactor_update)
