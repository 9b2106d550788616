"""Learning-rate schedulers for flatopt optimizers, with torch.optim.lr_scheduler's semantics.

What is here (torch 2.13's names, signatures, defaults and lr sequences):

=============================== ==========================================================
``LRScheduler``                  base class: ``step()``, ``get_last_lr()``, ``state_dict()``,
                                 ``load_state_dict()``, ``owned_hyperparameters``
``StepLR``                       ``lr *= gamma`` every ``step_size`` steps
``MultiStepLR``                  ``lr *= gamma`` at each milestone
``ExponentialLR``                ``lr *= gamma`` every step
``CosineAnnealingLR``            cosine from the initial lr to ``eta_min`` over ``T_max``
``CosineAnnealingWarmRestarts``  cosine with restarts every ``T_0 * T_mult**k`` steps
``LinearLR``                     linear factor ``start_factor -> end_factor`` over ``total_iters``
``ConstantLR``                   ``factor * lr`` for ``total_iters`` steps
``PolynomialLR``                 ``(1 - t/total_iters) ** power`` decay
``OneCycleLR``                   1cycle (cos/linear, two or three phases), cycles ``momentum``
                                 (SGD-like groups) or ``betas[0]`` (Adam-like groups)
``SequentialLR``                 children one after another, switching at milestones
``ReduceLROnPlateau``            ``step(metrics)``: ``lr *= factor`` after ``patience`` bad steps
=============================== ==========================================================

Every scheduler computes its values with the same Python expressions, in the same order, as
torch's (chainable/recursive forms where torch uses them, closed forms where torch does, for
example when ``SequentialLR`` switches to the next child), so with float learning rates the
sequences are bit-identical to torch's. As in torch: building a scheduler sets
``group.setdefault("initial_lr", group["lr"])`` (``OneCycleLR`` sets ``initial_lr`` to
``max_lr / div_factor``), a non-default ``last_epoch`` without ``initial_lr`` in the groups is
a ``KeyError``, and the constructor makes the initial step (``last_epoch`` -1 -> 0), which
writes ``group["lr"]`` (``LinearLR``, ``ConstantLR``, ``OneCycleLR`` change it).

Resuming. Build the optimizer, build the scheduler(s), then load both::

    opt = flatopt.AdamW(groups, lr=1e-3)
    sched = flatopt.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10_000)
    flatopt.load("run/ckpt.h5", opt, scheduler=sched)   # or: opt.load_state_dict(o);
                                                        #     sched.load_state_dict(s)

Building the scheduler after loading would overwrite the loaded learning rates (the
constructor's initial step), exactly as in torch. ``load_state_dict`` never writes the groups:
their values come from the optimizer's state (the checkpoint); ``owned_hyperparameters``
names the group keys a scheduler writes, so a checkpoint load can take those from the file.

How this differs from torch (deliberately):

- **State dicts are data.** ``state_dict()`` is JSON text's types only (dicts with string
  keys, lists, floats, ints, bools, strings, None) plus a ``"scheduler"`` tag naming the class;
  ``load_state_dict(json.loads(json.dumps(sd)))`` restores exactly (``ReduceLROnPlateau``'s
  infinite ``best`` needs ``allow_nan=True``, which flatopt checkpoints use). Keys are torch's
  attribute names, except: transient flags (``_is_initial``,
  ``_get_lr_called_within_step``) are left out; ``MultiStepLR.milestones`` is a sorted list
  with repeats (torch: a ``Counter``); ``OneCycleLR`` keeps its configuration (``total_steps``,
  ``pct_start``, ``three_phase``, ...) instead of ``_schedule_phases``;
  ``ReduceLROnPlateau`` leaves out ``mode_worse`` (derived from ``mode``). ``load_state_dict``
  checks the whole dict (class, keys, types, ranges, group count) before changing anything,
  and raises :class:`~flatopt.errors.StateDictError`; torch does ``__dict__.update``. As in
  torch, the saved configuration (``gamma``, ``T_max``, ...) replaces the constructor's.
- **Scheduler values stay out of the groups.** flatopt refuses unknown keys in a param group,
  so ``OneCycleLR`` keeps ``max_lr``, ``min_lr``, ``max_momentum`` and ``base_momentum`` per
  group in its own state (``max_lrs``, ``min_lrs``, ``max_momentums``, ``base_momentums``;
  torch writes them into the groups) and reads its initial lr from ``base_lrs``. With
  ``last_epoch >= 0`` they come from the constructor's arguments (torch reads them from the
  groups a loaded optimizer state put there). Only ``lr``, ``momentum``/``betas`` and
  ``initial_lr`` are ever written into a group.
- **No call-order warning.** torch wraps ``optimizer.step`` to warn when ``scheduler.step()``
  comes first; flatopt never wraps or patches the optimizer, so there is no such warning.
  Call ``opt.step()`` before ``sched.step()``.
- **Stricter arguments**, checked before anything is changed: ``step_size``, ``T_max``,
  ``total_iters`` (``LinearLR``/``PolynomialLR``: >= 1, torch divides by them) are integers;
  ``gamma``, ``eta_min``, ``power``, ``div_factor``... are finite and non-negative (a negative
  lr would be refused by the optimizer anyway); ``ConstantLR`` refuses ``factor=0`` (torch
  raises ``ZeroDivisionError`` at ``total_iters``); ``OneCycleLR`` refuses a schedule with a
  zero-length phase that a step falls in (torch: ``ZeroDivisionError``) and momentum values the
  optimizer would refuse; ``SequentialLR`` milestones are strictly increasing integers >= 1,
  and a ``SequentialLR`` inside a ``SequentialLR`` is refused (torch fails when switching to
  one). Where torch checks an argument, the exception type and message are torch's.
- **Group count.** A scheduler built for N groups refuses to step an optimizer that now has
  another number (``add_param_group`` after building it): build the scheduler after the last
  group is added. ``ReduceLROnPlateau`` follows torch (a scalar ``min_lr`` covers new groups;
  with a list, ``step()`` raises torch's ``RuntimeError`` at once, torch at the first
  reduction, after it has already counted the step).
- **A failed step changes nothing** (``OneCycleLR`` stepped past ``total_steps``: torch has
  already advanced ``last_epoch`` when it raises). ``get_last_lr()`` returns a copy.
- ``step(epoch)`` (deprecated in torch) works as in torch: a ``UserWarning`` and the closed
  form where there is one; ``epoch`` must be an integer >= 0 (``CosineAnnealingWarmRestarts``:
  a real number >= 0, as in torch).
- Not provided: ``LambdaLR``, ``MultiplicativeLR``, ``ChainedScheduler``, ``CyclicLR``.

A subclass of :class:`LRScheduler` implements ``get_lr()`` (and optionally
``_get_closed_form_lr()``), and lists its own state attributes in ``extra_state``; their
values must be JSON data (override ``_checked_extra`` to validate them on load).
"""

