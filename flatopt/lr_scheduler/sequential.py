"""Schedulers over other schedulers: SequentialLR (children in turn, switching at milestones)
and ChainedScheduler (every child at every step, each on what the previous one wrote)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from ..errors import StateDictError
from ._checks import (any_reals, check_last_epoch, check_optimizer, describe,
                      group_lrs, integer, plain)
from .base import LRScheduler
from .plateau import ReduceLROnPlateau


def _check_children(name: str, optimizer: Any, schedulers: Any) -> None:
    """torch's checks of a composite's children (its messages), and flatopt's own."""
    if not isinstance(schedulers, (list, tuple)):
        raise TypeError(f"{name} takes a list of schedulers, got {describe(schedulers)}")
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
        if isinstance(scheduler, SequentialLR) and name == "SequentialLR":
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


class _Composite(LRScheduler):
    """A scheduler whose state holds its children's (``_schedulers``), checked together and
    applied together; ``owned_hyperparameters`` is their union."""

    _own_state: tuple[str, ...] = ()

    @property
    def owned_hyperparameters(self) -> tuple[str, ...]:
        keys: dict[str, None] = {}
        for scheduler in self._schedulers:
            keys.update(dict.fromkeys(scheduler.owned_hyperparameters))
        return tuple(keys)

    def _state_keys(self):
        return (*self._own_state, "_schedulers")

    def _check_group_count(self) -> None:
        for scheduler in self._schedulers:
            scheduler._check_group_count()

    def state_dict(self) -> dict[str, Any]:
        self._check_group_count()
        state = {"scheduler": type(self).__name__,
                 **{key: getattr(self, key) for key in self._own_state}}
        state = plain(state, f"{type(self).__name__}.state_dict()")
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def _staged_children(self, children: Any) -> list:
        if not isinstance(children, list) or len(children) != len(self._schedulers):
            raise ValueError(f"_schedulers must be a list of {len(self._schedulers)} state "
                             f"dicts (one per scheduler), got {describe(children)}"[:300])
        staged = []
        for idx, (scheduler, child) in enumerate(zip(self._schedulers, children)):
            try:
                staged.append(scheduler._checked_state(child))
            except StateDictError as exc:
                raise StateDictError(f"{type(self).__name__} state dict, _schedulers[{idx}]: "
                                     f"{exc}") from None
        return staged

    def _apply_state(self, values):
        staged = values.pop("_staged")
        for scheduler, child_values in zip(self._schedulers, staged):
            scheduler._apply_state(child_values)
        self.__dict__.update(values)


class SequentialLR(_Composite):
    """Run ``schedulers`` one after another: the k-th from ``milestones[k-1]`` on. At a
    milestone the next scheduler restarts from its closed form at epoch 0, as in torch.

    Its state holds its children's states; ``owned_hyperparameters`` is their union.
    """

    _own_state = ("last_epoch", "_milestones", "_last_lr")

    def __init__(self, optimizer: Any, schedulers: list[LRScheduler], milestones: list[int],
                 last_epoch: int = -1) -> None:
        check_optimizer(optimizer)
        name = type(self).__name__
        _check_children(name, optimizer, schedulers)
        if not isinstance(milestones, (list, tuple)):
            raise TypeError(f"milestones must be a list of integers, got {describe(milestones)}")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                "Sequential Schedulers expects number of schedulers provided to be one more "
                f"than the number of milestone points, but got number of schedulers "
                f"{len(schedulers)} and the number of milestones to be equal to "
                f"{len(milestones)}")
        milestones = self._checked_milestones(milestones)
        last_epoch = check_last_epoch(last_epoch)
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
        checked = [integer(m, f"milestones[{i}]", low=1) for i, m in enumerate(milestones)]
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

    def _checked_values(self, state):
        milestones = state["_milestones"]
        if not isinstance(milestones, list) or len(milestones) != len(self._schedulers) - 1:
            raise ValueError(f"_milestones must be a list of {len(self._schedulers) - 1} "
                             f"integers, got {describe(milestones)}")
        staged = self._staged_children(state["_schedulers"])
        return {
            "last_epoch": integer(state["last_epoch"], "last_epoch", low=0),
            "_milestones": self._checked_milestones(milestones),
            "_last_lr": any_reals(state["_last_lr"], "_last_lr",
                                   len(self.optimizer.param_groups)),
            "_staged": staged,
        }


class ChainedScheduler(_Composite):
    """Step every scheduler in ``schedulers`` at every step, in order, each on the lrs the
    previous one wrote (torch 2.13's ``ChainedScheduler(schedulers, optimizer=None)``).

    Its state is ``_last_lr`` and its children's states, as torch's. Before stepping any child
    it checks every child's group count, so that common failure changes nothing; a child that
    fails for another reason (``OneCycleLR`` stepped past ``total_steps``) leaves the children
    before it stepped, as in torch.
    """

    _own_state = ("_last_lr",)

    def __init__(self, schedulers: list[LRScheduler], optimizer: Any = None) -> None:
        name = type(self).__name__
        if not isinstance(schedulers, (list, tuple)) or not schedulers:
            _check_children(name, optimizer, schedulers)  # raises torch's error
        if optimizer is None:
            optimizer = getattr(schedulers[0], "optimizer", None)
        check_optimizer(optimizer)
        _check_children(name, optimizer, schedulers)
        self._schedulers = list(schedulers)
        self.optimizer = optimizer
        self._last_lr = group_lrs(optimizer)

    def step(self) -> None:  # type: ignore[override]
        self._check_group_count()
        for scheduler in self._schedulers:
            scheduler.step()
        self._last_lr = group_lrs(self.optimizer)

    def _checked_values(self, state):
        return {"_last_lr": any_reals(state["_last_lr"], "_last_lr",
                                       len(self.optimizer.param_groups)),
                "_staged": self._staged_children(state["_schedulers"])}
