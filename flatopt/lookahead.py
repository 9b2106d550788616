"""Lookahead (Zhang et al. 2019) over any flatopt optimizer, with timm's semantics
(``timm.optim.Lookahead``): slow weights in flat buffers parallel to the parameter buffers,
synced by one fused pass per buffer every ``k`` steps of a group."""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import numpy as np

from ._layout import CHUNK_ELEMENTS
from .errors import DeviceError, HyperparameterError, StateDictError
from .kernels.threads import check_policy
from .kernels.tools import lookahead_into
from .optimizer import Optimizer
from .schema import MAX_COUNT


def _pieces(offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments ``[offset, offset + size)`` cut into pieces of at most a chunk (even work
    for the sync's threads): (starts, stops)."""
    counts = -(-sizes // CHUNK_ELEMENTS)
    first = np.repeat(offsets, counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = first + within * CHUNK_ELEMENTS
    return starts, np.minimum(starts + CHUNK_ELEMENTS, np.repeat(offsets + sizes, counts))


class Lookahead:
    r"""Lookahead over ``optimizer``, as timm's ``Lookahead(base_optimizer, alpha=0.5, k=6)``::

        after every step of the inner optimizer, per group: t += 1; every k-th t, for each
        parameter with a gradient:  slow = p (its first sync), else slow += alpha (p - slow);
                                    p = slow

    The slow weights live in flat buffers parallel to the optimizer's (``la.slow[path]`` are
    views), updated by one fused pass per buffer; a parameter's slow weights begin at its
    first sync, as in timm (so that sync leaves it as it is). Steps skipped by the optimizer
    (``skip_nonfinite=True``, a GradScaler overflow) do not count, as when torch's GradScaler
    skips ``optimizer.step()``. ``la.step()``, ``la.zero_grad()``, ``la.params``, ``la.grads``
    and ``la.param_groups`` are the optimizer's; ``flatopt.save(path, la)`` and
    ``flatopt.load(path, la)`` (or ``lookahead=la`` beside the optimizer) keep the slow
    weights, the counts and the settings with the optimizer's state, and resume exactly.
    """

    def __init__(self, optimizer: Optimizer, alpha: float = 0.5, k: int = 6):
        if not isinstance(optimizer, Optimizer):
            raise HyperparameterError(f"Lookahead() wraps a flatopt optimizer, got "
                                      f"{type(optimizer).__name__}")
        if optimizer.device != "cpu" or optimizer.sharding is not None:
            raise DeviceError("Lookahead wraps an optimizer whose buffers are on the host and "
                              "not sharded over ranks (device='cpu', no comm=); not yet on "
                              "CUDA or ZeRO-1")
        for buf in optimizer.buffers:
            if buf.coded:
                _refuse(buf.group, buf.paths[0], buf.storage,
                        "this optimizer cannot be wrapped")
        self.optimizer = optimizer
        self.alpha = _alpha(alpha)
        self.k = _k(k)
        self.steps: list[int] = []
        self.slow: dict[str, np.ndarray] = {}
        self.buffers: list[np.ndarray] = []
        self.started: list[np.ndarray] = []
        """Per buffer, by the parameter's slot: whether its slow weights have begun."""
        self._check_layout()
        # a group added later is vetted by the optimizer's add_param_group, before it adds it
        optimizer.check_added_groups(self._check_added_group)

    def _check_added_group(self, number: int, paths: list, storages: list) -> None:
        for path, storage in zip(paths, storages):
            if not storage.plain:
                _refuse(number, path, storage, "add_param_group() refuses the group while a "
                        "Lookahead wraps the optimizer; nothing was added")

    # ----------------------------------------------------------------- the optimizer's
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def params(self):
        return self.optimizer.params

    @property
    def grads(self):
        return self.optimizer.grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def _check_layout(self) -> None:
        """Slow buffers and counts for groups the optimizer gained (``add_param_group``)."""
        opt = self.optimizer
        self.steps += [0] * (len(opt.param_groups) - len(self.steps))
        for buf in opt.buffers[len(self.buffers):]:
            flat = np.zeros(buf.length, buf.dtype)
            self.buffers.append(flat)
            self.started.append(np.zeros(len(buf.paths), bool))
            for path in buf.paths:
                info = opt.index[path]
                self.slow[path] = flat[info.offset:info.offset + info.size].reshape(info.shape)

    # ----------------------------------------------------------------- stepping
    def step(self, grads: Mapping[str, Any] | None = None, **options: Any):
        """The optimizer's step (same arguments and result), then the groups' syncs due."""
        result = self.optimizer.step(grads, **options)
        if result.skipped:
            return result
        self._check_layout()
        due = []
        for number in range(len(self.steps)):
            self.steps[number] += 1
            if self.steps[number] % self.k == 0:
                due.append(number)
        if due:
            self._sync(due)
        return result

    def sync_lookahead(self) -> None:
        """Sync every group now (timm's ``sync_lookahead``: before evaluating, say)."""
        self._check_layout()
        self._sync(range(len(self.steps)))

    def _sync(self, groups) -> None:
        opt = self.optimizer
        check_policy()  # FLATOPT_PARALLEL: refused before the first slow weight changes
        wanted = set(groups)
        with opt.lock:
            for buf, slow, started in zip(opt.buffers, self.buffers, self.started):
                if buf.group not in wanted:
                    continue
                present = buf.present.astype(bool)
                fresh = present & ~started
                for slot in np.flatnonzero(fresh):  # its first sync: slow = p, p unchanged
                    lo, hi = buf.offsets[slot], buf.offsets[slot] + buf.sizes[slot]
                    slow[lo:hi] = buf.params[lo:hi]
                started |= fresh
                chosen = np.flatnonzero(present & ~fresh)
                if chosen.size:
                    starts, stops = _pieces(buf.offsets[chosen].astype(np.int64),
                                            buf.sizes[chosen].astype(np.int64))
                    lookahead_into(int(buf.sizes[chosen].sum()), slow, buf.params, starts,
                                   stops, buf.dtype.type(self.alpha))

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Settings, per-group counts, and the slow weights of the parameters that have them
        (copies), by path."""
        self._check_layout()
        slow = {}
        for buf, started in zip(self.optimizer.buffers, self.started):
            for slot, path in enumerate(buf.paths):
                if started[slot]:
                    slow[path] = self.slow[path].copy()
        return {"alpha": self.alpha, "k": self.k, "steps": list(self.steps), "slow": slow}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`, everything checked before anything changes."""
        self._check_layout()
        if not isinstance(state, Mapping) or set(state) != {"alpha", "k", "steps", "slow"}:
            raise StateDictError("a Lookahead state dict has the keys alpha, k, steps, slow")
        problems = []
        try:
            alpha, k = _alpha(state["alpha"]), _k(state["k"])
        except HyperparameterError as exc:
            problems.append(str(exc))
        steps = state["steps"]
        if not isinstance(steps, (list, tuple)) or len(steps) != len(self.steps) or not all(
                isinstance(s, numbers.Integral) and not isinstance(s, bool)
                and 0 <= s <= MAX_COUNT for s in steps):
            problems.append(f"Lookahead steps must be {len(self.steps)} ints in [0, "
                            f"{MAX_COUNT}] (one per param group), got {steps!r}"[:300])
        slow = state["slow"]
        if not isinstance(slow, Mapping):
            problems.append("Lookahead 'slow' must be {path: array}")
            slow = {}
        for path, value in slow.items():
            view = self.slow.get(path)
            if view is None:
                problems.append(f"Lookahead slow weights for unknown parameter {path!r}")
            elif not isinstance(value, np.ndarray) or value.shape != view.shape \
                    or value.dtype != view.dtype:
                problems.append(f"Lookahead slow weights for {path!r}: expected {view.shape} "
                                f"{view.dtype}, got {getattr(value, 'shape', value)!r}")
        if problems:
            raise StateDictError("\n".join(problems))
        for buf, flat, started in zip(self.optimizer.buffers, self.buffers, self.started):
            for slot, path in enumerate(buf.paths):
                started[slot] = path in slow
                if path in slow:
                    self.slow[path][...] = slow[path]
        self.alpha, self.k, self.steps = alpha, k, [int(s) for s in steps]

    def __repr__(self) -> str:
        return f"Lookahead({self.optimizer!r}, alpha={self.alpha}, k={self.k})"


def _refuse(group: int, path: str, storage, outcome: str) -> None:
    # the sync is a float32/float64 kernel writing the stored parameters (16-bit ones, or
    # ones under master weights, it cannot write), and a checkpoint packs the slow weights as
    # plain buffers are packed (a reduced-precision optimizer's file packs them otherwise)
    raise HyperparameterError(
        f"param group {group}: {path!r} is stored in reduced precision ({storage.describe()}); "
        f"Lookahead works over float32 and float64 buffers only (not yet 16-bit parameters, "
        f"master_weights or state_dtype): {outcome}")


def _alpha(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not 0.0 <= float(value) <= 1.0:
        raise HyperparameterError(f"Lookahead alpha (slow update rate) must be in [0, 1], got "
                                  f"{value!r}")
    return float(value)


def _k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not 1 <= value <= MAX_COUNT:
        raise HyperparameterError(f"Lookahead k (steps between syncs) must be an int in [1, "
                                  f"{MAX_COUNT}], got {value!r}")
    return int(value)
