"""Prodigy (``prodigyopt.Prodigy``): Adam with a learning rate estimated as it goes."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np

from ..kernels.rules import prodigy as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import (MAX_STEP, Column, Hyperparameter, Invalid, Schema, Slot, betas, flag,
                      non_negative, real, switch)



def positive(value: Any) -> float:
    """A finite number > 0."""
    number = real(value)
    if not 0.0 < number < math.inf:
        raise Invalid(f"must be a finite number > 0, got {value!r}")
    return number


def numerator(value: Any) -> float:
    """A float; NaN and infinities too: a NaN gradient leaves ``d_numerator`` NaN in
    prodigyopt (and ``d`` as it was), and the steps go on, as torch's do."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Invalid(f"must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise Invalid(f"is too large for a float64: {value!r}") from None


def rate(value: Any) -> float:
    """A number > 0; infinity (the default) leaves d's growth unbounded."""
    number = real(value)
    if not number > 0.0:
        raise Invalid(f"must be > 0 (inf: unbounded), got {value!r}")
    return number


def optional_beta(value: Any) -> float | None:
    """None (sqrt(beta2)), or a number in [0, 1)."""
    if value is None:
        return None
    number = real(value)
    if not 0.0 <= number < 1.0:
        raise Invalid(f"must be None (sqrt(beta2)) or in [0, 1), got {value!r}")
    return number


