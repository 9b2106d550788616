"""The scheduler base class: torch's LRScheduler protocol, with validated state."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import HyperparameterError, StateDictError
from ._checks import (EPOCH_DEPRECATION_WARNING, any_reals, check_last_epoch,
                      check_optimizer, group_lrs, integer, is_real, plain, reals,
                      require_initial_lr)

ROUNDING = 2.0 ** -30
"""A negative lr no larger than this times the group's initial lr is a schedule's rounding
(torch's chained LinearLR ends at 0 as -1.48e-18 times it), far beyond the ulps a schedule's
formulas lose and far below any lr a schedule means."""


def _clamped(lr: Any, base: Any) -> Any:
    """``lr``, or 0.0 where it is below zero only by rounding: the optimizer refuses a
    negative lr, and a schedule that ends at 0 must not stop training. A negative lr beyond
    rounding (a subclass's get_lr gone wrong) is left for the optimizer to refuse."""
    if is_real(lr) and is_real(base) and lr < 0 and -lr <= ROUNDING * abs(base):
        return 0.0
    return lr


class LRScheduler:
    """Base class: adjusts ``group["lr"]`` of an optimizer's param groups at every ``step()``.

    Subclasses implement :meth:`get_lr` (values computed at ``last_epoch``, already advanced),
    optionally ``_get_closed_form_lr``, and list their state attributes in ``extra_state``.
    """

    extra_state: ClassVar[tuple[str, ...]] = ()
    """Attributes besides ``last_epoch``, ``_step_count``, ``base_lrs`` and ``_last_lr`` that
    ``state_dict()`` saves and ``load_state_dict()`` restores (JSON data)."""

    _core_state: ClassVar[tuple[str, ...]] = ("last_epoch", "_step_count", "base_lrs",
                                             "_last_lr")
    _get_lr_called_within_step: bool = False
    _is_initial: bool = False

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        last_epoch = check_last_epoch(last_epoch)
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            require_initial_lr(optimizer)
        self.optimizer = optimizer
        self.base_lrs: list = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    # ------------------------------------------------------------------ stepping
    def _initial_step(self) -> None:
        """Initialize the step count and make the initial step (``last_epoch`` -1 -> 0)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def step(self, epoch: int | None = None) -> None:
        """Advance one step (call after ``optimizer.step()``) and write the new lrs.

        ``epoch`` (deprecated, as in torch) sets ``last_epoch`` and uses the closed form where
        there is one, with a ``UserWarning``.
        """
        if epoch is not None:
            epoch = integer(epoch, "epoch", low=0)
        saved = self._counters()
        self._step_count += 1
        if epoch is not None:
            warnings.warn(EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
        try:
            self._update_lr(epoch)
        except BaseException:
            self._restore_counters(saved)
            raise

    def _counters(self) -> tuple:
        return self.last_epoch, getattr(self, "_step_count", 0)

    def _restore_counters(self, saved: tuple) -> None:
        self.last_epoch, self._step_count = saved

    def _check_group_count(self) -> None:
        count = len(self.optimizer.param_groups)
        if count != len(self.base_lrs):
            raise HyperparameterError(
                f"{type(self).__name__} was built for {len(self.base_lrs)} param groups, but "
                f"the optimizer now has {count}: build the scheduler after the last "
                "add_param_group()")

    def _update_lr(self, epoch: int | None = None) -> None:
        self._check_group_count()
        saved = self.last_epoch
        self._get_lr_called_within_step = True
        try:
            if epoch is None:
                self.last_epoch += 1
                values = self.get_lr()
            else:
                self.last_epoch = epoch
                closed_form = getattr(self, "_get_closed_form_lr", None)
                values = closed_form() if closed_form is not None else self.get_lr()
        except BaseException:
            self.last_epoch = saved
            raise
        finally:
            self._get_lr_called_within_step = False
        self._write_lrs(values)

    def _write_lrs(self, values: list) -> None:
        for group, lr, base in zip(self.optimizer.param_groups, values, self.base_lrs,
                                   strict=True):
            group["lr"] = _clamped(lr, base)
        self._last_lr = group_lrs(self.optimizer)

    def get_lr(self) -> list[float]:
        """The lrs for the current ``last_epoch`` (for the most recent ones, use
        :meth:`get_last_lr`)."""
        raise NotImplementedError

    def _warn_get_lr_outside_step(self) -> None:
        if not self._get_lr_called_within_step:
            warnings.warn("To get the last learning rate computed by the scheduler, "
                          "please use `get_last_lr()`.", UserWarning, stacklevel=3)

    def get_last_lr(self) -> list[float]:
        """The learning rates this scheduler wrote last, one per param group (a copy)."""
        return list(self._last_lr)

    @property
    def owned_hyperparameters(self) -> tuple[str, ...]:
        """The group keys this scheduler writes at every step (``initial_lr``, written once,
        is not one of them)."""
        return ("lr",)

    # ------------------------------------------------------------------ state
    def _state_keys(self) -> tuple[str, ...]:
        return (*self._core_state, *self.extra_state)

    def _extra_values(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.extra_state}

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state as JSON data (no optimizer), tagged with the class name.
        Refused once the optimizer has gained a group: no load could take it back."""
        self._check_group_count()
        state: dict[str, Any] = {"scheduler": type(self).__name__}
        for key in self._core_state:
            state[key] = getattr(self, key)
        state.update(self._extra_values())
        return plain(state, f"{type(self).__name__}.state_dict()")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state from :meth:`state_dict` (or its JSON parsed back). Everything is
        checked first; on any problem a ``StateDictError`` and nothing has changed. The
        optimizer's groups are not touched (their values come from the optimizer's state)."""
        values = self._checked_state(state_dict)
        self._apply_state(values)

    def _apply_state(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def _checked_state(self, state_dict: Any) -> dict[str, Any]:
        name = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"{name}.load_state_dict() takes the dict state_dict() "
                                 f"returned, got {type(state_dict).__name__}")
        tag = state_dict.get("scheduler")
        if tag != name:
            raise StateDictError(f"this state dict is from {tag!r}, not {name!r}: a "
                                 "scheduler loads only its own class's state")
        expected = {"scheduler", *self._state_keys()}
        missing = [key for key in ("scheduler", *self._state_keys()) if key not in state_dict]
        unknown = sorted((repr(key) for key in state_dict if key not in expected))
        if missing or unknown:
            parts = ([f"missing {missing}"] if missing else []) + \
                    ([f"unknown {', '.join(unknown)}"] if unknown else [])
            raise StateDictError(f"{name} state dict: {'; '.join(parts)}")
        try:
            return self._checked_values(state_dict)
        except StateDictError:
            raise
        except (TypeError, ValueError) as exc:
            raise StateDictError(f"{name} state dict: {exc}") from None

    def _checked_values(self, state: Mapping[str, Any]) -> dict[str, Any]:
        count = len(self.optimizer.param_groups)
        values = {
            "last_epoch": integer(state["last_epoch"], "last_epoch", low=-1),
            "_step_count": integer(state["_step_count"], "_step_count", low=0),
            "base_lrs": reals(state["base_lrs"], "base_lrs", count, low=0.0),
            "_last_lr": any_reals(state["_last_lr"], "_last_lr", count),
        }
        values.update(self._checked_extra({key: state[key] for key in self.extra_state}))
        return values

    def _checked_extra(self, values: dict[str, Any]) -> dict[str, Any]:
        """Validate (and normalise) the ``extra_state`` values: used by the constructor and
        by ``load_state_dict``. May return more (derived, internal) attributes."""
        return {key: plain(value, key) for key, value in values.items()}


# ----------------------------------------------------------------------------- schedulers
