"""What ``Optimizer.step`` does besides the update: gradient norms and non-finite checks over
the present gradients (one parallel pass per buffer), clipping and loss-scale removal folded
into the update as one gradient multiplier, and the result a step reports."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from .errors import GradientError, HyperparameterError
from .kernels import cpu


class StepResult(NamedTuple):
    """What one ``step()`` did. ``grad_norm`` is the total norm of the present gradients
    (loss scale removed, before clipping) when clipping asked for it; ``nonfinite`` whether one
    of them held NaN or infinity, when that was checked; ``skipped`` whether the whole step was
    skipped for it (``skip_nonfinite=True``: no parameter, state or step count changed)."""

    skipped: bool = False
    grad_norm: float | None = None
    nonfinite: bool | None = None


NOT_CHECKED = StepResult()

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm
CLIP_EPSILON = 1e-6


def _positive(name: str, value: Any, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HyperparameterError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not (number > 0) or (math.isinf(number) and not allow_inf):
        raise HyperparameterError(f"{name} must be a {'' if allow_inf else 'finite '}number > 0,"
                                  f" got {value!r}")
    return number


def norm_mode(norm_type: Any) -> tuple[int, float]:
    """The reduction for a p-norm: (mode, p)."""
    p = _positive("norm_type", norm_type, allow_inf=True)
    if math.isinf(p):
        return cpu.MAX_ABS, p
    return (cpu.SUM_SQUARES, 2.0) if p == 2.0 else (cpu.SUM_POWERS, p)


def reduce_present(opt, mode: int, power: float) -> tuple[float, int]:
    """(sum or max over every buffer, non-finite count) of the present gradients."""
    if opt._device is not None:
        return opt._device.reduce_present(opt, mode, power)
    total, bad = 0.0, 0
    for buf in opt.buffers:
        if not buf.chunk_first.size:
            continue
        value, count = cpu.reduce_gradients(
            buf.length, buf.grads, buf.present, buf.offsets, buf.sizes, buf.chunk_first, buf.chunk_size,
            power, mode)
        bad += int(count)
        if mode == cpu.MAX_ABS:
            total = value if not (value <= total) else total
        else:
            total += value
    return total, bad


def total_norm(opt, norm_type: Any, reduce=reduce_present) -> tuple[float, int]:
    """The p-norm of all present gradients (torch's norm of per-tensor norms), and how many
    values are NaN or infinite. ``reduce``: reduce_present, or a distributed one."""
    mode, p = norm_mode(norm_type)
    value, bad = reduce(opt, mode, p)
    if mode == cpu.SUM_SQUARES:
        value = math.sqrt(value)
    elif mode == cpu.SUM_POWERS:
        value = value ** (1.0 / p)
    return value, bad


def gradient_multiplier(opt, *, max_grad_norm, norm_type, grad_scale, skip_nonfinite,
                        error_if_nonfinite, reduce=reduce_present) -> tuple[float, StepResult]:
    """The factor every present gradient is multiplied by inside this step, and the result so
    far (``skipped`` set when the step must not happen)."""
    inverse_scale = 1.0 if grad_scale is None else 1.0 / _positive("grad_scale", grad_scale)
    if max_grad_norm is None and not skip_nonfinite and not error_if_nonfinite:
        return inverse_scale, NOT_CHECKED
    if max_grad_norm is None:
        _, bad = reduce(opt, cpu.COUNT_NONFINITE, 0.0)
        norm = None
    else:
        max_norm = _positive("max_grad_norm", max_grad_norm)
        norm, bad = total_norm(opt, norm_type, reduce)
        norm *= inverse_scale
    if bad and error_if_nonfinite:
        raise GradientError(f"{bad} gradient value(s) are NaN or infinite, so the gradient norm "
                            "cannot be clipped; nothing was changed (pass skip_nonfinite=True "
                            "to skip such steps, as loss scaling does)")
    if bad and skip_nonfinite:
        return inverse_scale, StepResult(True, norm, True)
    multiplier = inverse_scale
    if max_grad_norm is not None:
        multiplier *= min(max_norm / (norm + CLIP_EPSILON), 1.0)
    return multiplier, StepResult(False, norm, bool(bad))
