"""ADOPT (timm's ``Adopt``): Adam's moments with the gradient normalised by the previous
second moment; no torch.optim class."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..kernels.rules import adopt as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import Hyperparameter, Invalid, betas, flag, non_negative, switch
from .adam import adam_state_schema, lerp_from_end



def optional_non_negative(value: Any) -> float | None:
    """None (no clipping), or a finite number >= 0."""
    return None if value is None else non_negative(value)


def not_yet(value: Any) -> bool:
    """False; True is refused by name until flatopt has it."""
    if flag(value):
        raise Invalid("is not supported yet (leave it False)")
    return False


SCHEMA = adam_state_schema(
    name="ADOPT", rule=rule.RULE, torch_name=None, hyperparameters={
        "lr": Hyperparameter(1e-3, non_negative, (1e-3, 1e-2)),
        "betas": Hyperparameter((0.9, 0.9999), betas,
                                ((0.9, 0.9999), (0.9, 0.99), (0.3, 0.999), (0.0, 0.9))),
        "eps": Hyperparameter(1e-6, non_negative, (1e-6, 1e-3)),
        "clip_exp": Hyperparameter(0.333, optional_non_negative, (0.333, None, 0.25)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)),
        "decoupled": switch(),
        "corrected_weight_decay": Hyperparameter(False, not_yet, (False,)),
        "caution": switch(),
        "maximize": switch(),
    },
)
ADOPTParamState = SCHEMA.record


@register
class ADOPT(Optimizer):
    r"""ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any β2 with the
    Optimal Rate"), with timm's ``Adopt`` signature, defaults and order of operations.

    For each parameter with a gradient, ``t`` its own step count::

        g = -grad if maximize else grad
        g = g + weight_decay * p                 if weight_decay and not decoupled
        t == 1:  v = g * g                       and nothing else: the first step seeds v
        t > 1:   p = p - lr * weight_decay * p   if weight_decay and decoupled
                 n = clamp(g / max(sqrt(v), eps), -(t-1)**clip_exp, (t-1)**clip_exp)
                 m = lerp(m, n, 1 - beta1)
                 m' = m * (m * g > 0) / max(mean(m * g > 0), 1e-3)   if caution
                 p = p - lr * m'                 (m' = m without caution)
                 v = beta2 * v + (1 - beta2) * g * g

    ``clip_exp=None`` turns the clamp off. ``caution`` ("Cautious Optimizers", arXiv
    2411.16085): only the elements whose new moment agrees in sign with the gradient move,
    scaled by the inverse of their share of the parameter (at most 1000); ``exp_avg`` is
    stored unmasked; a second reading pass over the buffer. timm's
    ``corrected_weight_decay`` is accepted as False and refused as True (not built yet).
    State: ``step``, ``exp_avg`` (m) and ``exp_avg_sq`` (v). The NumPy reference in
    ``tests/reference.py`` is the oracle.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.9999),
                 eps: float = 1e-6, clip_exp: float | None = 0.333, weight_decay: float = 0.0,
                 decoupled: bool = False, corrected_weight_decay: bool = False, *,
                 caution: bool = False, maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, clip_exp=clip_exp,
                         weight_decay=weight_decay, decoupled=decoupled,
                         corrected_weight_decay=corrected_weight_decay, caution=caution,
                         maximize=maximize, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        beta1, beta2 = s["betas"]
        weight = float(dtype.type(1.0 - beta1))  # torch's lerp weight, in the tensor's dtype
        return rule.Scalars(
            neg_lr=-s["lr"], lerp_coefficient=weight - 1.0 if lerp_from_end(s) else weight,
            beta2=beta2, one_minus_beta2=1.0 - beta2, eps=s["eps"],
            weight_decay=s["weight_decay"], neg_lr_weight_decay=-s["lr"] * s["weight_decay"])

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(clip_exp=0.0 if s["clip_exp"] is None else s["clip_exp"])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0, decoupled=s["decoupled"],
                          clip=s["clip_exp"] is not None, maximize=s["maximize"],
                          lerp_from_end=lerp_from_end(s), caution=s["caution"])
