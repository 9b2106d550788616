"""AdEMAMix (bitsandbytes' ``_ReferenceAdEMAMix``): Adam with a slow gradient EMA mixed in."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np

from ..kernels.rules import ademamix as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import (MAX_STEP, Column, Hyperparameter, Invalid, Schema, Slot, beta_tuple,
                      non_negative, step_count)



def three_betas(value: Any) -> tuple[float, float, float]:
    """(beta1, beta2, beta3), each in [0, 1)."""
    return beta_tuple(value, 3)


def optional_period(value: Any) -> int | None:
    """None (no schedule), or a number of steps >= 1."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not 1 <= value <= MAX_STEP:
        raise Invalid(f"must be None or a whole number of steps >= 1, got {value!r}")
    return int(value)


def _logs_defined(values: Mapping[str, Any]) -> list[str]:
    beta1, _, beta3 = values["betas"]
    if values["t_beta3"] is not None and (beta1 == 0 or beta3 == 0):
        return [f"t_beta3={values['t_beta3']} schedules beta3 through log(beta1) and "
                f"log(beta3), which need beta1 > 0 and beta3 > 0 (betas={values['betas']})"]
    return []


SCHEMA = Schema(
    int8_state=True,
    name="AdEMAMix", rule=rule.RULE, torch_name=None, hyperparameters={
        "lr": Hyperparameter(1e-3, non_negative, (1e-3, 1e-2)),
        "betas": Hyperparameter((0.9, 0.999, 0.9999), three_betas,
                                ((0.9, 0.999, 0.9999), (0.8, 0.99, 0.999), (0.5, 0.9, 0.99))),
        "alpha": Hyperparameter(5.0, non_negative, (5.0, 2.0, 0.0)),
        "eps": Hyperparameter(1e-8, non_negative, (1e-8, 1e-6)),
        "weight_decay": Hyperparameter(1e-2, non_negative, (1e-2, 0.0, 0.1)),
        "t_beta3": Hyperparameter(None, optional_period, (None, 8)),
        "t_alpha": Hyperparameter(None, optional_period, (None, 5)),
        "step": Hyperparameter(0, step_count, (0,), state=True),
    },
    cross_check=_logs_defined,
    # a state-dict entry holds the three moments; its presence says the parameter has state
    columns={"initialized": Column("uint8", 1, marker=True, in_state_dict=False)},
    slots={"m1": Slot(), "m2": Slot(), "nu": Slot(nonnegative=True)},
)
AdEMAMixParamState = SCHEMA.record


def scheduled(s: Mapping[str, Any], step: int) -> tuple[float, float]:
    """(alpha, beta3) at group step ``step``: the linear warm-up of alpha over ``t_alpha``
    steps and the beta3 schedule over ``t_beta3`` steps, in the reference's float64
    arithmetic."""
    beta1, _, beta3 = s["betas"]
    alpha = s["alpha"]
    if s["t_alpha"] is not None:
        alpha = min(step * alpha / s["t_alpha"], alpha)
    if s["t_beta3"] is not None:
        ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
        step_scale = step / s["t_beta3"]
        beta3 = min(math.exp((ln_beta1 * ln_beta3)
                             / (((1 - step_scale) * ln_beta3) + (step_scale * ln_beta1))),
                    beta3)
    return alpha, beta3


@register
class AdEMAMix(Optimizer):
    r"""AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"),
    with bitsandbytes' ``_ReferenceAdEMAMix`` signature, defaults and arithmetic.

    Every step advances each group's step count ``t`` (``param_groups[g]["step"]``, kept in
    the group as the reference keeps it: a parameter whose gradient was missing still sees
    the group's count); then for each parameter with a gradient::

        alpha_t = min(t * alpha / t_alpha, alpha)                          if t_alpha
        beta3_t = min(exp(ln(b1) ln(b3) / ((1 - t/t_beta3) ln(b3) + (t/t_beta3) ln(b1))), b3)
                                                                           if t_beta3
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta3_t * m2 + (1 - beta3_t) * g
        nu = beta2 * nu + (1 - beta2) * g * g
        u  = (m1 / (1 - beta1**t) + alpha_t * m2) / (sqrt(nu) / sqrt(1 - beta2**t) + eps)
        p  = p - lr * (u + weight_decay * p)

    Where the reference differs: it rebinds ``alpha`` and ``beta3`` inside its parameter
    loop, so with ``t_alpha``/``t_beta3`` set the second parameter of a group gets the
    schedule applied to the first one's scheduled value, and so on (before ``t`` reaches
    ``t_alpha``: alpha times ``(t/t_alpha)**j`` for the j-th parameter). Here every parameter
    gets the schedule once, as the paper and bitsandbytes' own AdEMAMix kernels do. State:
    ``m1``, ``m2`` (the reference's stacked ``m1_m2``) and ``nu``.
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1e-3,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999), alpha: float = 5.0,
                 eps: float = 1e-8, weight_decay: float = 1e-2, t_beta3: int | None = None,
                 t_alpha: int | None = None, **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, alpha=alpha, eps=eps,
                         weight_decay=weight_decay, t_beta3=t_beta3, t_alpha=t_alpha,
                         **unknown)

    def before_step(self, settings):
        return [{"step": s["step"] + 1} for s in settings]

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        beta1, beta2, _ = s["betas"]
        t = s["step"]
        alpha, beta3 = scheduled(s, t)
        return rule.Scalars(
            beta1=beta1, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
            beta3=beta3, one_minus_beta3=1 - beta3, bias_correction1=1 - beta1 ** t,
            bias_correction2_sqrt=(1 - beta2 ** t) ** 0.5, eps=s["eps"], alpha=alpha,
            weight_decay=s["weight_decay"], neg_lr=-s["lr"])
