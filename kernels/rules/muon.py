"""Muon (torch.optim.Muon): momentum, then Newton-Schulz orthogonalisation of each 2-D update.

The orthogonalisation needs whole matrices, so this rule's update is ``muon_update``, a NumPy
function run per present parameter (``Rule.per_parameter``); its kernels only mark which
parameters have a momentum buffer."""

import math
from typing import NamedTuple

import numpy as np

from ..layouts import positions
from ..rule import Rule


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


def zeropower_via_newtonschulz(update: np.ndarray, coefficients, steps: int,
                               eps: float) -> np.ndarray:
    """torch's ``_zeropower_via_newtonschulz`` in the update's own dtype (torch: bfloat16)."""
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


def adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    else:  # "match_rms_adamw"
        ratio = 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


def muon_update(param, grad, state, settings, columns):
    """One parameter's step (torch's ``_single_tensor_muon``)::

        buf = lerp(buf, g, 1 - momentum)
        u = lerp(g, buf, momentum) if nesterov else buf
        O = NewtonSchulz(u)
        p = p * (1 - lr * weight_decay) - adjusted_lr * O
    """
    if param.size == 0:
        return  # nothing to move (torch divides by zero adjusting lr for a 3 x 0 matrix)
    dtype = param.dtype
    buf = state["momentum_buffer"]
    momentum = settings["momentum"]
    buf[...] = torch_lerp(buf, grad, 1.0 - momentum, dtype)
    update = torch_lerp(grad, buf, momentum, dtype) if settings["nesterov"] else buf
    ortho = zeropower_via_newtonschulz(update, settings["ns_coefficients"],
                                       settings["ns_steps"], settings["eps"])
    param *= dtype.type(1.0 - settings["lr"] * settings["weight_decay"])
    param += dtype.type(-adjusted_lr(settings["lr"], settings["adjust_lr_fn"], param.shape)) * ortho


RULE = Rule(name="muon", span=muon_span, prepare=muon_prepare, helpers=(),
            slots=("momentum_buffer",), columns={"momentum_initialized": "uint8"},
            per_parameter=muon_update)