def count(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not 0 <= value <= MAX_STEP:
        raise Invalid(f"must be a whole number in [0, {MAX_STEP}], got {value!r}")
    return int(value)


def only_one(value: Any) -> int:
    """slice_p: 1 (every element). Larger values estimate d from every p-th element, with
    s and p0 of their own (smaller) shapes; not built."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise Invalid(f"must be a whole number, got {value!r}")
    if value != 1:
        raise Invalid(f"={value} is not supported yet: flatopt estimates d from every "
                      "element (slice_p=1)")
    return 1


def not_fsdp(value: Any) -> bool:
    if flag(value):
        raise Invalid("=True is not supported: flatopt shards with comm= (ZeRO-1), where the "
                      "d estimate is already made over every rank's parameters; leave it False")
    return False


SCHEMA = Schema(
    name="Prodigy", rule=rule.RULE, torch_name=None, hyperparameters={
        "lr": Hyperparameter(1.0, non_negative, (1.0, 0.5, 0.0)),
        "betas": Hyperparameter((0.9, 0.999), betas, ((0.9, 0.999), (0.0, 0.99), (0.5, 0.9))),
        "beta3": Hyperparameter(None, optional_beta, (None, 0.9)),
        "eps": Hyperparameter(1e-8, positive, (1e-8, 1e-6)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.01, 0.1)),
        "decouple": switch(True),
        "use_bias_correction": switch(),
        "safeguard_warmup": switch(),
        "d0": Hyperparameter(1e-6, positive, (1e-6, 1e-3)),
        "d_coef": Hyperparameter(1.0, positive, (1.0, 0.5, 2.0)),
        "growth_rate": Hyperparameter(math.inf, rate, (math.inf, 1.02)),
        "fsdp_in_use": Hyperparameter(False, not_fsdp, (False,)),
        "slice_p": Hyperparameter(1, only_one, (1,)),
        # the d estimate: group state, the same in every group (read from group 0)
        "d": Hyperparameter(1e-6, positive, (1e-6,), state=True),
        "d_max": Hyperparameter(1e-6, positive, (1e-6,), state=True),
        "d_numerator": Hyperparameter(0.0, numerator, (0.0,), state=True),
        "k": Hyperparameter(0, count, (0,), state=True),
    },
    columns={"step": Column("int64", MAX_STEP),
             "initialized": Column("uint8", 1, marker=True, in_state_dict=False)},
    slots={"exp_avg": Slot(), "exp_avg_sq": Slot(nonnegative=True), "s": Slot(),
           "p0": Slot()},
)
ProdigyParamState = SCHEMA.record


@register
class Prodigy(Optimizer):
    r"""Prodigy (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive
    Parameter-Free Learner"), with ``prodigyopt.Prodigy``'s signature, defaults and
    arithmetic. Leave ``lr`` at 1: d is the learning rate.

    ``d``, ``d_max``, ``d_numerator`` (and ``k``, the group's step count) are group values,
    read from group 0 and written to every group, as the reference does; so are ``betas``,
    ``beta3`` (None: ``sqrt(beta2)``), ``use_bias_correction``, ``decouple``, ``d_coef`` and
    ``growth_rate``. Per step, with ``lr = max`` of the groups' lr and ``k`` group 0's::

        bc  = sqrt(1 - beta2**(k+1)) / (1 - beta1**(k+1))   if use_bias_correction, else 1
        dlr = d * lr * bc
        first pass, each parameter with a gradient, in groups with lr > 0:
            g = g + weight_decay * p                 if weight_decay and not decouple
            numerator += (d / d0) * dlr * <g, p0 - p>        (p0: p when its state began)
            m = beta1 * m + d * (1 - beta1) * g      (m only if beta1 > 0)
            v = beta2 * v + d * d * (1 - beta2) * g * g
            s = beta3 * s + (d / d0) * (d if safeguard_warmup else dlr) * g
            denominator += sum |s|
        if denominator == 0: stop here (no parameter moves, no count advances)
        d_numerator = beta3 * d_numerator + numerator
        d_hat = d_coef * d_numerator / denominator
        d = max(d, d_hat) if d == d0 (of the last group);  d_max = max(d_max, d_hat)
        d = min(d_max, d * growth_rate)
        second pass, each parameter with a gradient (every group), with the new d:
            p = p - weight_decay * dlr * p            if weight_decay and decouple
            p = p - dlr * m / (sqrt(v) + d * eps)     (beta1 = 0: - dlr * d * g / (...))
        every group's k += 1

    The sums are one fused pass per buffer, added per parameter in a fixed order, so d has
    the same bits at any thread count and, with ``comm=``, at any world size.

    Where the reference is silent or refuses: it raises when a group's lr is neither the
    largest nor 0; here such a group's ``dlr`` uses its own lr (``d * lr_g * bc``) in its
    moments, sums and step, which is the reference wherever the reference runs (a group with
    lr 0 still takes the second pass with the largest lr's ``dlr``, as there). The
    reference adds the coupled decay into ``p.grad`` in place; flatopt leaves the gradient
    buffer as it was. Its constructor refuses lr=0, which here is a group whose parameters
    do not move (as a group of its own with lr 0 in the reference). ``slice_p`` other than 1 and ``fsdp_in_use=True`` are refused by name.
    State: ``step`` (advanced in the second pass), ``exp_avg`` (kept, at zero, when beta1 is
    0), ``exp_avg_sq``, ``s`` and ``p0`` (the full parameter even when it is all zeros).
    """

    schema = SCHEMA

    def __init__(self, params: Any, lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                 beta3: float | None = None, eps: float = 1e-8, weight_decay: float = 0,
                 decouple: bool = True, use_bias_correction: bool = False,
                 safeguard_warmup: bool = False, d0: float = 1e-6, d_coef: float = 1.0,
                 growth_rate: float = float("inf"), fsdp_in_use: bool = False,
                 slice_p: int = 1, **unknown: Any):
        values = dict(lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay,
                      decouple=decouple, use_bias_correction=use_bias_correction,
                      safeguard_warmup=safeguard_warmup, d0=d0, d_coef=d_coef,
                      growth_rate=growth_rate, fsdp_in_use=fsdp_in_use, slice_p=slice_p)
        # the reference's defaults: d and d_max start at the constructor's d0 in every group
        if isinstance(d0, numbers.Real) and not isinstance(d0, bool):
            values.update(d=d0, d_max=d0)
        super().__init__(params, **{**values, **unknown})

    # the combination over every group, twice per step (see Optimizer.combine)
    def combine(self, settings, totals):
        first = settings[0]
        beta1, beta2 = first["betas"]
        beta3 = first["beta3"] if first["beta3"] is not None else math.sqrt(beta2)
        k, d, d_max = first["k"], first["d"], first["d_max"]
        lr = max(s["lr"] for s in settings)
        if first["use_bias_correction"]:
            bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        else:
            bias_correction = 1
        dlr = d * lr * bias_correction
        if totals is None:
            return [self._scalars(s, first, beta3, d, d, dlr, bias_correction, False)
                    for s in settings], None
        numerator = 0.0
        denominator = 0.0
        for s, (dot, s_abs) in zip(settings, totals):
            if s["lr"] > 0:
                numerator += (d / s["d0"]) * (d * s["lr"] * bias_correction) * dot
                denominator += s_abs
        if denominator == 0:  # nothing to estimate from: the reference returns here
            return [self._scalars(s, first, beta3, d, d, dlr, bias_correction, False)
                    for s in settings], None
        d_numerator = first["d_numerator"] * beta3 + numerator
        d_hat = first["d_coef"] * d_numerator / denominator
        new_d = max(d, d_hat) if d == settings[-1]["d0"] else d
        d_max = max(d_max, d_hat)
        new_d = min(d_max, new_d * first["growth_rate"])
        for buf in self.buffers:  # the second pass's own count, for every stepped parameter
            buf.columns["step"][buf.present != 0] += 1
        new_d, d_max, d_numerator = float(new_d), float(d_max), float(d_numerator)
        changes = [{"d": new_d, "d_max": d_max, "d_numerator": d_numerator, "k": s["k"] + 1}
                   for s in settings]
        return [self._scalars(s, first, beta3, d, new_d, dlr, bias_correction, True)
                for s in settings], changes

    @staticmethod
    def _scalars(s: Mapping[str, Any], first: Mapping[str, Any], beta3: float, d: float,
                 new_d: float, dlr: float, bias_correction: float, move: bool) -> rule.Scalars:
        """One group's scalars: ``d`` the estimate the step started with, ``new_d`` the one
        it ends with, ``dlr`` the largest lr's (see the class docstring for a group's own)."""
        beta1, beta2 = first["betas"]
        active = s["lr"] > 0
        if active:
            dlr = d * s["lr"] * bias_correction
        decay = s["weight_decay"]
        decouple = first["decouple"]
        return rule.Scalars(
            beta1=beta1, beta2=beta2, beta3=beta3, m_coefficient=d * (1 - beta1),
            v_coefficient=d * d * (1 - beta2),
            s_coefficient=(d / s["d0"]) * (d if s["safeguard_warmup"] else dlr),
            weight_decay=decay, neg_decay_dlr=-decay * dlr, neg_dlr=-dlr,
            d_eps=new_d * s["eps"], neg_dlr_d=-dlr * new_d, use_m=float(beta1 > 0),
            coupled=float(decay != 0 and not decouple),
            decoupled=float(decay != 0 and decouple), active=float(active), move=float(move))