from __future__ import annotations

import math
import numbers
import warnings
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .errors import HyperparameterError, StateDictError
from .optimizer import Optimizer
from .schema import describe_group

__all__ = [
    "LRScheduler", "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts", "LinearLR", "ConstantLR", "PolynomialLR", "OneCycleLR",
    "SequentialLR", "ReduceLROnPlateau", "EPOCH_DEPRECATION_WARNING",
]

EPOCH_DEPRECATION_WARNING = (
    "The epoch parameter in `scheduler.step()` was not necessary and is being "
    "deprecated where possible. Please use `scheduler.step()` to step the "
    "scheduler. During the deprecation, if epoch is different from None, the "
    "closed form is used instead of the new chainable form, where available. "
    "Please open an issue if you are unable to replicate your use case: "
    "https://github.com/pytorch/pytorch/issues/new/choose."
)
"""torch's text, warned (``UserWarning``) when ``step`` is given an epoch."""


# ----------------------------------------------------------------------------- checks
def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _int(value: Any, name: str, low: int | None = None) -> int:
    """An integer (not a bool) >= low, as a Python int."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {_describe(value)}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return value


def _real(value: Any, name: str, *, low: float | None = None, low_open: bool = False,
          high: float | None = None, high_open: bool = False) -> float:
    """A finite real number (not a bool) in the given range, as a Python float."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if below or above:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            parts.append(f"{'<' if high_open else '<='} {high}")
        raise ValueError(f"{name} must be {' and '.join(parts)}, got {value!r}")
    return number


def _reals(values: Any, name: str, count: int | None, **limits: Any) -> list[float]:
    """A list of ``count`` numbers, each checked by :func:`_real`."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of numbers, got {_describe(values)}")
    if count is not None and len(values) != count:
        raise ValueError(f"{name} must have one value per param group ({count}), "
                         f"got {len(values)}")
    return [_real(v, f"{name}[{i}]", **limits) for i, v in enumerate(values)]


def _any_reals(values: Any, name: str, count: int | None) -> list[float]:
    """A list of ``count`` real numbers (infinite allowed), as floats."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of numbers, got {_describe(values)}")
    if count is not None and len(values) != count:
        raise ValueError(f"{name} must have one value per param group ({count}), "
                         f"got {len(values)}")
    for i, v in enumerate(values):
        if not _is_real(v):
            raise TypeError(f"{name}[{i}] must be a real number, got {_describe(v)}")
    return [float(v) for v in values]


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_describe(value)}")
    return bool(value)


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data: tuples become lists, numpy scalars Python numbers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: state keys must be strings, got {_describe(key)}")
            out[key] = _plain(v, f"{where}[{key!r}]")
        return out
    raise TypeError(f"{where} is a {type(value).__name__}, which is not JSON data")


