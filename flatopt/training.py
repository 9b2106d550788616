"""Training-loop tools around the step: gradient clipping, dynamic loss scaling, an
exponential moving average of the parameters. Each works on an optimizer's flat buffers in
fused kernels; clipping and loss-scale removal can also ride inside ``opt.step`` itself
(``step(max_grad_norm=..., grad_scale=..., skip_nonfinite=...)``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Iterator, Mapping

import numpy as np

from . import _stepping
from ._stepping import StepResult
from .errors import GradientError, HyperparameterError, StateDictError
from .lookahead import Lookahead
from .kernels.threads import check_policy
from .optimizer import Optimizer
from .schema import MAX_COUNT


def _is_flag(value: Any) -> bool:
    """Whether ``value`` is True or False (a NumPy bool too), not merely truthy: ``bool()``
    would turn the string "false" into True."""
    return isinstance(value, (bool, np.bool_))


def _optimizer(opt: Any, who: str) -> Optimizer:
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{who} takes a flatopt optimizer, got {type(opt).__name__}")
    return opt


# ----------------------------------------------------------------------------- clipping
def clip_grad_norm(opt: Optimizer, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over every present gradient of ``opt``: the total
    ``norm_type``-norm of the present gradients (missing ones are excluded), and every present
    gradient multiplied in place by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm
    before clipping. One parallel reading pass per buffer, then one scaling pass.
    ``error_if_nonfinite`` raises :class:`GradientError` (torch: RuntimeError) on a NaN or
    infinite norm, before anything changes; otherwise NaN propagates as in torch.

    To clip inside the update's own pass over the gradients, use
    ``opt.step(max_grad_norm=...)`` instead."""
    opt = _optimizer(opt, "clip_grad_norm()")
    if opt.sharding is not None:  # comm=: the average exists only inside step()
        opt.sharding.refuse_before_averaging("clip_grad_norm()")
    max_norm = _stepping.positive("max_norm", max_norm)
    with opt.lock:
        norm, bad = _stepping.total_norm(opt.gradient_totals, norm_type)
        if error_if_nonfinite and (bad or not math.isfinite(norm)):
            raise GradientError(f"the total norm of order {norm_type} of the gradients is "
                                "non-finite, so it cannot be clipped; nothing was changed")
        coefficient = min(max_norm / (norm + _stepping.CLIP_EPSILON), 1.0)
        if coefficient != 1.0:
            scale_gradients(opt, coefficient)
        return norm


def scale_gradients(opt: Optimizer, factor: float) -> None:
    """Multiply every present gradient of ``opt`` in place by ``factor`` (rounded once to
    each buffer's dtype)."""
    check_policy()  # FLATOPT_PARALLEL: refused before the first buffer changes
    with opt.lock:
        opt.buffer_device.scale_gradients(factor)


