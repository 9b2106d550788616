"""Schedule-Free SGD, AdamW and RAdam (Defazio et al. 2024, "The Road Less Scheduled"), with
the signatures, defaults and order of operations of facebookresearch's ``schedulefree``
package (``SGDScheduleFree``, ``AdamWScheduleFree``, ``RAdamScheduleFree``, their
single-tensor path); no torch.optim class.

The parameters hold ``y`` while training; ``opt.eval()`` moves them to the average ``x`` (to
evaluate or save a model) and ``opt.train()`` back. The group counters of the reference
(``k``, ``weight_sum``, ``lr_max``, ``scheduled_lr``, ``train_mode``) are group values, as in
its ``param_groups``: hyperparameters marked ``state`` (advanced by each step, restored by
every load, never compared as settings).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import numpy as np

from ..errors import HyperparameterError, ModeError, raise_problems
from ..kernels.rules import schedulefree as rule
from ..optimizer import Optimizer
from ..registry import register
from ..schema import (MAX_STEP, Column, Hyperparameter, Invalid, Schema, Slot, betas,
                      describe_group, flag, non_negative, real, switch)


class ScheduleFreeAdamWParamState(NamedTuple):
    """One parameter's state (views into the flat state buffers): ``z``, the SGD iterate,
    and ``exp_avg_sq``, Adam's second moment."""

    z: np.ndarray
    exp_avg_sq: np.ndarray


class ScheduleFreeRAdamParamState(NamedTuple):
    """One parameter's state: ``z`` and ``exp_avg_sq``, as ScheduleFreeAdamW's."""

    z: np.ndarray
    exp_avg_sq: np.ndarray


class ScheduleFreeSGDParamState(NamedTuple):
    """One parameter's state: ``z``, the SGD iterate."""

    z: np.ndarray


# ----------------------------------------------------------------------------- checks
def count(value: Any) -> int:
    """An integer in [0, 2**53] (a step count, warm-up steps)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value <= MAX_STEP:
        raise Invalid(f"must be an integer in [0, {MAX_STEP}], got {value!r}")
    return int(value)


def finite(value: Any) -> float:
    """A finite real number."""
    number = real(value)
    if math.isinf(number):
        raise Invalid(f"must be finite, got {value!r}")
    return number


def lr_max(value: Any) -> float:
    """-1 (no step yet) or the largest lr so far (>= 0)."""
    number = finite(value)
    if number < -1.0:
        raise Invalid(f"must be -1 (no step yet) or a number >= 0, got {value!r}")
    return number


def averaging_betas(value: Any) -> tuple[float, float]:
    """betas whose beta1 is in (0, 1): eval() recovers x from y and z dividing by beta1."""
    pair = betas(value)
    if pair[0] == 0.0:
        raise Invalid("beta1 must be in (0, 1) for schedule-free (eval() divides by it), "
                      f"got {value!r}")
    return pair


def momentum(value: Any) -> float:
    """A number strictly between 0 and 1 (the reference refuses the ends too)."""
    number = real(value)
    if not 0.0 < number < 1.0:
        raise Invalid(f"must be between 0 and 1 exclusive, got {value!r}")
    return number


_WARMUP = {"warmup_steps": Hyperparameter(0, count, (0, 3))}
_AVERAGING = {
    "r": Hyperparameter(0.0, finite, (0.0, 1.0)),
    "weight_lr_power": Hyperparameter(2.0, non_negative, (2.0, 0.0, 1.0)),
}
_COUNTERS = {
    "k": Hyperparameter(0, count, (0,), state=True),
    "train_mode": Hyperparameter(True, flag, (True,), state=True),
    "weight_sum": Hyperparameter(0.0, non_negative, (0.0,), state=True),
    "lr_max": Hyperparameter(-1.0, lr_max, (-1.0,), state=True),
    "scheduled_lr": Hyperparameter(0.0, non_negative, (0.0,), state=True),
}
"""The reference's group counters. ``train_mode`` starts True, where the reference starts in
eval mode: with no state yet both modes hold the same point, so this only spares the first
``opt.train()`` (which stays a no-op); generic training code (EMA, checkpoints, the
benchmark) can step a new optimizer."""

_MARKER = {"initialized": Column("uint8", 1, marker=True, in_state_dict=False)}
"""A state-dict entry holds z (and v); its presence says the parameter has state."""

_ADAM = {
    "lr": Hyperparameter(0.0025, non_negative, (0.0025, 0.01)),
    "betas": Hyperparameter((0.9, 0.999), averaging_betas,
                            ((0.9, 0.999), (0.95, 0.99), (0.5, 0.9))),
    "eps": Hyperparameter(1e-8, non_negative, (1e-8, 1e-3)),
    "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.05)),
}


class _Schedule(NamedTuple):
    """A group's numbers for one step, formed in Python double as the reference does."""

    lr: float
    """The step's lr: warm-up (AdamW, SGD) or rectification (RAdam) applied."""
    lr_max: float
    weight_sum: float
    ckp1: float
    """The averaging weight: y moves to lerp(y, z, ckp1)."""
    normalize: bool
    bias_correction2: float


