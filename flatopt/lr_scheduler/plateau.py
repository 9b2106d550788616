"""ReduceLROnPlateau: the learning rate cut when a metric stops improving."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from ._checks import (EPOCH_DEPRECATION_WARNING, any_reals, check_optimizer,
                      describe, group_lrs, integer, is_real, plain, real,
                      reals)
from .base import LRScheduler


class ReduceLROnPlateau(LRScheduler):
    """Multiply each group's lr by ``factor`` (not below ``min_lr``) when ``metrics`` has not
    improved for more than ``patience`` steps; ``step(metrics)``. As in torch, it sets no
    ``initial_lr`` and has no initial step."""

    _state_names = ("factor", "min_lrs", "default_min_lr", "patience", "cooldown", "eps",
                    "last_epoch", "_last_lr", "mode", "threshold", "threshold_mode", "best",
                    "cooldown_counter", "num_bad_epochs")

    def __init__(self, optimizer: Any, mode: str = "min", factor: float = 0.1,
                 patience: int = 10, threshold: float = 1e-4, threshold_mode: str = "rel",
                 cooldown: int = 0, min_lr: list[float] | float = 0, eps: float = 1e-8) -> None:
        if not is_real(factor):
            raise TypeError(f"factor must be a real number, got {describe(factor)}")
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        check_optimizer(optimizer)
        count = len(optimizer.param_groups)
        if isinstance(min_lr, (list, tuple)):
            if len(min_lr) != count:
                raise ValueError(f"expected {count} min_lrs, got {len(min_lr)}")
            default_min_lr, min_lrs = None, list(min_lr)
        else:
            default_min_lr, min_lrs = min_lr, [min_lr] * count
        values = self._checked_config({
            "factor": factor, "min_lrs": min_lrs, "default_min_lr": default_min_lr,
            "patience": patience, "cooldown": cooldown, "eps": eps, "mode": mode,
            "threshold": threshold, "threshold_mode": threshold_mode}, count)
        self.optimizer = optimizer
        self.__dict__.update(values)
        self.last_epoch = 0
        self._last_lr = group_lrs(optimizer)
        self._reset()

    @staticmethod
    def _checked_config(values: Mapping[str, Any], count: int | None) -> dict[str, Any]:
        mode, threshold_mode = values["mode"], values["threshold_mode"]
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        factor = real(values["factor"], "factor", low=0.0)
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        default = values["default_min_lr"]
        if default is not None:
            default = real(default, "min_lr", low=0.0)
        return {
            "factor": factor,
            "min_lrs": reals(values["min_lrs"], "min_lr", count if default is None else None,
                              low=0.0),
            "default_min_lr": default,
            "patience": integer(values["patience"], "patience", low=0),
            "cooldown": integer(values["cooldown"], "cooldown", low=0),
            "eps": real(values["eps"], "eps", low=0.0),
            "mode": str(mode), "threshold": real(values["threshold"], "threshold"),
            "threshold_mode": str(threshold_mode),
        }

    @property
    def mode_worse(self) -> float:
        """The worst value for the mode (``inf`` for 'min', ``-inf`` for 'max')."""
        return math.inf if self.mode == "min" else -math.inf

    def _reset(self) -> None:
        self.best = self.mode_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    @property
    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def _is_better(self, a: float, best: float) -> bool:
        if self.mode == "min" and self.threshold_mode == "rel":
            rel_epsilon = 1.0 - self.threshold
            return a < best * rel_epsilon
        elif self.mode == "min" and self.threshold_mode == "abs":
            return a < best - self.threshold
        elif self.mode == "max" and self.threshold_mode == "rel":
            rel_epsilon = self.threshold + 1.0
            return a > best * rel_epsilon
        return a > best + self.threshold

    def step(self, metrics: Any, epoch: int | None = None) -> None:  # type: ignore[override]
        """Record ``metrics`` (a number, or anything ``float()`` takes but a string) and
        reduce the lrs if it has not improved for more than ``patience`` steps."""
        if isinstance(metrics, (str, bytes)):
            raise TypeError(f"metrics must be a number, got {describe(metrics)}")
        current = float(metrics)
        if epoch is None:
            epoch = self.last_epoch + 1
        else:
            epoch = integer(epoch, "epoch", low=0)
            warnings.warn(EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        self._check_min_lrs()
        self.last_epoch = epoch
        if self._is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # ignore any bad epochs in cooldown
        if self.num_bad_epochs > self.patience:
            self._reduce_lr(epoch)
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = group_lrs(self.optimizer)

    def _check_min_lrs(self) -> None:
        if len(self.optimizer.param_groups) != len(self.min_lrs) and self.default_min_lr is None:
            raise RuntimeError(
                "The number of param groups in the `optimizer` "
                f"({len(self.optimizer.param_groups)}) differs from when `ReduceLROnPlateau` "
                f"was initialized ({len(self.min_lrs)}), usually due to a new param group "
                "being added to the optimizer. Please modify the `min_lrs` field to match the "
                "length of the `optimizer` param groups.")

    def _reduce_lr(self, epoch: int) -> None:
        if len(self.optimizer.param_groups) != len(self.min_lrs):
            self._check_min_lrs()
            self.min_lrs = [self.default_min_lr] * len(self.optimizer.param_groups)
        for i, param_group in enumerate(self.optimizer.param_groups):
            old_lr = float(param_group["lr"])
            new_lr = max(old_lr * self.factor, self.min_lrs[i])
            if old_lr - new_lr > self.eps:
                param_group["lr"] = new_lr

    def get_lr(self):  # torch has none for this scheduler either
        raise NotImplementedError("ReduceLROnPlateau computes its lrs in step(metrics)")

    def _state_keys(self):
        return self._state_names

    def state_dict(self) -> dict[str, Any]:
        state = {"scheduler": type(self).__name__}
        state.update({key: getattr(self, key) for key in self._state_names})
        return plain(state, "ReduceLROnPlateau.state_dict()")

    def _checked_values(self, state):
        values = self._checked_config(state, None)
        best = state["best"]
        if not is_real(best) or math.isnan(best):
            raise ValueError(f"best must be a number (infinite allowed), got {describe(best)}")
        values.update({
            "last_epoch": integer(state["last_epoch"], "last_epoch", low=0),
            "_last_lr": any_reals(state["_last_lr"], "_last_lr", None),
            "best": float(best),
            "cooldown_counter": integer(state["cooldown_counter"], "cooldown_counter", low=0),
            "num_bad_epochs": integer(state["num_bad_epochs"], "num_bad_epochs", low=0),
        })
        count = len(self.optimizer.param_groups)
        if values["default_min_lr"] is None and len(values["min_lrs"]) != count:
            raise ValueError(f"min_lrs has {len(values['min_lrs'])} values, the optimizer "
                             f"has {count} param groups")
        return values
