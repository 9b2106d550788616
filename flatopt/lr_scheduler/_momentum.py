"""Cycling momentum alongside the lr (OneCycleLR, CyclicLR): in ``group["momentum"]``, or in
``betas[0]`` for optimizers with ``betas``, as torch does; and the start of a cycle that both
constructors share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import HyperparameterError
from ._checks import reals, require_initial_lr
from ..optimizer import Optimizer
from ..schema import describe_group


def uses_beta1(optimizer: Any) -> bool:
    """Whether momentum is cycled in ``betas[0]`` (torch: the optimizer's defaults have
    ``betas``) or in ``momentum``; neither is torch's ValueError."""
    defaults = getattr(optimizer, "defaults", None)
    keys = defaults if isinstance(defaults, Mapping) else \
        (optimizer.param_groups[0] if optimizer.param_groups else {})
    if "momentum" not in keys and "betas" not in keys:
        raise ValueError("optimizer must support momentum or beta1 with "
                         "`cycle_momentum` option enabled")
    return "betas" in keys


def check_momentum_values(who: str, optimizer: Any, use_beta1: bool,
                          bounds: Mapping[str, list]) -> None:
    """Momentum values (``bounds``: name -> one per group) the optimizer would refuse at its
    next step are refused now, naming the scheduler ``who``."""
    if not isinstance(optimizer, Optimizer):
        return
    key = "betas" if use_beta1 else "momentum"
    problems = []
    for number, group in enumerate(optimizer.param_groups):
        for name, momentums in bounds.items():
            value = momentums[number]
            candidate = dict(group)
            candidate[key] = (value, *group["betas"][1:]) if use_beta1 else value
            _, found = optimizer.schema.check_group(candidate, describe_group(number, group))
            problems += [f"{who} {name}={value!r} would be written into {key}: {p}"
                         for p in found]
    if problems:
        raise HyperparameterError("\n".join(dict.fromkeys(problems)))


def write_momentums(optimizer: Any, momentums: list, use_beta1: bool) -> None:
    """One momentum per group into ``momentum``, or into ``betas[0]``."""
    for group, momentum in zip(optimizer.param_groups, momentums, strict=True):
        if use_beta1:
            group["betas"] = (momentum, *group["betas"][1:])
        else:
            group["momentum"] = momentum


def checked_bounds(who: str, optimizer: Any, values: Mapping[str, Any], checked: dict,
                   count: int, loading: bool) -> None:
    """Check a saved or given ``max_momentums``/``base_momentums`` into ``checked`` (which
    holds ``cycle_momentum`` and ``use_beta1``): per-group numbers >= 0 when momentum cycles,
    else None; when ``loading``, the state must cycle what this optimizer has, with values it
    accepts."""
    for key in ("max_momentums", "base_momentums"):
        if checked["cycle_momentum"]:
            checked[key] = reals(values[key], key[:-1], count, low=0.0)
        elif values[key] is not None:
            raise ValueError(f"{key} must be None when cycle_momentum is False")
        else:
            checked[key] = None
    if checked["cycle_momentum"] and loading:
        if checked["use_beta1"] != uses_beta1(optimizer):
            raise ValueError(
                f"the state cycles {'betas' if checked['use_beta1'] else 'momentum'}, but "
                f"this {type(optimizer).__name__} has "
                f"{'momentum' if checked['use_beta1'] else 'betas'}")
        check_bounds(who, optimizer, checked)


def check_bounds(who: str, optimizer: Any, values: Mapping[str, Any]) -> None:
    """:func:`check_momentum_values` for a scheduler's ``max_momentums``/``base_momentums``."""
    check_momentum_values(who, optimizer, values["use_beta1"],
                          {"max_momentum": values["max_momentums"],
                           "base_momentum": values["base_momentums"]})


def start_cycle(scheduler: Any, who: str, optimizer: Any, values: Mapping[str, Any],
                last_epoch: int, lr_key: str, lrs: list) -> None:
    """Set a cycling scheduler's checked ``values`` as its attributes, as OneCycleLR's and
    CyclicLR's constructors do: refused first, before anything is written, are momentum
    bounds the optimizer would refuse and a resume (``last_epoch`` != -1) without
    ``initial_lr``; a fresh start then writes ``lrs`` (one per group) into ``group[lr_key]``
    and, when momentum cycles, ``max_momentums`` as the groups' momentum."""
    if values["cycle_momentum"]:
        check_bounds(who, optimizer, values)
    if last_epoch != -1:  # torch's KeyError, before anything is written
        require_initial_lr(optimizer)
    vars(scheduler).update(values)
    if last_epoch == -1:
        for lr, group in zip(lrs, optimizer.param_groups, strict=True):
            group[lr_key] = lr
        if values["cycle_momentum"]:
            write_momentums(optimizer, values["max_momentums"], values["use_beta1"])
