"""What ``Optimizer.step`` does besides the update: gradient norms and non-finite checks over
the present gradients (one parallel pass per buffer), clipping and loss-scale removal folded
into the update as one gradient multiplier, and the result a step reports."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from .errors import GradientError, HyperparameterError, StepLimitError
from .kernels import COUNT_NONFINITE, MAX_ABS, SUM_POWERS, SUM_SQUARES
from .schema import MAX_STEP


class StepResult(NamedTuple):
    """What one ``step()`` did. ``grad_norm`` is the total norm of the present gradients
    (loss scale removed, before clipping) when clipping asked for it; ``nonfinite`` whether one
    of them held NaN or infinity, when that was checked (clipping, ``skip_nonfinite``,
    ``error_if_nonfinite``; None otherwise); ``skipped`` whether the whole step was
    skipped for it (``skip_nonfinite=True``: no parameter, state or step count changed)."""

    skipped: bool = False
    grad_norm: float | None = None
    nonfinite: bool | None = None


NOT_CHECKED = StepResult()

NONFINITE_WARNING = (
    "a gradient holds NaN or infinity and the step went ahead (torch's semantics): the "
    "parameters it updated (with max_grad_norm, all of them) may hold NaN now. Pass "
    "skip_nonfinite=True to skip such steps or error_if_nonfinite=True to raise; "
    "StepResult.nonfinite reports them. (Said once per optimizer.)")

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm
CLIP_EPSILON = 1e-6


def positive(name: str, value: Any, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HyperparameterError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not (number > 0) or (math.isinf(number) and not allow_inf):
        raise HyperparameterError(f"{name} must be a {'' if allow_inf else 'finite '}number > 0,"
                                  f" got {value!r}")
    return number


def check_counters(opt, settings: list) -> None:
    """Refuse, before anything changes, a step that would take a count past ``MAX_STEP``
    (the largest that loads and saves accept, so a loaded one is never stuck half-stepped): a
    present parameter's step count (an integer column bounded by it), a group's step count
    (integer group state: schedule-free's and Prodigy's ``k``, AdEMAMix's ``step``, each
    advanced by every step), a reduced-precision buffer's ``draws``."""
    problems = []
    for number, values in enumerate(settings):
        for key in opt.schema.group_state:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= MAX_STEP:
                problems.append(f"param group {number}: {key} is {value}")
    counts = [name for name, column in opt.schema.columns.items()
              if not column.is_float and column.high == MAX_STEP]
    for buf in opt.buffers:
        if not buf.present.any():
            continue
        for name in counts:
            column = buf.columns[name]
            if column.size and column.max() >= MAX_STEP:  # the cheap test first
                full = (column >= MAX_STEP) & (buf.present != 0)
                if full.any():
                    problems.append(f"{buf.paths[int(full.argmax())]!r}: {name} is "
                                    f"{int(column[full.argmax()])}")
        if buf.coded and buf.draws >= MAX_STEP:
            problems.append(f"param group {buf.group}: its buffer of {buf.paths[0]!r} has "
                            f"drawn {buf.draws} rounding streams")
    if problems:
        raise StepLimitError(f"cannot step: a count is at {MAX_STEP}, the largest flatopt "
                             "keeps (2**53); nothing was changed: " + "; ".join(problems[:20]))


def norm_mode(norm_type: Any) -> tuple[int, float]:
    """The reduction for a p-norm: (mode, p)."""
    p = positive("norm_type", norm_type, allow_inf=True)
    if math.isinf(p):
        return MAX_ABS, p
    return (SUM_SQUARES, 2.0) if p == 2.0 else (SUM_POWERS, p)


def total_norm(reduce, norm_type: Any) -> tuple[float, int]:
    """The p-norm of all present gradients (torch's norm of per-tensor norms), and how many
    values are NaN or infinite. ``reduce(mode, power)``: the gradient totals of the device
    (``Optimizer.gradient_totals``), or of every rank (``Sharding.reduce_present``)."""
    mode, p = norm_mode(norm_type)
    value, bad = reduce(mode, p)
    if mode == SUM_SQUARES:
        value = math.sqrt(value)
    elif mode == SUM_POWERS:
        value = value ** (1.0 / p)
    return value, bad


def gradient_multiplier(reduce, *, max_grad_norm, norm_type, grad_scale, skip_nonfinite,
                        error_if_nonfinite) -> tuple[float, StepResult]:
    """The factor every present gradient is multiplied by inside this step, and the result so
    far (``skipped`` set when the step must not happen); ``reduce`` as for
    :func:`total_norm`. A step without these options reads the gradients no extra time (so
    its ``nonfinite`` is None, and it gives no non-finite warning)."""
    inverse_scale = 1.0 if grad_scale is None else 1.0 / positive("grad_scale", grad_scale)
    if max_grad_norm is None and not (skip_nonfinite or error_if_nonfinite):
        return inverse_scale, NOT_CHECKED
    if max_grad_norm is None:
        _, bad = reduce(COUNT_NONFINITE, 0.0)
        norm = None
    else:
        max_norm = positive("max_grad_norm", max_grad_norm)
        norm, bad = total_norm(reduce, norm_type)
        norm *= inverse_scale
    if bad and error_if_nonfinite:
        consequence = ("so the gradient norm cannot be clipped" if max_grad_norm is not None
                       else "and error_if_nonfinite=True refuses them")
        raise GradientError(f"{bad} gradient value(s) are NaN or infinite, {consequence}; "
                            "nothing was changed (pass skip_nonfinite=True to skip such "
                            "steps, as loss scaling does)")
    if bad and skip_nonfinite:
        return inverse_scale, StepResult(True, norm, True)
    multiplier = inverse_scale
    if max_grad_norm is not None:
        multiplier *= min(max_norm / (norm + CLIP_EPSILON), 1.0)
    return multiplier, StepResult(False, norm, bool(bad))
