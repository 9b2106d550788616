"""CyclicLR: the lr cycling between ``base_lr`` and ``max_lr`` (Smith 2017), momentum inversely."""

from __future__ import annotations

import math
from typing import Any, Callable

from ._checks import check_last_epoch, check_optimizer, describe, flag, per_group, real, reals
from ._momentum import checked_bounds, start_cycle, uses_beta1, write_momentums
from .base import LRScheduler
from .lambdas import saved_attributes

MODES = ("triangular", "triangular2", "exp_range")
SCALE_MODES = ("cycle", "iterations")


class CyclicLR(LRScheduler):
    """torch 2.13's ``CyclicLR``: each cycle takes ``step_size_up`` steps from ``base_lr`` to
    ``max_lr`` and ``step_size_down`` (default: the same) back, the amplitude scaled by
    ``mode`` (``triangular``: 1; ``triangular2``: halved every cycle; ``exp_range``:
    ``gamma ** step``) or by ``scale_fn`` of the cycle or the step (``scale_mode``). With
    ``cycle_momentum``, momentum (``group["momentum"]``, or ``betas[0]``) moves inversely
    between ``max_momentum`` and ``base_momentum``.

    As with OneCycleLR, ``max_momentum`` and ``base_momentum`` stay in this scheduler's state,
    not in the groups (torch writes them into the groups; flatopt refuses unknown group keys).
    A custom ``scale_fn`` is saved as LambdaLR's functions are: not at all for a function, its
    attributes for a callable object. Stricter than torch: ``step_size_up`` must be > 0 (torch
    divides by it), ``scale_mode`` one of "cycle", "iterations", and the lrs and momentums
    numbers the optimizer accepts.
    """

    extra_state = ("max_lrs", "total_size", "step_ratio", "mode", "gamma", "scale_mode",
                   "cycle_momentum", "use_beta1", "base_momentums", "max_momentums",
                   "_scale_fn_custom")

    def __init__(self, optimizer: Any, base_lr: float | list[float], max_lr: float | list[float],
                 step_size_up: float = 2000, step_size_down: float | None = None,
                 mode: str = "triangular", gamma: float = 1.0,
                 scale_fn: Callable[[float], float] | None = None, scale_mode: str = "cycle",
                 cycle_momentum: bool = True, base_momentum: float | list[float] = 0.8,
                 max_momentum: float | list[float] = 0.9, last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        base_lrs = per_group("base_lr", optimizer, base_lr)
        max_lrs = per_group("max_lr", optimizer, max_lr)
        up = real(step_size_up, "step_size_up", low=0.0, low_open=True)
        down = up if step_size_down is None else real(step_size_down, "step_size_down",
                                                       low=0.0)
        if mode not in MODES and scale_fn is None:
            raise ValueError("mode is invalid and scale_fn is None")
        if scale_fn is not None and not callable(scale_fn):
            raise TypeError(f"scale_fn must be a function, got {describe(scale_fn)}")
        last_epoch = check_last_epoch(last_epoch)
        cycle_momentum = flag(cycle_momentum, "cycle_momentum")
        beta1 = uses_beta1(optimizer) if cycle_momentum else False
        self._scale_fn = scale_fn
        values = self._checked_extra({
            "max_lrs": max_lrs, "total_size": up + down, "step_ratio": up / (up + down),
            "mode": mode, "gamma": gamma, "scale_mode": scale_mode,
            "cycle_momentum": cycle_momentum, "use_beta1": beta1,
            "base_momentums": per_group("base_momentum", optimizer, base_momentum)
            if cycle_momentum else None,
            "max_momentums": per_group("max_momentum", optimizer, max_momentum)
            if cycle_momentum else None,
            "_scale_fn_custom": saved_attributes(scale_fn) if scale_fn is not None else None})
        self.optimizer = optimizer
        start_cycle(self, "CyclicLR", optimizer, values, last_epoch, "lr", base_lrs)
        super().__init__(optimizer, last_epoch)
        self.base_lrs = base_lrs

    def _checked_extra(self, values):
        count = len(values["max_lrs"]) if not hasattr(self, "optimizer") else \
            len(self.optimizer.param_groups)
        mode = values["mode"]
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a string, got {describe(mode)}")
        custom = values["_scale_fn_custom"]
        if (custom is None) != (self._scale_fn is None or saved_attributes(self._scale_fn)
                                is None):
            raise ValueError("_scale_fn_custom was saved from a "
                             f"{'function' if custom is None else 'callable object'}, but "
                             "this scheduler's scale_fn is not one: build it with the scale_fn "
                             "the state was saved with")
        if self._scale_fn is None and mode not in MODES:
            raise ValueError("mode is invalid and scale_fn is None")
        scale_mode = values["scale_mode"]
        if self._scale_fn is None:  # torch's _init_scale_fn: the mode decides
            scale_mode = "iterations" if mode == "exp_range" else "cycle"
        elif scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got "
                             f"{describe(scale_mode)}")
        total_size = real(values["total_size"], "total_size", low=0.0, low_open=True)
        checked = {
            "max_lrs": reals(values["max_lrs"], "max_lrs", count, low=0.0),
            "total_size": total_size,
            "step_ratio": real(values["step_ratio"], "step_ratio", low=0.0, low_open=True,
                                high=1.0),
            "mode": mode, "gamma": real(values["gamma"], "gamma", low=0.0),
            "scale_mode": scale_mode,
            "cycle_momentum": flag(values["cycle_momentum"], "cycle_momentum"),
            "use_beta1": flag(values["use_beta1"], "use_beta1"),
            "_scale_fn_custom": custom,
        }
        checked_bounds("CyclicLR", getattr(self, "optimizer", None), values, checked, count,
                       loading=hasattr(self, "optimizer"))
        return checked

    def _apply_state(self, values: dict[str, Any]) -> None:
        super()._apply_state(values)
        if self._scale_fn is not None and self._scale_fn_custom is not None:
            vars(self._scale_fn).update(self._scale_fn_custom)

    def _extra_values(self) -> dict[str, Any]:
        values = super()._extra_values()
        if self._scale_fn is not None:
            values["_scale_fn_custom"] = saved_attributes(self._scale_fn)
        return values

    @property
    def owned_hyperparameters(self) -> tuple[str, ...]:
        if self.cycle_momentum:
            return ("lr", "betas") if self.use_beta1 else ("lr", "momentum")
        return ("lr",)

    def scale_fn(self, x: float) -> float:
        if self._scale_fn is not None:
            return self._scale_fn(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma ** x

    def get_lr(self):
        self._warn_get_lr_outside_step()
        cycle = math.floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
        at = cycle if self.scale_mode == "cycle" else self.last_epoch
        # torch's expressions, and its calls of scale_fn (once per group and value: a
        # callable object that counts them sees what it would see in torch)
        lrs = [base_lr + (max_lr - base_lr) * scale_factor * self.scale_fn(at)
               for base_lr, max_lr in zip(self.base_lrs, self.max_lrs, strict=True)]
        if self.cycle_momentum:  # torch's side effect of get_lr
            write_momentums(self.optimizer, [
                max_momentum - (max_momentum - base_momentum) * scale_factor * self.scale_fn(at)
                for base_momentum, max_momentum
                in zip(self.base_momentums, self.max_momentums, strict=True)], self.use_beta1)
        return lrs
