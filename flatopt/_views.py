"""``opt.params`` and ``opt.grads``: per-path views into the flat buffers, and presence."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ._layout import ParamInfo
from .errors import GradientError, ParamError, UnknownGradientError, UnknownPathError
from .schema import near

if TYPE_CHECKING:
    from .optimizer import Optimizer


class ParamViews(Mapping):
    """``opt.params``: path -> writable view into the flat parameter buffer.
    ``opt.params[path] = value`` copies a NumPy array of the parameter's shape and dtype in
    (checked as gradients are; on ``device="cuda"``, a NumPy array copied to the device)."""

    def __init__(self, optimizer: "Optimizer", views: dict[str, np.ndarray]):
        self._opt = optimizer
        self._views = views

    def __getitem__(self, path: str) -> np.ndarray:
        try:
            return self._views[path]
        except (KeyError, TypeError):
            raise UnknownPathError(f"no parameter {path!r}{near(path, self._views)}; "
                                   "opt.index.paths lists them") from None

    def __setitem__(self, path: str, value: np.ndarray) -> None:
        self[path]  # an unknown path raises here
        info = self._opt.index[path]
        device = self._opt.buffer_device
        problem = device.value_problem(info, value)
        if problem:
            raise ParamError(problem)
        with self._opt.lock:
            device.write_param(info, np.asarray(value))

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


def value_problem(info: ParamInfo, value: Any, what: str, dtype=None) -> str | None:
    """Why ``value`` cannot be copied into ``info``'s view (``what``: "gradient" or
    "value"; ``dtype``: the view's, by default the parameter's), or None."""
    dtype = info.dtype if dtype is None else np.dtype(dtype)
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        return (f"{what} for {info.path!r} is a {type(value).__name__}; give a numpy array "
                f"of shape {info.shape} and dtype {dtype}")
    if isinstance(value, np.ma.MaskedArray):
        return (f"{what} for {info.path!r} is a masked array, whose mask flatopt would "
                "ignore; pass value.filled(0) (or the values you mean)")
    if value.shape != info.shape:
        return (f"{what} for {info.path!r} has shape {value.shape}, but the parameter has "
                f"shape {info.shape}")
    if value.dtype != dtype:
        whose = "the parameter is" if dtype == info.dtype else f"its {what} buffer holds"
        cast = "ml_dtypes.bfloat16" if dtype.name == "bfloat16" else f"np.{dtype}"
        return (f"{what} for {info.path!r} has dtype {value.dtype}, but {whose} "
                f"{dtype}; cast it with .astype({cast})")
    return None


def gradient_problem(info: ParamInfo, value: Any, dtype=None) -> str | None:
    """Why ``value`` cannot be the gradient of ``info`` (held as ``dtype``, by default the
    parameter's), or None."""
    return value_problem(info, value, "gradient", dtype)


class Gradients(Mapping):
    """``opt.grads``: the flat gradient buffers, seen per path, with explicit presence.

    ``opt.grads[path]`` is a writable view (write into it with ``out=`` or ``[...] =``);
    reading or writing it does not change presence. Mark which gradients exist with
    :meth:`mark_present` / :meth:`mark_missing`; ``opt.grads[path] = value`` copies and marks
    present in one go. ``opt.step()`` steps exactly the parameters marked present.

    The view of a *missing* gradient is zeroed when it is taken (that parameter's slice only),
    so ``opt.zero_grad(); opt.grads[k] += g`` accumulates onto zeros, as torch's ``.grad``
    starts from nothing after ``zero_grad()``, never onto the previous step's gradient. A view
    taken before ``zero_grad()`` keeps what it holds: take views after it.
    """

    def __init__(self, optimizer: "Optimizer", views: dict[str, np.ndarray]):
        self._opt = optimizer
        self._views = views

    def _locate(self, path: Any) -> ParamInfo:
        info = self._opt.index.get(path) if isinstance(path, str) else None
        if info is None:
            raise UnknownGradientError(f"no parameter {path!r}"
                                       f"{near(path, self._opt.index.paths)}; opt.index.paths "
                                       "lists them")
        return info

    def __getitem__(self, path: str) -> np.ndarray:
        info = self._locate(path)
        buf = self._opt.buffers[info.buffer]
        if buf.stale[info.slot] and not buf.present[info.slot]:
            with self._opt.lock:
                self._opt.buffer_device.zero_gradient(info)
                buf.stale[info.slot] = 0
        return self._views[info.path]

    def __setitem__(self, path: str, value: np.ndarray) -> None:
        info = self._locate(path)
        device = self._opt.buffer_device  # NumPy arrays, or device arrays on CUDA
        problem = device.gradient_problem(info, value)
        if problem:
            raise GradientError(problem)
        with self._opt.lock:
            [(_, source)] = device.sources([(info, value)])
            device.write_gradient(info, source)
            self._opt.buffers[info.buffer].mark_present(info.slot)

    def __iter__(self) -> Iterator[str]:
        return iter(self._opt.index.paths)

    def __len__(self) -> int:
        return len(self._opt.index)

    def add(self, grads: Mapping[str, Any]) -> None:
        """Accumulate gradients (``{path: array}``, e.g. one micro-batch's): a missing gradient
        becomes the value and is marked present, a present one gets the value added. All are
        checked before any is added. After ``k`` micro-batches, ``opt.step(grad_scale=k)``
        steps on their mean; a parameter that got a gradient in only some micro-batches counts
        zero in the others (as ``.grad`` accumulation does in torch), one that got none stays
        missing."""
        if not isinstance(grads, Mapping):
            raise GradientError(f"add() takes a dict {{path: array}}, got "
                                f"{type(grads).__name__}")
        located = []
        device = self._opt.buffer_device
        for path, value in grads.items():
            info = self._locate(path)
            problem = device.gradient_problem(info, value)
            if problem:
                raise GradientError(problem)
            located.append((info, value))
        with self._opt.lock:
            # values that are views of the gradient buffer are read before anything is added
            for info, source in device.sources(located):
                buf = self._opt.buffers[info.buffer]
                if buf.present[info.slot]:
                    device.add_gradient(info, source)
                else:
                    device.write_gradient(info, source)
                    buf.mark_present(info.slot)

    def mark_present(self, paths: Iterable[str] | None = None) -> None:
        """Mark gradients as present (all of them when ``paths`` is None): their buffers hold
        the gradients the next step uses."""
        self._mark(paths, 1)

    def mark_missing(self, paths: Iterable[str] | None = None) -> None:
        """Mark gradients as missing: those parameters are skipped entirely by step(), and
        their views are zeroed when next taken."""
        self._mark(paths, 0)

    def _mark(self, paths, value: int) -> None:
        if paths is None:
            for buf in self._opt.buffers:
                buf.mark_missing() if value == 0 else buf.mark_present()
            return
        if isinstance(paths, str):
            paths = [paths]
        elif not isinstance(paths, Iterable):
            raise UnknownGradientError(f"paths must be a path or a list of paths, got "
                                       f"{type(paths).__name__} {paths!r}")
        located = [self._locate(path) for path in paths]  # all checked before any flag changes
        for info in located:
            buf = self._opt.buffers[info.buffer]
            buf.mark_missing(info.slot) if value == 0 else buf.mark_present(info.slot)

    def is_present(self, path: str) -> bool:
        info = self._locate(path)
        return bool(self._opt.buffers[info.buffer].present[info.slot])

    def present_paths(self) -> list[str]:
        return [info.path for info in self._opt.index
                if self._opt.buffers[info.buffer].present[info.slot]]