# ----------------------------------------------------------------------------- loss scaling
class GradScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rule and state.

    ``scaler.scale(loss)`` multiplies the loss by the current scale before backward;
    ``scaler.step(opt, ...)`` steps with the scale removed inside the update
    (``grad_scale=``) and skips the whole step when a gradient is NaN or infinite;
    ``scaler.update()`` then backs the scale off after an overflow (``* backoff_factor``) or
    grows it after ``growth_interval`` clean steps (``* growth_factor``). Other ``step``
    options (``max_grad_norm=`` clips the unscaled gradients) pass through.
    ``state_dict()`` has torch's keys; the scale is kept as a float32 value, as torch keeps it.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        if not (isinstance(growth_factor, numbers.Real) and 1.0 < growth_factor < math.inf):
            # an infinite factor would grow the scale to inf and skip every step after
            raise HyperparameterError(f"growth_factor must be finite and > 1, got "
                                      f"{growth_factor!r}")
        if not (isinstance(backoff_factor, numbers.Real) and 0.0 < backoff_factor < 1.0):
            raise HyperparameterError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or not 0 < growth_interval <= MAX_COUNT:
            raise HyperparameterError(f"growth_interval must be an int in [1, {MAX_COUNT}], "
                                      f"got {growth_interval!r}")
        self._scale = float(np.float32(_stepping.positive("init_scale", init_scale)))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._enabled = bool(enabled)
        self._found_inf: bool | None = None

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, loss: Any) -> Any:
        """``loss`` times the current scale (a number or an array)."""
        return loss * self._scale if self._enabled else loss

    def step(self, opt: Optimizer, grads: Mapping[str, Any] | None = None,
             **options: Any) -> StepResult:
        """``opt.step`` with the scale removed and non-finite gradients skipped (``opt`` is
        an optimizer or a :class:`~flatopt.Lookahead` over one, as torch's takes timm's)."""
        if not isinstance(opt, Lookahead):
            opt = _optimizer(opt, "GradScaler.step()")
        if not self._enabled:
            return opt.step(grads, **options)
        result = opt.step(grads, grad_scale=self._scale, skip_nonfinite=True, **options)
        self._found_inf = bool(result.nonfinite)
        return result

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after ``step`` (or set it to ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(np.float32(_stepping.positive("new_scale", new_scale)))
        elif self._found_inf is None:
            raise RuntimeError("GradScaler.update() called without a step since the last update")
        elif self._found_inf:
            self._scale = float(np.float32(self._scale) * np.float32(self._backoff_factor))
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale = float(np.float32(self._scale) * np.float32(self._growth_factor))
                self._growth_tracker = 0
        self._found_inf = None

    def state_dict(self) -> dict[str, Any]:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not self._enabled:
            return
        expected = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                    "_growth_tracker"}
        if not isinstance(state, Mapping) or set(state) != expected:
            raise StateDictError(f"a GradScaler state dict has the keys {sorted(expected)}, "
                                 f"got {sorted(state) if isinstance(state, Mapping) else state!r}")
        restored = GradScaler(state["scale"], state["growth_factor"], state["backoff_factor"],
                              state["growth_interval"])
        tracker = state["_growth_tracker"]
        # the clean steps since the scale last changed: it grows (and this restarts) when
        # they reach growth_interval, so a step never leaves it there
        if isinstance(tracker, bool) or not isinstance(tracker, int) \
                or not 0 <= tracker < restored._growth_interval:
            raise StateDictError(f"_growth_tracker must be an int in [0, growth_interval), "
                                 f"got {tracker!r}")
        self.__dict__.update(restored.__dict__)
        self._growth_tracker = tracker