def _check_optimizer(optimizer: Any) -> None:
    """A flatopt optimizer, or anything whose ``param_groups`` is a list of dicts."""
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return
    if isinstance(optimizer, Optimizer):
        raise TypeError(f"{type(optimizer).__name__}.param_groups must be a list of dicts, "
                        f"got {_describe(groups)}")
    raise TypeError(f"{type(optimizer).__name__} is not an Optimizer (a scheduler takes a "
                    "flatopt optimizer, or an object whose param_groups is a list of dicts)")


def _check_last_epoch(last_epoch: Any) -> int:
    return _int(last_epoch, "last_epoch", low=-1)


def _require_initial_lr(optimizer: Any) -> None:
    """torch's KeyError for ``last_epoch >= 0`` without ``initial_lr`` in every group."""
    for i, group in enumerate(optimizer.param_groups):
        if "initial_lr" not in group:
            raise KeyError(
                f"param 'initial_lr' is not specified in param_groups[{i}] when "
                "resuming scheduler with last_epoch >= 0.\n"
                "This typically happens when:\n"
                "1. You're trying to resume training from a checkpoint but haven't "
                "properly loaded the optimizer state\n"
                "2. You're using last_epoch >= 0 for a fresh training run (not "
                "recommended)")


def _format_param(name: str, optimizer: Any, param: Any) -> list:
    """One value per group: a list/tuple of that length, or a scalar repeated (torch)."""
    if isinstance(param, (list, tuple)):
        if len(param) != len(optimizer.param_groups):
            raise ValueError(
                f"{name} must have the same length as optimizer.param_groups. "
                f"{name} has {len(param)} values, param_groups has "
                f"{len(optimizer.param_groups)}.")
        return list(param)
    return [param] * len(optimizer.param_groups)


def _per_group(name: str, optimizer: Any, param: Any) -> list[float]:
    """:func:`_format_param`, each value a finite number >= 0."""
    values = _format_param(name, optimizer, param)
    listed = isinstance(param, (list, tuple))
    return [_real(v, f"{name}[{i}]" if listed else name, low=0.0)
            for i, v in enumerate(values)]


def _group_lrs(optimizer: Any) -> list:
    return [group["lr"] for group in optimizer.param_groups]


# ----------------------------------------------------------------------------- base class
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
        _check_optimizer(optimizer)
        last_epoch = _check_last_epoch(last_epoch)
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            _require_initial_lr(optimizer)
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
            epoch = _int(epoch, "epoch", low=0)
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
            raise ValueError(
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
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        self._last_lr = _group_lrs(self.optimizer)

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
        """The scheduler's state as JSON data (no optimizer), tagged with the class name."""
        state: dict[str, Any] = {"scheduler": type(self).__name__}
        for key in self._core_state:
            state[key] = getattr(self, key)
        state.update(self._extra_values())
        return _plain(state, f"{type(self).__name__}.state_dict()")

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
            "last_epoch": _int(state["last_epoch"], "last_epoch", low=-1),
            "_step_count": _int(state["_step_count"], "_step_count", low=0),
            "base_lrs": _reals(state["base_lrs"], "base_lrs", count, low=0.0),
            "_last_lr": _any_reals(state["_last_lr"], "_last_lr", count),
        }
        values.update(self._checked_extra({key: state[key] for key in self.extra_state}))
        return values

    def _checked_extra(self, values: dict[str, Any]) -> dict[str, Any]:
        """Validate (and normalise) the ``extra_state`` values: used by the constructor and
        by ``load_state_dict``. May return more (derived, internal) attributes."""
        return {key: _plain(value, key) for key, value in values.items()}


