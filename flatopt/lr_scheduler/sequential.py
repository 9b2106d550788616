"""SequentialLR: child schedulers in turn, switching at milestones."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from ..errors import StateDictError
from ._checks import (_any_reals, _check_last_epoch,
                      _check_optimizer, _describe, _int, _plain)
from .base import LRScheduler
from .plateau import ReduceLROnPlateau


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
