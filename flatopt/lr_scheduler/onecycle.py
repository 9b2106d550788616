"""OneCycleLR: the 1cycle policy, cycling the learning rate and momentum."""

from __future__ import annotations

import math
from typing import Any

from ._checks import check_last_epoch, check_optimizer, flag, is_int, per_group, real, reals
from ._momentum import checked_bounds, start_cycle, uses_beta1, write_momentums
from .base import LRScheduler


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
        check_optimizer(optimizer)
        if total_steps is not None:
            if not is_int(total_steps) or total_steps <= 0:
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            total_steps = int(total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            if not is_int(epochs) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not is_int(steps_per_epoch) or steps_per_epoch <= 0:
                raise ValueError(
                    f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            total_steps = int(epochs) * int(steps_per_epoch)
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        last_epoch = check_last_epoch(last_epoch)
        cycle_momentum = flag(cycle_momentum, "cycle_momentum")
        div_factor = real(div_factor, "div_factor", low=0.0, low_open=True)
        final_div_factor = real(final_div_factor, "final_div_factor", low=0.0, low_open=True)
        max_lrs = per_group("max_lr", optimizer, max_lr)
        use_beta1 = False
        max_momentums: list | None = None
        base_momentums: list | None = None
        if cycle_momentum:
            use_beta1 = uses_beta1(optimizer)
            max_momentums = per_group("max_momentum", optimizer, max_momentum)
            base_momentums = per_group("base_momentum", optimizer, base_momentum)
        values = self._checked_extra({
            "total_steps": total_steps, "pct_start": pct_start,
            "anneal_strategy": anneal_strategy, "three_phase": three_phase,
            "div_factor": div_factor, "final_div_factor": final_div_factor,
            "max_lrs": max_lrs, "min_lrs": [m / div_factor / final_div_factor for m in max_lrs],
            "cycle_momentum": cycle_momentum, "use_beta1": use_beta1,
            "max_momentums": max_momentums, "base_momentums": base_momentums})
        start_cycle(self, "OneCycleLR", optimizer, values, last_epoch, "initial_lr",
                    [max_lr / div_factor for max_lr in max_lrs])
        super().__init__(optimizer, last_epoch)

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
        if not is_int(total_steps) or total_steps <= 0:
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
        three_phase = flag(values["three_phase"], "three_phase")
        count = len(self.optimizer.param_groups) if hasattr(self, "optimizer") else None
        max_lrs = reals(values["max_lrs"], "max_lrs", count, low=0.0)
        count = len(max_lrs)
        checked = {
            "total_steps": total_steps, "pct_start": pct_start,
            "anneal_strategy": str(anneal_strategy), "three_phase": three_phase,
            "div_factor": real(values["div_factor"], "div_factor", low=0.0, low_open=True),
            "final_div_factor": real(values["final_div_factor"], "final_div_factor",
                                      low=0.0, low_open=True),
            "max_lrs": max_lrs,
            "min_lrs": reals(values["min_lrs"], "min_lrs", count, low=0.0),
            "cycle_momentum": flag(values["cycle_momentum"], "cycle_momentum"),
            "use_beta1": flag(values["use_beta1"], "use_beta1"),
        }
        phases = self._phases(total_steps, pct_start, three_phase)
        self._check_phase_lengths(phases, total_steps, pct_start)
        checked["_schedule_phases"] = phases
        checked_bounds("OneCycleLR", getattr(self, "optimizer", None), values, checked,
                       count, loading=hasattr(self, "optimizer"))
        return checked

    def _checked_values(self, state):
        values = super()._checked_values(state)
        if values["last_epoch"] > values["total_steps"]:
            # the step to it would have failed ("Tried to step ..."): no run reaches it
            raise ValueError(f"last_epoch {values['last_epoch']} is past the schedule's end "
                             f"(total_steps {values['total_steps']})")
        return values

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
            write_momentums(self.optimizer, momentums, self.use_beta1)
        return lrs