# ----------------------------------------------------------------------------- schedulers
class StepLR(LRScheduler):
    """Multiply each group's lr by ``gamma`` every ``step_size`` steps (chainable)."""

    extra_state = ("step_size", "gamma")

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({"step_size": step_size, "gamma": gamma}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        return {"step_size": _int(values["step_size"], "step_size", low=1),
                "gamma": _real(values["gamma"], "gamma", low=0.0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if (self.last_epoch == 0) or (self.last_epoch % self.step_size != 0):
            return _group_lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * self.gamma ** (self.last_epoch // self.step_size)
                for base_lr in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Multiply each group's lr by ``gamma`` at every milestone (``gamma**n`` at a milestone
    listed ``n`` times), as torch."""

    extra_state = ("milestones", "gamma")

    def __init__(self, optimizer: Any, milestones: Any, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        if isinstance(milestones, (str, bytes, Mapping)) or \
                not hasattr(milestones, "__iter__"):
            raise TypeError(f"milestones must be a list of integers, got {_describe(milestones)}")
        self.__dict__.update(self._checked_extra({"milestones": list(milestones),
                                                  "gamma": gamma}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        milestones = values["milestones"]
        if not isinstance(milestones, (list, tuple)):
            raise TypeError(f"milestones must be a list of integers, got {_describe(milestones)}")
        checked = [_int(m, f"milestones[{i}]", low=0) for i, m in enumerate(milestones)]
        return {"milestones": Counter(checked),
                "gamma": _real(values["gamma"], "gamma", low=0.0)}

    def _extra_values(self):
        return {"milestones": sorted(self.milestones.elements()), "gamma": self.gamma}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch not in self.milestones:
            return _group_lrs(self.optimizer)
        return [group["lr"] * self.gamma ** self.milestones[self.last_epoch]
                for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        milestones = sorted(self.milestones.elements())
        return [base_lr * self.gamma ** bisect_right(milestones, self.last_epoch)
                for base_lr in self.base_lrs]


class ConstantLR(LRScheduler):
    """Multiply each group's lr by ``factor`` until ``total_iters`` steps, then undo it."""

    extra_state = ("factor", "total_iters")

    def __init__(self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({"factor": factor,
                                                  "total_iters": total_iters}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        factor = values["factor"]
        if not _is_real(factor):
            raise TypeError(f"factor must be a real number, got {_describe(factor)}")
        if not (0 <= factor <= 1.0):
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        if factor == 0:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1; "
                             "flatopt refuses 0 too: at total_iters the lr is divided by the "
                             "factor (torch raises ZeroDivisionError there)")
        return {"factor": float(factor),
                "total_iters": _int(values["total_iters"], "total_iters", low=0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch == 0:
            return [group["lr"] * self.factor for group in self.optimizer.param_groups]
        if self.last_epoch != self.total_iters:
            return _group_lrs(self.optimizer)
        return [group["lr"] * (1.0 / self.factor) for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * (self.factor + (self.last_epoch >= self.total_iters)
                           * (1 - self.factor))
                for base_lr in self.base_lrs]


class LinearLR(LRScheduler):
    """Multiply each group's lr by a factor going linearly from ``start_factor`` to
    ``end_factor`` over ``total_iters`` steps (chainable, as torch)."""

    extra_state = ("start_factor", "end_factor", "total_iters")

    def __init__(self, optimizer: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({
            "start_factor": start_factor, "end_factor": end_factor,
            "total_iters": total_iters}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        start, end = values["start_factor"], values["end_factor"]
        for name, value in (("start_factor", start), ("end_factor", end)):
            if not _is_real(value):
                raise TypeError(f"{name} must be a real number, got {_describe(value)}")
        if start > 1.0 or not start > 0:
            raise ValueError("Starting multiplicative factor expected to be greater than 0 "
                             "and less or equal to 1.")
        if end > 1.0 or not end >= 0:
            raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
        return {"start_factor": float(start), "end_factor": float(end),
                "total_iters": _int(values["total_iters"], "total_iters", low=1)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self.last_epoch == 0:
            return [group["lr"] * self.start_factor for group in self.optimizer.param_groups]
        if self._is_initial or self.last_epoch > self.total_iters:
            return _group_lrs(self.optimizer)
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


class ExponentialLR(LRScheduler):
    """Multiply each group's lr by ``gamma`` every step."""

    extra_state = ("gamma",)

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({"gamma": gamma}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        return {"gamma": _real(values["gamma"], "gamma", low=0.0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial:
            return _group_lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * self.gamma ** self.last_epoch for base_lr in self.base_lrs]


class PolynomialLR(LRScheduler):
    """Decay each group's lr by ``(1 - t / total_iters) ** power`` (chainable, as torch)."""

    extra_state = ("total_iters", "power")

    def __init__(self, optimizer: Any, total_iters: int = 5, power: float = 1.0,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({"total_iters": total_iters, "power": power}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        return {"total_iters": _int(values["total_iters"], "total_iters", low=1),
                "power": _real(values["power"], "power", low=0.0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial or self.last_epoch > self.total_iters:
            return _group_lrs(self.optimizer)
        decay_factor = ((1.0 - self.last_epoch / self.total_iters)
                        / (1.0 - (self.last_epoch - 1) / self.total_iters)) ** self.power
        return [group["lr"] * decay_factor for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self):
        return [base_lr * (1.0 - min(self.total_iters, self.last_epoch) / self.total_iters)
                ** self.power
                for base_lr in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from the initial lr to ``eta_min`` over ``T_max`` steps, in torch's
    recursive form (and on past ``T_max``, as torch: back up again)."""

    extra_state = ("T_max", "eta_min")

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.__dict__.update(self._checked_extra({"T_max": T_max, "eta_min": eta_min}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        return {"T_max": _int(values["T_max"], "T_max", low=1),
                "eta_min": _real(values["eta_min"], "eta_min", low=0.0)}

    def get_lr(self):
        self._warn_get_lr_outside_step()
        if self._is_initial:
            return _group_lrs(self.optimizer)
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


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing restarted every ``T_i`` steps, ``T_0`` first, then ``T_mult`` times
    longer each time (SGDR). ``step(epoch)`` takes a real epoch (fractions of an epoch), as
    in torch, without a warning."""

    extra_state = ("T_0", "T_i", "T_mult", "eta_min", "T_cur")

    def __init__(self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        if not _is_int(T_0) or T_0 <= 0:
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if not _is_int(T_mult) or T_mult < 1:
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        if not _is_real(eta_min):
            raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type "
                             f"{type(eta_min)}")
        last_epoch = _check_last_epoch(last_epoch)
        self.__dict__.update(self._checked_extra({
            "T_0": T_0, "T_i": T_0, "T_mult": T_mult, "eta_min": eta_min,
            "T_cur": last_epoch}))
        super().__init__(optimizer, last_epoch)

    def _checked_extra(self, values):
        T_cur = values["T_cur"]
        if not _is_real(T_cur) or not math.isfinite(T_cur) or T_cur < -1:
            raise ValueError(f"T_cur must be a finite number >= -1, got {T_cur!r}")
        return {"T_0": _int(values["T_0"], "T_0", low=1),
                "T_i": _int(values["T_i"], "T_i", low=1),
                "T_mult": _int(values["T_mult"], "T_mult", low=1),
                "eta_min": _real(values["eta_min"], "eta_min", low=0.0),
                "T_cur": int(T_cur) if _is_int(T_cur) else float(T_cur)}

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
            if not _is_real(epoch) or not math.isfinite(epoch):
                raise TypeError(f"epoch must be a finite real number, got {_describe(epoch)}")
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


class OneCycleLR(LRScheduler):
    """The 1cycle policy: lr from ``max_lr / div_factor`` up to ``max_lr`` over
    ``pct_start`` of ``total_steps``, then down to ``initial_lr / final_div_factor`` (or, with
    ``three_phase``, back to the initial lr and then down). With ``cycle_momentum``, momentum
    (``group["momentum"]``, or ``betas[0]`` for optimizers with ``betas``) moves inversely
    between ``max_momentum`` and ``base_momentum``. Not chainable.

    The per-group bounds (``max_lrs``, ``min_lrs``, ``max_momentums``, ``base_momentums``) live
    in this scheduler's state, not in the groups (flatopt refuses unknown group keys).
    """

    extra_state = ("total_steps", "pct_start", "anneal_strategy", "three_phase",
                   "div_factor", "final_div_factor", "max_lrs", "min_lrs",
                   "cycle_momentum", "use_beta1", "max_momentums", "base_momentums")

    def __init__(self, optimizer: Any, max_lr: float | list[float],
                 total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float | list[float] = 0.85,
                 max_momentum: float | list[float] = 0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        if total_steps is not None:
            if not _is_int(total_steps) or total_steps <= 0:
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            total_steps = int(total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            if not _is_int(epochs) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not _is_int(steps_per_epoch) or steps_per_epoch <= 0:
                raise ValueError(
                    f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            total_steps = int(epochs) * int(steps_per_epoch)
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        last_epoch = _check_last_epoch(last_epoch)
        cycle_momentum = _flag(cycle_momentum, "cycle_momentum")
        div_factor = _real(div_factor, "div_factor", low=0.0, low_open=True)
        final_div_factor = _real(final_div_factor, "final_div_factor", low=0.0, low_open=True)
        max_lrs = _per_group("max_lr", optimizer, max_lr)
        use_beta1 = False
        max_momentums: list | None = None
        base_momentums: list | None = None
        if cycle_momentum:
            use_beta1 = self._uses_beta1(optimizer)
            max_momentums = _per_group("max_momentum", optimizer, max_momentum)
            base_momentums = _per_group("base_momentum", optimizer, base_momentum)
        values = self._checked_extra({
            "total_steps": total_steps, "pct_start": pct_start,
            "anneal_strategy": anneal_strategy, "three_phase": three_phase,
            "div_factor": div_factor, "final_div_factor": final_div_factor,
            "max_lrs": max_lrs, "min_lrs": [m / div_factor / final_div_factor for m in max_lrs],
            "cycle_momentum": cycle_momentum, "use_beta1": use_beta1,
            "max_momentums": max_momentums, "base_momentums": base_momentums})
        if cycle_momentum:
            self._check_momentum_values(optimizer, values)
        if last_epoch != -1:  # torch's KeyError, before anything is written
            _require_initial_lr(optimizer)
        self.__dict__.update(values)
        if last_epoch == -1:
            for idx, group in enumerate(optimizer.param_groups):
                group["initial_lr"] = max_lrs[idx] / div_factor
            if cycle_momentum:
                for m_momentum, group in zip(self.max_momentums, optimizer.param_groups,
                                             strict=True):
                    if self.use_beta1:
                        group["betas"] = (m_momentum, *group["betas"][1:])
                    else:
                        group["momentum"] = m_momentum
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _uses_beta1(optimizer: Any) -> bool:
        """Whether momentum is cycled in ``betas[0]`` (torch: the optimizer's defaults have
        ``betas``) or in ``momentum``; neither is torch's ValueError."""
        defaults = getattr(optimizer, "defaults", None)
        keys = defaults if isinstance(defaults, Mapping) else \
            (optimizer.param_groups[0] if optimizer.param_groups else {})
        if "momentum" not in keys and "betas" not in keys:
            raise ValueError("optimizer must support momentum or beta1 with "
                             "`cycle_momentum` option enabled")
        return "betas" in keys

    @staticmethod
    def _phases(total_steps: int, pct_start: float, three_phase: bool) -> list[tuple]:
        """(end_step, start_lr, end_lr, start_momentum, end_momentum) per phase, as torch."""
        if three_phase:
            return [
                (float(pct_start * total_steps) - 1, "initial_lr", "max_lr",
                 "max_momentum", "base_momentum"),
                (float(2 * pct_start * total_steps) - 2, "max_lr", "initial_lr",
                 "base_momentum", "max_momentum"),
                (total_steps - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
            ]
        return [
            (float(pct_start * total_steps) - 1, "initial_lr", "max_lr",
             "max_momentum", "base_momentum"),
            (total_steps - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"),
        ]

    def _checked_extra(self, values):
        total_steps = values["total_steps"]
        if not _is_int(total_steps) or total_steps <= 0:
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
        total_steps = int(total_steps)
        pct_start = values["pct_start"]
        if not isinstance(pct_start, float) or not (0 <= pct_start <= 1):
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        pct_start = float(pct_start)
        anneal_strategy = values["anneal_strategy"]
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError("anneal_strategy must be one of 'cos' or 'linear', instead got "
                             f"{anneal_strategy}")
        three_phase = _flag(values["three_phase"], "three_phase")
        count = len(self.optimizer.param_groups) if hasattr(self, "optimizer") else None
        max_lrs = _reals(values["max_lrs"], "max_lrs", count, low=0.0)
        count = len(max_lrs)
        checked = {
            "total_steps": total_steps, "pct_start": pct_start,
            "anneal_strategy": str(anneal_strategy), "three_phase": three_phase,
            "div_factor": _real(values["div_factor"], "div_factor", low=0.0, low_open=True),
            "final_div_factor": _real(values["final_div_factor"], "final_div_factor",
                                      low=0.0, low_open=True),
            "max_lrs": max_lrs,
            "min_lrs": _reals(values["min_lrs"], "min_lrs", count, low=0.0),
            "cycle_momentum": _flag(values["cycle_momentum"], "cycle_momentum"),
            "use_beta1": _flag(values["use_beta1"], "use_beta1"),
        }
        for key, name in (("max_momentums", "max_momentum"),
                          ("base_momentums", "base_momentum")):
            if checked["cycle_momentum"]:
                checked[key] = _reals(values[key], name, count, low=0.0)
            elif values[key] is not None:
                raise ValueError(f"{key} must be None when cycle_momentum is False")
            else:
                checked[key] = None
        phases = self._phases(total_steps, pct_start, three_phase)
        self._check_phase_lengths(phases, total_steps, pct_start)
        checked["_schedule_phases"] = phases
        if checked["cycle_momentum"] and hasattr(self, "optimizer"):  # loading a state
            if checked["use_beta1"] != self._uses_beta1(self.optimizer):
                raise ValueError(
                    f"the state cycles {'betas' if checked['use_beta1'] else 'momentum'}, "
                    f"but this {type(self.optimizer).__name__} has "
                    f"{'momentum' if checked['use_beta1'] else 'betas'}")
            self._check_momentum_values(self.optimizer, checked)
        return checked

    @staticmethod
    def _check_phase_lengths(phases: list[tuple], total_steps: int, pct_start: float) -> None:
        """Refuse a zero-length phase that some step 0..total_steps falls in (torch divides
        by its length there: ZeroDivisionError)."""
        start = 0.0
        latest_end = -math.inf
        for number, phase in enumerate(phases):
            end = phase[0]
            last = number == len(phases) - 1
            low = 0 if number == 0 else max(0, math.floor(latest_end) + 1)
            high = total_steps if last else min(total_steps, math.floor(end))
            if low <= high and end == start:
                raise ValueError(
                    f"OneCycleLR: phase {number + 1} of the schedule has zero length (it starts "
                    f"and ends at step {end}) but step {low} falls in it (torch divides by "
                    f"zero there); choose pct_start ({pct_start}) and total_steps "
                    f"({total_steps}) so that every phase has a length")
            latest_end = max(latest_end, end)
            start = end

    @staticmethod
    def _check_momentum_values(optimizer: Any, values: dict) -> None:
        """Momentum values the optimizer would refuse at its next step are refused now."""
        if not isinstance(optimizer, Optimizer):
            return
        key = "betas" if values["use_beta1"] else "momentum"
        problems = []
        for number, group in enumerate(optimizer.param_groups):
            for name, momentums in (("max_momentum", values["max_momentums"]),
                                    ("base_momentum", values["base_momentums"])):
                value = momentums[number]
                candidate = dict(group)
                candidate[key] = (value, *group["betas"][1:]) if key == "betas" else value
                _, found = optimizer.schema.check_group(candidate,
                                                        describe_group(number, group))
                problems += [f"OneCycleLR {name}={value!r} would be written into {key}: {p}"
                             for p in found]
        if problems:
            raise HyperparameterError("\n".join(dict.fromkeys(problems)))

    @property
    def owned_hyperparameters(self) -> tuple[str, ...]:
        if self.cycle_momentum:
            return ("lr", "betas") if self.use_beta1 else ("lr", "momentum")
        return ("lr",)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            cos_out = math.cos(math.pi * pct) + 1
            return end + (start - end) / 2.0 * cos_out
        return (end - start) * pct + start

    def get_lr(self):
        self._warn_get_lr_outside_step()
        step_num = self.last_epoch
        if step_num > self.total_steps:
            raise ValueError(f"Tried to step {step_num} times. The specified number of total "
                             f"steps is {self.total_steps}")
        lrs, momentums = [], []
        for number, group in enumerate(self.optimizer.param_groups):
            anchors = {"initial_lr": self.base_lrs[number], "max_lr": self.max_lrs[number],
                       "min_lr": self.min_lrs[number]}
            if self.cycle_momentum:
                anchors["max_momentum"] = self.max_momentums[number]
                anchors["base_momentum"] = self.base_momentums[number]
            start_step = 0.0
            for i, (end_step, start_lr, end_lr, start_m, end_m) in \
                    enumerate(self._schedule_phases):
                if step_num <= end_step or i == len(self._schedule_phases) - 1:
                    pct = (step_num - start_step) / (end_step - start_step)
                    lrs.append(self._anneal(anchors[start_lr], anchors[end_lr], pct))
                    if self.cycle_momentum:
                        momentums.append(self._anneal(anchors[start_m], anchors[end_m], pct))
                    break
                start_step = end_step
        if self.cycle_momentum:  # torch's side effect of get_lr
            for group, momentum in zip(self.optimizer.param_groups, momentums, strict=True):
                if self.use_beta1:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        return lrs


class SequentialLR(LRScheduler):
    """Run ``schedulers`` one after another: the k-th from ``milestones[k-1]`` on. At a
    milestone the next scheduler restarts from its closed form at epoch 0, as in torch.

    Its state holds its children's states; ``owned_hyperparameters`` is their union.
    """

    def __init__(self, optimizer: Any, schedulers: list[LRScheduler], milestones: list[int],
                 last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        name = type(self).__name__
        if not isinstance(schedulers, (list, tuple)):
            raise TypeError(f"{name} takes a list of schedulers, got {_describe(schedulers)}")
        if len(schedulers) < 1:
            raise ValueError(f"{name} expects at least one scheduler, but got no scheduler.")
        for idx, scheduler in enumerate(schedulers):
            if isinstance(scheduler, ReduceLROnPlateau):
                raise ValueError(
                    f"{name} does not support `ReduceLROnPlateau` scheduler as it requires "
                    "additional kwargs to be specified when calling `step`, but got one at "
                    f"index {idx} in the given schedulers sequence.")
            if not isinstance(scheduler, LRScheduler) or not hasattr(scheduler, "optimizer"):
                raise TypeError(f"{name} at index {idx} should have `optimizer` as its "
                                f"attribute (a flatopt scheduler), got "
                                f"{type(scheduler).__name__}")
            if isinstance(scheduler, SequentialLR):
                raise ValueError(f"{name} at index {idx} is a SequentialLR: nesting is not "
                                 "supported (torch fails when switching to one); list its "
                                 "schedulers and milestones in one SequentialLR")
            if scheduler.optimizer is not optimizer:
                raise ValueError(
                    f"{name} expects all schedulers to belong to the same optimizer, but got "
                    f"scheduler {type(scheduler).__name__} at index {idx} has "
                    f"{type(scheduler.optimizer).__name__} "
                    f"{hex(id(scheduler.optimizer))}, which is different from "
                    f"{type(optimizer).__name__} {hex(id(optimizer))}.")
        if not isinstance(milestones, (list, tuple)):
            raise TypeError(f"milestones must be a list of integers, got {_describe(milestones)}")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                "Sequential Schedulers expects number of schedulers provided to be one more "
                f"than the number of milestone points, but got number of schedulers "
                f"{len(schedulers)} and the number of milestones to be equal to "
                f"{len(milestones)}")
        milestones = self._checked_milestones(milestones)
        last_epoch = _check_last_epoch(last_epoch)
        self._schedulers = list(schedulers)
        self._milestones = milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:  # back to the initial lrs
            group["lr"] = group["initial_lr"]
        for scheduler in self._schedulers:  # undo the children's initial steps
            scheduler.last_epoch -= 1
        idx = bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = self._schedulers[idx].get_last_lr()

    @staticmethod
    def _checked_milestones(milestones: Any) -> list[int]:
        checked = [_int(m, f"milestones[{i}]", low=1) for i, m in enumerate(milestones)]
        if any(b <= a for a, b in zip(checked, checked[1:])):
            raise ValueError(f"milestones must be strictly increasing, got {checked}")
        return checked

    def step(self) -> None:  # type: ignore[override]
        """Advance one step: the scheduler whose interval holds the new epoch steps (or, at a
        milestone, the next one starts from epoch 0)."""
        saved = self.last_epoch
        self.last_epoch += 1
        try:
            idx = bisect_right(self._milestones, self.last_epoch)
            scheduler = self._schedulers[idx]
            if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
                scheduler._update_lr(0)
            else:
                scheduler.step()
        except BaseException:
            self.last_epoch = saved
            raise
        self._last_lr = scheduler.get_last_lr()

    @property
    def owned_hyperparameters(self) -> tuple[str, ...]:
        keys: dict[str, None] = {}
        for scheduler in self._schedulers:
            keys.update(dict.fromkeys(scheduler.owned_hyperparameters))
        return tuple(keys)

    def _state_keys(self):
        return ("last_epoch", "_milestones", "_last_lr", "_schedulers")

    def state_dict(self) -> dict[str, Any]:
        state = {"scheduler": type(self).__name__, "last_epoch": self.last_epoch,
                 "_milestones": list(self._milestones), "_last_lr": list(self._last_lr)}
        state = _plain(state, "SequentialLR.state_dict()")
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def _checked_values(self, state):
        children = state["_schedulers"]
        if not isinstance(children, list) or len(children) != len(self._schedulers):
            raise ValueError(f"_schedulers must be a list of {len(self._schedulers)} state "
                             f"dicts (one per scheduler), got {_describe(children)}"[:300])
        milestones = state["_milestones"]
        if not isinstance(milestones, list) or len(milestones) != len(self._schedulers) - 1:
            raise ValueError(f"_milestones must be a list of {len(self._schedulers) - 1} "
                             f"integers, got {_describe(milestones)}")
        values = {
            "last_epoch": _int(state["last_epoch"], "last_epoch", low=0),
            "_milestones": self._checked_milestones(milestones),
            "_last_lr": _any_reals(state["_last_lr"], "_last_lr",
                                   len(self.optimizer.param_groups)),
        }
        staged = []
        for idx, (scheduler, child) in enumerate(zip(self._schedulers, children)):
            try:
                staged.append(scheduler._checked_state(child))
            except StateDictError as exc:
                raise StateDictError(f"SequentialLR state dict, _schedulers[{idx}]: "
                                     f"{exc}") from None
        values["_staged"] = staged
        return values

    def _apply_state(self, values):
        staged = values.pop("_staged")
        for scheduler, child_values in zip(self._schedulers, staged):
            scheduler._apply_state(child_values)
        self.__dict__.update(values)


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
        if not _is_real(factor):
            raise TypeError(f"factor must be a real number, got {_describe(factor)}")
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        _check_optimizer(optimizer)
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
        self._last_lr = _group_lrs(optimizer)
        self._reset()

    @staticmethod
    def _checked_config(values: Mapping[str, Any], count: int | None) -> dict[str, Any]:
        mode, threshold_mode = values["mode"], values["threshold_mode"]
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        factor = _real(values["factor"], "factor", low=0.0)
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        default = values["default_min_lr"]
        if default is not None:
            default = _real(default, "min_lr", low=0.0)
        return {
            "factor": factor,
            "min_lrs": _reals(values["min_lrs"], "min_lr", count if default is None else None,
                              low=0.0),
            "default_min_lr": default,
            "patience": _int(values["patience"], "patience", low=0),
            "cooldown": _int(values["cooldown"], "cooldown", low=0),
            "eps": _real(values["eps"], "eps", low=0.0),
            "mode": str(mode), "threshold": _real(values["threshold"], "threshold"),
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
            raise TypeError(f"metrics must be a number, got {_describe(metrics)}")
        current = float(metrics)
        if epoch is None:
            epoch = self.last_epoch + 1
        else:
            epoch = _int(epoch, "epoch", low=0)
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
        self._last_lr = _group_lrs(self.optimizer)

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
        return _plain(state, "ReduceLROnPlateau.state_dict()")

    def _checked_values(self, state):
        values = self._checked_config(state, None)
        best = state["best"]
        if not _is_real(best) or math.isnan(best):
            raise ValueError(f"best must be a number (infinite allowed), got {_describe(best)}")
        values.update({
            "last_epoch": _int(state["last_epoch"], "last_epoch", low=0),
            "_last_lr": _any_reals(state["_last_lr"], "_last_lr", None),
            "best": float(best),
            "cooldown_counter": _int(state["cooldown_counter"], "cooldown_counter", low=0),
            "num_bad_epochs": _int(state["num_bad_epochs"], "num_bad_epochs", low=0),
        })
        count = len(self.optimizer.param_groups)
        if values["default_min_lr"] is None and len(values["min_lrs"]) != count:
            raise ValueError(f"min_lrs has {len(values['min_lrs'])} values, the optimizer "
                             f"has {count} param groups")
        return values
