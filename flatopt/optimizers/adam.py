"""Adam and AdamW (torch.optim.Adam / AdamW semantics); AdamW is Adam with decoupled decay."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from ..kernels.rules import adam as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import (ADAM_MOMENTS, STEP_COUNT, Hyperparameter, Schema, Slot, betas,
                      non_negative, switch)



def adam_hyperparameters(lr: float, beta_examples: tuple, eps_examples: tuple = (1e-8, 1e-6),
                         **more: Hyperparameter) -> dict[str, Hyperparameter]:
    """The hyperparameters of the Adam family, in torch's order: ``lr`` (its default and
    1e-2 as examples), ``betas`` (default (0.9, 0.999)), ``eps`` (default 1e-8),
    ``weight_decay`` (0 or 0.1), then ``more``. The examples are the values random test
    configurations draw."""
    return {"lr": Hyperparameter(lr, non_negative, (lr, 1e-2)),
            "betas": Hyperparameter((0.9, 0.999), betas, beta_examples),
            "eps": Hyperparameter(1e-8, non_negative, eps_examples),
            "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1)), **more}


def adam_state_schema(**fields: Any) -> Schema:
    """A schema whose state is Adam's moments: each parameter's own step count (``step``, the
    marker) and ``exp_avg``/``exp_avg_sq`` (:data:`~flatopt.schema.ADAM_MOMENTS`); ``fields``
    are the rest of the :class:`~flatopt.schema.Schema`'s (name, rule, hyperparameters...)."""
    return Schema(columns={"step": STEP_COUNT}, slots=ADAM_MOMENTS, **fields)


SCHEMA = Schema(
    int8_state=True,
    name="Adam", rule=rule.RULE, torch_name="Adam", hyperparameters=adam_hyperparameters(
        1e-3, ((0.9, 0.999), (0.8, 0.99), (0.5, 0.999), (0.3, 0.99), (0.0, 0.999)),
        amsgrad=switch(), maximize=switch(), caution=switch(since=2)),
    version=2,
    columns={"step": STEP_COUNT},
    slots={"exp_avg": Slot(), "exp_avg_sq": Slot(nonnegative=True),
           "max_exp_avg_sq": Slot(when=lambda s: s["amsgrad"], nonnegative=True)},
)
AdamParamState = SCHEMA.record


def lerp_from_end(settings: Mapping) -> bool:
    """torch's lerp(m, g, w) computes from g when the weight w = 1 - beta1 is not below 0.5."""
    return not abs(1.0 - settings["betas"][0]) < 0.5


def moment_scalars(s: Mapping[str, Any], dtype: np.dtype) -> dict[str, float]:
    """The scalars of Adam's moments (``kernels/rules/moments.py``'s ``MomentScalars``) by
    name, for a group's settings and a buffer's dtype."""
    beta1, beta2 = s["betas"]
    lr, weight_decay = s["lr"], s["weight_decay"]
    weight = float(dtype.type(1.0 - beta1))  # torch's lerp weight, in the tensor's dtype
    return dict(
        lerp_coefficient=weight - 1.0 if lerp_from_end(s) else weight,  # exact: Sterbenz
        beta2=beta2, one_minus_beta2=1.0 - beta2, eps=s["eps"], weight_decay=weight_decay,
        decoupled_decay_factor=1.0 - lr * weight_decay)


@register
class Adam(Optimizer):
    r"""Adam, with L2 weight decay, AMSGrad and maximize; AdamW when decoupled.

    For each parameter with a gradient, with ``t`` that parameter's own step count (a
    parameter that first gets a gradient later has its own bias correction)::

        g = -grad if maximize else grad
        t = t + 1
        p = p * (1 - lr * weight_decay)              AdamW (decoupled), whatever g is
        g = g + weight_decay * p                     Adam (L2 into the gradient)
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                        if amsgrad; then v_max is used for v
        m' = m * (m * g > 0) / max(mean(m * g > 0), 1e-3)   if caution; m' = m otherwise
        p = p - lr / (1 - beta1**t) * m' / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    ``caution`` (timm's, "Cautious Optimizers", arXiv 2411.16085): only the elements whose
    new moment agrees in sign with the gradient move, scaled up by the inverse of their
    share of the parameter (at most 1000x); ``exp_avg`` itself is stored unmasked. torch.optim
    has no such option; it costs a second reading pass over the buffer.

    A missing gradient skips the parameter entirely (no step count, no decay); a zero
    gradient is a real step. Hyperparameters are read from ``param_groups`` at every step.
    """

    schema = SCHEMA
    decoupled_weight_decay: bool = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, amsgrad: bool = False, *,
                 maximize: bool = False, caution: bool = False, **unknown: Any):
        if weight_decay is None:
            weight_decay = self.schema.hyperparameters["weight_decay"].default
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, caution=caution, **unknown)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        return rule.Scalars(**moment_scalars(s, dtype))

    def prepare_scalars(self, s: Mapping[str, Any]) -> rule.PrepareScalars:
        return rule.PrepareScalars(lr=s["lr"], beta1=s["betas"][0], beta2=s["betas"][1])

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(has_weight_decay=s["weight_decay"] != 0,
                          decoupled=self.decoupled_weight_decay, amsgrad=s["amsgrad"],
                          maximize=s["maximize"], lerp_from_end=lerp_from_end(s),
                          caution=s["caution"])


@register
class AdamW(Adam):
    """AdamW: :class:`Adam` with decoupled weight decay (``p *= 1 - lr * weight_decay`` before
    the moments) and a default ``weight_decay`` of 1e-2. Same rule body, one flag."""

    schema = dataclasses.replace(SCHEMA, name="AdamW", torch_name="AdamW", hyperparameters={
        **SCHEMA.hyperparameters,
        "weight_decay": Hyperparameter(1e-2, non_negative, (0.0, 0.01, 0.1))})
    decoupled_weight_decay = True