def _warmed_up(s: Mapping[str, Any]) -> float:
    """The lr of the group's step ``k + 1`` under the linear warm-up."""
    k, warmup_steps = s["k"], s["warmup_steps"]
    sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
    return s["lr"] * sched


class _ScheduleFree(Optimizer):
    """What the three share: the averaging weights, the kernel arguments, the counters, and
    ``train()`` / ``eval()``."""

    def _beta1(self, s: Mapping[str, Any]) -> float:
        return s["betas"][0]

    def _lr(self, s: Mapping[str, Any]) -> tuple[float, bool, float]:
        """(this step's lr, whether the gradient is normalised, bias_correction2)."""
        return _warmed_up(s), True, 1 - s["betas"][1] ** (s["k"] + 1)

    def schedule(self, s: Mapping[str, Any]) -> _Schedule:
        """The group's step numbers from its settings and counters (before the step)."""
        lr, normalize, bias_correction2 = self._lr(s)
        lr_max = max(lr, s["lr_max"])
        weight = ((s["k"] + 1) ** s["r"]) * (lr_max ** s["weight_lr_power"])
        weight_sum = s["weight_sum"] + weight
        try:
            ckp1 = weight / weight_sum
        except ZeroDivisionError:  # every weight so far 0 (lr 0, or RAdam's silent phase)
            ckp1 = 0
        return _Schedule(lr, lr_max, weight_sum, ckp1, normalize, bias_correction2)

    def kernel_scalars(self, s: Mapping[str, Any], dtype: np.dtype) -> rule.Scalars:
        step = self.schedule(s)
        ckp1 = float(dtype.type(step.ckp1))  # torch's lerp decides on the rounded weight
        from_end = not abs(ckp1) < 0.5
        beta2 = s["betas"][1] if "betas" in s else 0.0
        return rule.Scalars(
            lerp_coefficient=ckp1 - 1.0 if from_end else ckp1, lerp_from_end=float(from_end),
            y_lr=step.lr * (self._beta1(s) * (1 - step.ckp1) - 1), neg_lr=-step.lr,
            weight_decay=s["weight_decay"], beta2=beta2, one_minus_beta2=1 - beta2,
            bias_correction2=step.bias_correction2, eps=s.get("eps", 0.0))

    def kernel_flags(self, s: Mapping[str, Any]) -> rule.Flags:
        return rule.Flags(adaptive="betas" in s, normalize=self.schedule(s).normalize,
                          has_weight_decay=s["weight_decay"] != 0)

    # ------------------------------------------------------------------ counters
    def check_step(self, settings: list[dict[str, Any]]) -> None:
        """Every group in train mode, and its numbers for this step computable (a huge ``r``
        overflows ``(k + 1) ** r``): checked before anything changes, where the reference
        would fail part way through its groups."""
        raise_problems([
            f"{describe_group(number, s)} is in eval mode (its parameters hold the average "
            "x); call opt.train() before stepping, and opt.eval() before evaluating or saving"
            for number, s in enumerate(settings) if not s["train_mode"]], ModeError)
        problems = []
        for number, s in enumerate(settings):
            try:
                self.schedule(s)
            except (OverflowError, ZeroDivisionError) as exc:
                problems.append(f"{describe_group(number, s)}: the averaging weight "
                                f"(k + 1)**r * lr_max**weight_lr_power at k={s['k']} cannot be "
                                f"computed ({exc}); lower r (r={s['r']!r})")
        raise_problems(problems, HyperparameterError)

    def after_step(self, settings: list[dict[str, Any]]) -> None:
        """The reference's ``group['k'] = k + 1`` and the rest, for every group (a group
        without any gradient counts the step too)."""
        for group, s in zip(self.param_groups, settings):
            step = self.schedule(s)
            group["k"] = s["k"] + 1
            group["weight_sum"] = step.weight_sum
            group["lr_max"] = step.lr_max
            group["scheduled_lr"] = step.lr

    # ------------------------------------------------------------------ modes
    def train(self) -> None:
        """Move the parameters of every group in eval mode to ``y``, the point gradients are
        taken at (``p = lerp(p, z, 1 - beta1)``, one pass per buffer); then step."""
        self._switch(True)

    def eval(self) -> None:
        """Move the parameters of every group in train mode to the average ``x``
        (``p = lerp(p, z, 1 - 1/beta1)``, one pass per buffer): call before evaluating the
        model or saving it for inference. A checkpoint records the mode and resumes in it."""
        self._switch(False)

    def _switch(self, train: bool) -> None:
        with self.lock:
            settings = self.settings()
            switching = [s["train_mode"] != train for s in settings]

            def arguments(buf):
                if not switching[buf.group]:
                    return None
                beta1 = self._beta1(settings[buf.group])
                weight = buf.dtype.type(1 - beta1 if train else 1 - 1 / beta1)
                from_end = not abs(weight) < 0.5
                coefficient = weight - buf.dtype.type(1) if from_end else weight
                return np.array([coefficient], buf.dtype), (bool(from_end),)

            self._map_state(rule.SWITCH, ("z",), arguments)
            for group, flip in zip(self.param_groups, switching):
                if flip:
                    group["train_mode"] = train


