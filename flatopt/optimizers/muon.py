"""Muon (torch.optim.Muon): orthogonalised momentum for 2-D parameters."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..kernels.rules import muon as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import Column, Hyperparameter, Invalid, Schema, Slot, non_negative, switch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)



def _coefficients(value: Any) -> tuple[float, float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) and np.isfinite(x)
            for x in value):
        raise Invalid(f"must be three finite numbers (a, b, c), got {value!r}")
    return tuple(float(x) for x in value)


def _ns_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value < 100:
        raise Invalid(f"must be an integer in [0, 100), got {value!r}")
    return int(value)


def _adjust_lr_fn(value: Any) -> str | None:
    if value not in (None, "original", "match_rms_adamw"):
        raise Invalid(f"must be None, 'original' or 'match_rms_adamw', got {value!r}")
    return value


def _ns_dtype(value: Any) -> str | None:
    if value not in (None, "bfloat16"):
        raise Invalid(f"must be None (the parameter's dtype) or 'bfloat16', got {value!r}")
    return value


def _only_matrices(shape: tuple) -> str | None:
    if len(shape) != 2:
        return (f"has shape {shape}: Muon optimizes 2-D parameters only (as torch.optim.Muon); "
                "give biases, norms and embeddings to another optimizer, e.g. AdamW")
    return None


SCHEMA = Schema(
    name="Muon", rule=rule.RULE, hyperparameters={
        "lr": Hyperparameter(1e-3, non_negative, (1e-3, 2e-2)),
        "weight_decay": Hyperparameter(0.1, non_negative, (0.0, 0.1)),
        "momentum": Hyperparameter(0.95, non_negative, (0.0, 0.9, 0.95)),
        "nesterov": switch(True),
        "ns_coefficients": Hyperparameter(DEFAULT_COEFFICIENTS, _coefficients,
                                          (DEFAULT_COEFFICIENTS, (2.0, -1.5, 0.5))),
        "eps": Hyperparameter(1e-7, non_negative, (1e-7,)),
        "ns_steps": Hyperparameter(5, _ns_steps, (5, 3, 0)),
        "adjust_lr_fn": Hyperparameter(None, _adjust_lr_fn,
                                       (None, "original", "match_rms_adamw")),
        # not drawn by the generic tests (their NumPy reference keeps the parameter's
        # dtype): tests/test_muon_bfloat16.py covers "bfloat16"
        "ns_dtype": Hyperparameter(None, _ns_dtype, (None,), since=2),
    },
    version=2,
    columns={"momentum_initialized": Column("uint8", 1, marker=True, in_state_dict=False)},
    slots={"momentum_buffer": Slot()},
    param_problem=_only_matrices,
)
MuonParamState = SCHEMA.record


@register
class Muon(Optimizer):
    r"""Muon for 2-D parameters (torch.optim.Muon). For each parameter with a gradient::

        buf = lerp(buf, g, 1 - momentum)              (starts at zero)
        u = lerp(g, buf, momentum) if nesterov else buf
        O = NewtonSchulz_{a,b,c}^{ns_steps}(u / max(||u||, eps))   (transposed when tall)
        p = p * (1 - lr * weight_decay) - lr * adjust(shape) * O

    with ``adjust`` ``sqrt(max(1, rows / cols))`` ("original", the default) or
    ``0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw"). The Newton-Schulz iteration runs
    one parameter at a time, by default in the parameter's dtype with NumPy's matrix products
    (torch runs it in bfloat16: results agree to bfloat16's precision). ``ns_dtype="bfloat16"``
    rounds the products' operands to bfloat16 and sums them in float32, the rest in float32:
    torch's precision, and on a CPU with AMX (Intel Xeon from Sapphire Rapids on) about twice
    the default's speed (``kernels/amx.py``; elsewhere NumPy's float32 products of the rounded
    operands, slower than the default). Pair it with AdamW (two optimizers) for biases, norms
    and embeddings; non-2-D parameters are refused.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 ns_dtype: str | None = None, **unknown: Any):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                         nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps,
                         ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
                         **unknown)