# ----------------------------------------------------------------------------- EMA
class EMA:
    """An exponential moving average of an optimizer's parameters, kept in flat buffers
    parallel to its parameter buffers and updated by one fused kernel per buffer::

        average = lerp(average, p, 1 - decay_t)        decay_t = decay, or with warmup
                                                         min(decay, (1 + t) / (10 + t))

    where ``t`` counts the updates (torch's ``lerp``, as ``swa_utils.get_ema_multi_avg_fn``
    uses). ``ema.params[path]`` are views of the averages; ``with ema.swapped(): ...`` puts
    the averages into the optimizer's parameters for evaluation and restores them after.
    ``state_dict()``/``load_state_dict()`` hold the settings, the count and one array per
    parameter path, to save with a checkpoint's extra arrays.
    """

    def __init__(self, opt: Optimizer, decay: float = 0.999, *, warmup: bool = False):
        self.opt = _optimizer(opt, "EMA()")
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) \
                or not 0.0 <= float(decay) < 1.0:
            raise HyperparameterError(f"EMA decay must be in [0, 1), got {decay!r}")
        if not _is_flag(warmup):
            raise HyperparameterError(f"EMA warmup must be True or False, got {warmup!r}")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.num_updates = 0
        # on a CUDA optimizer the averages are device arrays too, updated by a device kernel
        self._device = opt.buffer_device
        with opt.lock:
            self.buffers = [self._copy(self._live(buf)) for buf in opt.buffers]
        self.params = {info.path: self.buffers[info.buffer][info.offset:info.offset + info.size]
                       .reshape(info.shape) for info in opt.index}

    def _live(self, buf) -> Any:
        """The buffer's parameters as they are computed, where they live: a 16-bit buffer's
        master weights, or its values in float32 (the average of a 16-bit parameter is kept
        in float32)."""
        return self._device.float_values(buf)

    def _copy(self, flat) -> Any:
        return self._device.copy_of(flat)

    def _copy_into(self, target, source) -> None:
        self._device.copy_into(target, source)

    def current_decay(self) -> float:
        t = self.num_updates
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    def update(self) -> None:
        """Move every average toward the optimizer's current parameters."""
        self._check_layout()
        check_policy()  # FLATOPT_PARALLEL: refused before the first average changes
        weight = 1.0 - self.current_decay()
        with self.opt.lock:
            for average, buf in zip(self.buffers, self.opt.buffers):
                w = float(buf.dtype.type(weight))
                from_end = not abs(w) < 0.5
                weight_t = buf.dtype.type(w - 1.0 if from_end else w)
                self._device.lerp(average, self._live(buf), weight_t, from_end)
        self.num_updates += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block the optimizer's parameters are the averages (for evaluation);
        afterwards they are what they were."""
        self._check_layout()
        with self.opt.lock:
            device = self._device
            saved = [self._copy(device.flat(buf)[0]) for buf in self.opt.buffers]
            masters = [None if device.master_of(buf) is None else
                       self._copy(device.master_of(buf)) for buf in self.opt.buffers]
            try:
                for average, buf in zip(self.buffers, self.opt.buffers):
                    if buf.params.dtype != buf.dtype:  # 16-bit: rounded to nearest
                        device.put_rounded(buf, average)
                    else:
                        self._copy_into(device.flat(buf)[0], average)
                yield
            finally:
                for kept, master, buf in zip(saved, masters, self.opt.buffers):
                    self._copy_into(device.flat(buf)[0], kept)
                    if master is not None:
                        self._copy_into(device.master_of(buf), master)

    def _check_layout(self) -> None:
        if len(self.buffers) != len(self.opt.buffers):
            raise HyperparameterError("the optimizer gained a parameter group after the EMA was "
                                      "made; make a new EMA (or load its state into one)")

    def state_dict(self) -> dict[str, Any]:
        """Settings, count and the averages by path (copies)."""
        self._check_layout()   # a group added since would be missing from the averages
        return {"decay": self.decay, "warmup": self.warmup, "num_updates": self.num_updates,
                "averages": {path: self._device.to_host(view)
                             for path, view in self.params.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; every path must match, checked before anything
        changes."""
        problems = []
        averages = state.get("averages") if isinstance(state, Mapping) else None
        if not isinstance(averages, Mapping):
            raise StateDictError("an EMA state dict needs 'averages' {path: array}")
        for path, view in self.params.items():
            value = averages.get(path)
            if not isinstance(value, np.ndarray) or value.shape != view.shape \
                    or value.dtype != view.dtype:
                problems.append(f"EMA average for {path!r}: expected {view.shape} "
                                f"{view.dtype}, got {getattr(value, 'shape', value)!r}")
        problems += [f"EMA average for unknown parameter {path!r}" for path in averages
                     if path not in self.params]
        count = state.get("num_updates")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            problems.append(f"EMA num_updates must be an int in [0, {MAX_COUNT}], got "
                            f"{count!r}")
        decay = state.get("decay")
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) \
                or not 0.0 <= decay < 1.0:
            problems.append(f"EMA decay must be in [0, 1), got {decay!r}")
        warmup = state.get("warmup", False)
        if not _is_flag(warmup):
            problems.append(f"EMA warmup must be True or False, got {warmup!r}")
        if problems:
            raise StateDictError("\n".join(problems))
        for path, view in self.params.items():
            self._device.upload(view, averages[path])
        self.decay, self.num_updates, self.warmup = float(decay), count, bool(warmup)