SGD_SCHEMA = Schema(
    reduced_precision=False,
    name="ScheduleFreeSGD", rule=rule.RULE_SGD, record=ScheduleFreeSGDParamState,
    hyperparameters={
        "lr": Hyperparameter(1.0, non_negative, (1.0, 0.1)),
        "momentum": Hyperparameter(0.9, momentum, (0.9, 0.5, 0.3)),
        "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.01)),
        **_WARMUP, **_AVERAGING, **_COUNTERS},
    columns=_MARKER, slots={"z": Slot()})


@register
class ScheduleFreeSGD(_ScheduleFree):
    r"""Schedule-Free SGD (the reference's ``SGDScheduleFree``). Per group, with ``k`` its
    step count (every step counts, whichever gradients are present)::

        lr_t = lr * min(1, (k + 1) / warmup_steps)
        lr_max = max(lr_max, lr_t);  w = (k + 1)**r * lr_max**weight_lr_power
        weight_sum += w;  ckp1 = w / weight_sum   (0 when weight_sum is 0)

    then for each parameter with a gradient (``z = p`` at its first)::

        g = g + weight_decay * y
        y = lerp(y, z, ckp1) + lr_t * (momentum * (1 - ckp1) - 1) * g
        z = z - lr_t * g

    Call ``opt.eval()`` before evaluating or saving a model (the parameters then hold the
    average ``x``) and ``opt.train()`` before stepping again (stepping in eval mode raises
    :class:`~flatopt.ModeError`). ``foreach`` is accepted and ignored.
    """

    schema = SGD_SCHEMA

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0,
                 weight_lr_power: float = 2.0, foreach: bool | None = None, **unknown: Any):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
                         foreach=foreach, **unknown)

    def _beta1(self, s: Mapping[str, Any]) -> float:
        return s["momentum"]

    def _lr(self, s: Mapping[str, Any]) -> tuple[float, bool, float]:
        return _warmed_up(s), False, 1.0


