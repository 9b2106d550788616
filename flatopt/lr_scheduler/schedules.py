"""The closed-form schedules: step, multi-step, constant, linear, exponential, polynomial,
cosine annealing (with warm restarts)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable, ClassVar

from ._checks import (check_last_epoch, check_optimizer, describe,
                      group_lrs, integer, is_int, is_real, real)
from .base import LRScheduler

_Check = Callable[[Any, str], Any]
"""``check(value, name)``: the value to keep, or a TypeError/ValueError naming ``name``."""

_AT_LEAST_ONE: _Check = partial(integer, low=1)
"""An integer >= 1 (a step count the schedule divides by or counts in)."""

_NON_NEGATIVE: _Check = partial(real, low=0.0)
"""A finite real number >= 0 (a factor, an exponent or an lr)."""


class _ArgumentSchedule(LRScheduler):
    """A schedule whose extra state is its constructor's arguments (but ``last_epoch``),
    checked alike when built (:meth:`_start`) and when loaded (``_checked_extra``).

    A subclass either names them with their checks in its class statement
    (``class StepLR(_ArgumentSchedule, checks={"step_size": ..., "gamma": ...})``: ``checks``,
    and ``extra_state`` is their names in order), or lists ``extra_state`` and overrides
    ``_checked_extra`` as any scheduler does.
    """

    checks: ClassVar[dict[str, _Check]] = {}
    """Each extra state attribute's check, in the order of ``extra_state``."""

    def __init_subclass__(cls, checks: Mapping[str, _Check] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if checks is not None:
            cls.checks = dict(checks)
            cls.extra_state = tuple(cls.checks)

    def _start(self, optimizer: Any, last_epoch: int, arguments: dict[str, Any]) -> None:
        """The constructor's work: the arguments checked and set as attributes, then the
        schedule started (LRScheduler's constructor: the initial step)."""
        check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra(arguments))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        return {key: check(values[key], key) for key, check in self.checks.items()}


class StepLR(_ArgumentSchedule, checks={"step_size": _AT_LEAST_ONE, "gamma": _NON_NEGATIVE}):
    """Multiply each group's lr by ``gamma`` every ``step_size`` steps (chainable)."""

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"step_size": step_size, "gamma": gamma})

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if (self.last_epoch == 0) or (self.last_epoch % self.step_size != 0):
            return group_lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * self.gamma ** (self.last_epoch // self.step_size)
                for base_lr in self.base_lrs]


