"""Cycling momentum alongside the lr (OneCycleLR, CyclicLR): in ``group["momentum"]``, or in
``betas[0]`` for optimizers with ``betas``, as torch does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import HyperparameterError
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