ADAMW_SCHEMA = Schema(
    reduced_precision=False,
    name="ScheduleFreeAdamW", rule=rule.RULE_ADAM, record=ScheduleFreeAdamWParamState,
    hyperparameters={**_ADAM, **_WARMUP, **_AVERAGING, **_COUNTERS},
    columns=_MARKER, slots={"z": Slot(), "exp_avg_sq": Slot(nonnegative=True)})


@register
class ScheduleFreeAdamW(_ScheduleFree):
    r"""Schedule-Free AdamW (the reference's ``AdamWScheduleFree``). Per group, ``lr_t``,
    ``ckp1`` as :class:`ScheduleFreeSGD`'s; then for each parameter with a gradient::

        v = beta2 * v + (1 - beta2) * g * g
        g = g / (sqrt(v / (1 - beta2**(k + 1))) + eps) + weight_decay * y
        y = lerp(y, z, ckp1) + lr_t * (beta1 * (1 - ckp1) - 1) * g
        z = z - lr_t * g

    The bias correction counts the group's steps (``k``), not the parameter's.
    ``opt.train()`` / ``opt.eval()`` as :class:`ScheduleFreeSGD`'s, with beta1 for momentum.
    """

    schema = ADAMW_SCHEMA

    def __init__(self, params: Any, lr: float = 0.0025,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0,
                 weight_lr_power: float = 2.0, foreach: bool | None = None, **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
                         foreach=foreach, **unknown)


RADAM_SCHEMA = Schema(
    reduced_precision=False,
    name="ScheduleFreeRAdam", rule=rule.RULE_ADAM, record=ScheduleFreeRAdamParamState,
    hyperparameters={
        **_ADAM,
        "betas": Hyperparameter((0.9, 0.999), averaging_betas,
                                ((0.9, 0.999), (0.9, 0.9), (0.5, 0.6))),
        **_AVERAGING,
        "silent_sgd_phase": switch(True),
        **_COUNTERS},
    columns=_MARKER, slots={"z": Slot(), "exp_avg_sq": Slot(nonnegative=True)})


@register
class ScheduleFreeRAdam(_ScheduleFree):
    r"""Schedule-Free RAdam (the reference's ``RAdamScheduleFree``): no warm-up setting, the
    rectification is one. Per group, with ``t = k + 1``::

        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2**t / (1 - beta2**t)
        rect = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
               if rho_t > 4, else 0 with silent_sgd_phase (nothing but v moves), else 1
        lr_t = lr * rect;  lr_max, ckp1 as ScheduleFreeSGD's

    then each parameter as :class:`ScheduleFreeAdamW`'s, the gradient normalised only once
    ``rho_t > 4`` (before: plain SGD on ``g + weight_decay * y``).
    """

    schema = RADAM_SCHEMA

    def __init__(self, params: Any, lr: float = 0.0025,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, r: float = 0.0, weight_lr_power: float = 2.0,
                 foreach: bool | None = None, silent_sgd_phase: bool = True, **unknown: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, r=r,
                         weight_lr_power=weight_lr_power, foreach=foreach,
                         silent_sgd_phase=silent_sgd_phase, **unknown)

    def _lr(self, s: Mapping[str, Any]) -> tuple[float, bool, float]:
        beta2 = s["betas"][1]
        step = s["k"] + 1
        beta2_t = beta2**step
        bias_correction2 = 1 - beta2_t
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * beta2_t / bias_correction2
        rect = (
            ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
            if rho_t > 4.0
            else float(not s["silent_sgd_phase"])
        )
        return s["lr"] * rect, rho_t > 4.0, bias_correction2