class MultiStepLR(_ArgumentSchedule):
    """Multiply each group's lr by ``gamma`` at every milestone (``gamma**n`` at a milestone
    listed ``n`` times), as torch."""

    extra_state = ("milestones", "gamma")

    def __init__(self, optimizer: Any, milestones: Any, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        if isinstance(milestones, (str, bytes, Mapping)) or \
                not hasattr(milestones, "__iter__"):
            raise TypeError(f"milestones must be a list of integers, got {describe(milestones)}")
        self._start(optimizer, last_epoch, {"milestones": list(milestones), "gamma": gamma})

    def _checked_extra(self, values):
        milestones = values["milestones"]
        if not isinstance(milestones, (list, tuple)):
            raise TypeError(f"milestones must be a list of integers, got {describe(milestones)}")
        checked = [integer(m, f"milestones[{i}]", low=0) for i, m in enumerate(milestones)]
        return {"milestones": Counter(checked),
                "gamma": real(values["gamma"], "gamma", low=0.0)}

    def _extra_values(self):
        return {"milestones": sorted(self.milestones.elements()), "gamma": self.gamma}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch not in self.milestones:
            return group_lrs(self.optimizer)
        return [group["lr"] * self.gamma ** self.milestones[self.last_epoch]
                for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        milestones = sorted(self.milestones.elements())
        return [base_lr * self.gamma ** bisect_right(milestones, self.last_epoch)
                for base_lr in self.base_lrs]


class ConstantLR(_ArgumentSchedule):
    """Multiply each group's lr by ``factor`` until ``total_iters`` steps, then undo it."""

    extra_state = ("factor", "total_iters")

    def __init__(self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"factor": factor, "total_iters": total_iters})

    def _checked_extra(self, values):
        factor = values["factor"]
        if not is_real(factor):
            raise TypeError(f"factor must be a real number, got {describe(factor)}")
        if not (0 <= factor <= 1.0):
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        if factor == 0:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1; "
                             "flatopt refuses 0 too: at total_iters the lr is divided by the "
                             "factor (torch raises ZeroDivisionError there)")
        return {"factor": float(factor),
                "total_iters": integer(values["total_iters"], "total_iters", low=0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch == 0:
            return [group["lr"] * self.factor for group in self.optimizer.param_groups]
        if self.last_epoch != self.total_iters:
            return group_lrs(self.optimizer)
        return [group["lr"] * (1.0 / self.factor) for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * (self.factor + (self.last_epoch >= self.total_iters)
                           * (1 - self.factor))
                for base_lr in self.base_lrs]


class LinearLR(_ArgumentSchedule):
    """Multiply each group's lr by a factor going linearly from ``start_factor`` to
    ``end_factor`` over ``total_iters`` steps (chainable, as torch)."""

    extra_state = ("start_factor", "end_factor", "total_iters")

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"start_factor": start_factor,
                                            "end_factor": end_factor,
                                            "total_iters": total_iters})

    def _checked_extra(self, values):
        start, end = values["start_factor"], values["end_factor"]
        for name, value in (("start_factor", start), ("end_factor", end)):
            if not is_real(value):
                raise TypeError(f"{name} must be a real number, got {describe(value)}")
        if start > 1.0 or not start > 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 "
                             "and less or equal to 1.")
        if end > 1.0 or not end >= 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        return {"start_factor": float(start), "end_factor": float(end),
                "total_iters": integer(values["total_iters"], "total_iters", low=1)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch == 0:
            return [group["lr"] * self.start_factor for group in self.optimizer.param_groups]
        if self._is_initial or self.last_epoch > self.total_iters:
            return group_lrs(self.optimizer)
        return [
            group["lr"]
            * (1.0 + (self.end_factor - self.start_factor)
               / (self.total_iters * self.start_factor
                  + (self.last_epoch - 1) * (self.end_factor - self.start_factor)))
            for group in self.optimizer.param_groups
        ]

    def _get_closed_form_lr(self):
        return [base_lr * (self.start_factor
                           + (self.end_factor - self.start_factor)
                           * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base_lr in self.base_lrs]


class ExponentialLR(_ArgumentSchedule, checks={"gamma": _NON_NEGATIVE}):
    """Multiply each group's lr by ``gamma`` every step."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"gamma": gamma})

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial:
            return group_lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * self.gamma ** self.last_epoch for base_lr in self.base_lrs]


class PolynomialLR(_ArgumentSchedule,
                   checks={"total_iters": _AT_LEAST_ONE, "power": _NON_NEGATIVE}):
    """Decay each group's lr by ``(1 - t / total_iters) ** power`` (chainable, as torch)."""

    def __init__(self, optimizer: Any, total_iters: int = 5, power: float = 1.0,
                 last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"total_iters": total_iters, "power": power})

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial or self.last_epoch > self.total_iters:
            return group_lrs(self.optimizer)
        decay_factor = ((1.0 - self.last_epoch / self.total_iters)
                        / (1.0 - (self.last_epoch - 1) / self.total_iters)) ** self.power
        return [group["lr"] * decay_factor for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * (1.0 - min(self.total_iters, self.last_epoch) / self.total_iters)
                ** self.power
                for base_lr in self.base_lrs]


class CosineAnnealingLR(_ArgumentSchedule,
                        checks={"T_max": _AT_LEAST_ONE, "eta_min": _NON_NEGATIVE}):
    """Cosine annealing from the initial lr to ``eta_min`` over ``T_max`` steps, in torch's
    recursive form (and on past ``T_max``, as torch: back up again)."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        self._start(optimizer, last_epoch, {"T_max": T_max, "eta_min": eta_min})

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial:
            return group_lrs(self.optimizer)
        elif self._step_count == 1 and self.last_epoch > 0:
            return [self.eta_min + (base_lr - self.eta_min)
                    * (1 + math.cos((self.last_epoch) * math.pi / self.T_max)) / 2
                    for base_lr, group in zip(self.base_lrs, self.optimizer.param_groups,
                                              strict=True)]
        elif (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            return [group["lr"] + (base_lr - self.eta_min)
                    * (1 - math.cos(math.pi / self.T_max)) / 2
                    for base_lr, group in zip(self.base_lrs, self.optimizer.param_groups,
                                              strict=True)]
        return [(1 + math.cos(math.pi * self.last_epoch / self.T_max))
                / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max))
                * (group["lr"] - self.eta_min) + self.eta_min
                for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base_lr in self.base_lrs]


class CosineAnnealingWarmRestarts(_ArgumentSchedule):
    """Cosine annealing restarted every ``T_i`` steps, ``T_0`` first, then ``T_mult`` times
    longer each time (SGDR). ``step(epoch)`` takes a real epoch (fractions of an epoch), as
    in torch, without a warning."""

    extra_state = ("T_0", "T_i", "T_mult", "eta_min", "T_cur")

    def __init__(self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        if not is_int(T_0) or T_0 <= 0:
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if not is_int(T_mult) or T_mult < 1:
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        if not is_real(eta_min):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type "
                             f"{type(eta_min)}")
        last_epoch = check_last_epoch(last_epoch)
        self._start(optimizer, last_epoch, {"T_0": T_0, "T_i": T_0, "T_mult": T_mult,
                                            "eta_min": eta_min, "T_cur": last_epoch})

    def _checked_extra(self, values):
        T_cur = values["T_cur"]
        if not is_real(T_cur) or not math.isfinite(T_cur) or T_cur < -1:
            raise ValueError(f"T_cur must be a finite number >= -1, got {T_cur!r}")
        return {"T_0": integer(values["T_0"], "T_0", low=1),
                "T_i": integer(values["T_i"], "T_i", low=1),
                "T_mult": integer(values["T_mult"], "T_mult", low=1),
                "eta_min": real(values["eta_min"], "eta_min", low=0.0),
                "T_cur": int(T_cur) if is_int(T_cur) else float(T_cur)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        return [self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2
                for base_lr in self.base_lrs]

    def _counters(self):
        return self.last_epoch, self._step_count, self.T_cur, self.T_i

    def _restore_counters(self, saved):
        self.last_epoch, self._step_count, self.T_cur, self.T_i = saved

    def step(self, epoch: float | None = None) -> None:
        """One step, or (as torch) jump to a real ``epoch`` >= 0."""
        if epoch is not None:
            if not is_real(epoch) or not math.isfinite(epoch):
                raise TypeError(f"epoch must be a finite real number, got {describe(epoch)}")
        self._check_group_count()
        saved = self._counters()
        try:
            self._step(epoch)
        except BaseException:
            self._restore_counters(saved)
            raise

    def _step(self, epoch):
        if epoch is None and self.last_epoch < 0:
            epoch = 0
        if epoch is None:
            epoch = self.last_epoch + 1
            self.T_cur = self.T_cur + 1
            if self.T_cur >= self.T_i:
                self.T_cur = self.T_cur % self.T_i
                self.T_i = self.T_i * self.T_mult
        else:
            if epoch < 0:
                raise ValueError(f"Expected non-negative epoch, but got {epoch}")
            if epoch >= self.T_0:
                if self.T_mult == 1:
                    self.T_cur = epoch % self.T_0
                else:
                    n = int(math.log((epoch / self.T_0 * (self.T_mult - 1) + 1), self.T_mult))
                    self.T_cur = epoch - self.T_0 * (self.T_mult ** n - 1) / (self.T_mult - 1)
                    self.T_i = self.T_0 * self.T_mult ** (n)
            else:
                self.T_i = self.T_0
                self.T_cur = epoch
        self.last_epoch = math.floor(epoch)
        self._get_lr_called_within_step = True
        try:
            values = self.get_lr()
        finally:
            self._get_lr_called_within_step = False
        self._write_lrs(values)
