"""The implementations measured side by side: flatopt, a naive NumPy loop, torch.optim
(for-loop, foreach, fused) and the roofline kernel. All of them read the same gradients
(views into flatopt's flat gradient buffer); each has its own parameters and state."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

import flatopt

from .profiles import Profile
from .roofline import Roofline

try:  # torch is optional: without it the torch baselines are skipped
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

OPTIMIZERS = ("sgd", "adam", "adamw")
HYPER = {
    "sgd": dict(lr=1e-3, momentum=0.9),
    "adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8),
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
}
TORCH_IMPLS = ("torch-forloop", "torch-foreach", "torch-fused")
ALL_IMPLS = ("flatopt", "numpy-loop") + TORCH_IMPLS + ("roofline",)


class Case:
    """One profile, optimizer and dtype: flatopt's optimizer and the shared gradients."""

    def __init__(self, profile: Profile, optimizer: str, dtype, seed: int = 0):
        self.profile = profile
        self.optimizer = optimizer
        self.dtype = np.dtype(dtype)
        rng = np.random.default_rng(seed)
        cls = {"sgd": flatopt.SGD, "adam": flatopt.Adam, "adamw": flatopt.AdamW}[optimizer]

        def params():
            for path, shape in profile.shapes:
                yield path, np.zeros(shape, self.dtype)

        self.opt = cls(list(params()), **HYPER[optimizer])
        for path, view in self.opt.params.items():  # filled in place: no second copy
            view[...] = rng.standard_normal(view.shape, dtype=np.float32)
        for path, view in self.opt.grads.items():
            view[...] = rng.standard_normal(view.shape, dtype=np.float32)
        self.opt.grads.mark_present()
        (self.buffer,) = self.opt.buffers
        self.grads = {path: self.opt.grads[path] for path in self.opt.grads}

    def params_copy(self) -> dict[str, np.ndarray]:
        return {path: view.copy() for path, view in self.opt.params.items()}


class FlatoptImpl:
    name = "flatopt"

    def __init__(self, case: Case):
        self.step = case.opt.step

    def close(self) -> None:
        pass


class NumpyLoopImpl:
    """What a careful user writes without flatopt: NumPy in-place ops, one parameter at a time."""

    name = "numpy-loop"

    def __init__(self, case: Case):
        self.kind = case.optimizer
        self.h = HYPER[case.optimizer]
        self.params = case.params_copy()
        self.grads = case.grads
        self.state = {path: [np.zeros_like(p) for _ in range(1 if self.kind == "sgd" else 2)]
                      for path, p in self.params.items()}
        self.t = 0
        self.step = self._sgd if self.kind == "sgd" else self._adam

    def _sgd(self) -> None:
        lr, mu = self.h["lr"], self.h["momentum"]
        first = self.t == 0
        self.t += 1
        for path, p in self.params.items():
            g = self.grads[path]
            (buf,) = self.state[path]
            if first:
                buf[...] = g
            else:
                buf *= mu
                buf += g
            p -= lr * buf

    def _adam(self) -> None:
        lr, (b1, b2), eps = self.h["lr"], self.h["betas"], self.h["eps"]
        wd = self.h.get("weight_decay", 0.0)
        self.t += 1
        step_size = lr / (1 - b1 ** self.t)
        bc2 = math.sqrt(1 - b2 ** self.t)
        for path, p in self.params.items():
            g = self.grads[path]
            m, v = self.state[path]
            if wd:
                p *= 1 - lr * wd
            m += (1 - b1) * (g - m)
            v *= b2
            v += (1 - b2) * g * g
            denom = np.sqrt(v) / bc2 + eps
            p -= step_size * m / denom

    def close(self) -> None:
        self.params = self.state = None


class TorchImpl:
    """torch.optim with ``foreach=False`` (for-loop), ``foreach=True`` or ``fused=True``."""

    def __init__(self, case: Case, mode: str):
        self.name = f"torch-{mode}"
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
               "adamw": torch.optim.AdamW}[case.optimizer]
        flags = {"forloop": dict(foreach=False), "foreach": dict(foreach=True),
                 "fused": dict(fused=True)}[mode]
        self.params = []
        for path, view in case.opt.params.items():
            t = torch.from_numpy(view.copy()).requires_grad_(True)
            t.grad = torch.from_numpy(case.grads[path])
            self.params.append(t)
        self.opt = cls(self.params, **HYPER[case.optimizer], **flags)
        self.step = self._step

    @torch.no_grad() if torch is not None else (lambda f: f)
    def _step(self) -> None:
        self.opt.step()

    def close(self) -> None:
        self.opt = self.params = None


class RooflineImpl:
    name = "roofline"

    def __init__(self, case: Case):
        self.kernel = Roofline(case.optimizer, case.buffer.grads)
        self.step = self.kernel.step

    def close(self) -> None:
        self.kernel = None


def available_impls() -> list[str]:
    names = ["flatopt", "numpy-loop"]
    if torch is not None:
        names += list(TORCH_IMPLS)
    return names + ["roofline"]


def make_impl(name: str, case: Case):
    if name == "flatopt":
        return FlatoptImpl(case)
    if name == "numpy-loop":
        return NumpyLoopImpl(case)
    if name.startswith("torch-"):
        if torch is None:
            raise RuntimeError("torch is not installed")
        return TorchImpl(case, name.split("-", 1)[1])
    if name == "roofline":
        return RooflineImpl(case)
    raise ValueError(f"unknown implementation {name!r}; known: {ALL_IMPLS}")


def set_threads(n: int) -> None:
    """Numba's and torch's thread counts together."""
    import numba
    numba.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n)


def max_threads() -> int:
    import numba
    return numba.config.NUMBA_NUM_THREADS


StepFn = Callable[[], None]
