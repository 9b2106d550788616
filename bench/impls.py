"""The implementations measured side by side: flatopt, a naive NumPy loop, torch.optim
(for-loop, foreach, fused) and the roofline kernel, for every optimizer in flatopt's registry.
All of them read the same gradients (views into flatopt's flat gradient buffer); each has its
own parameters and state."""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Callable

import numpy as np

import flatopt
from flatopt import registry

from .profiles import Profile
from .roofline import Roofline

try:  # torch is optional: without it the torch baselines are skipped
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

OPTIMIZERS = {name.lower(): name for name in registry.names()}
"""Command-line name (lower case) -> registry name."""
ELEMENTWISE = [name for name, registered in OPTIMIZERS.items()
               if registry.lookup(registered).schema.rule.per_parameter is None]
"""The optimizers run by default: memory-bound rules, measured against the roofline. Muon's
cost is its matrix products (``--optimizers muon`` runs it on the profiles' shapes as
near-square matrices)."""
TORCH_IMPLS = ("torch-forloop", "torch-foreach", "torch-fused")
REFERENCE_IMPLS = ("reference-forloop", "reference-foreach")
ALL_IMPLS = ("flatopt", "numpy-loop") + TORCH_IMPLS + REFERENCE_IMPLS + ("roofline",
                                                                         "flatopt-caution")
REFERENCE_PACKAGES = {"ScheduleFreeSGD": ("schedulefree", "SGDScheduleFree"),
                      "ScheduleFreeAdamW": ("schedulefree", "AdamWScheduleFree"),
                      "ScheduleFreeRAdam": ("schedulefree", "RAdamScheduleFree"),
                      "Prodigy": ("prodigyopt", "Prodigy"),
                      "AdEMAMix": ("bitsandbytes.optim.ademamix", "_ReferenceAdEMAMix")}
"""Registry name -> (module, class) of the torch package flatopt follows where torch.optim
has no counterpart: the ``reference-forloop`` / ``reference-foreach`` baselines (a package
without a ``foreach`` argument has only its for-loop)."""


def schema_of(optimizer: str) -> flatopt.Schema:
    return registry.lookup(OPTIMIZERS[optimizer]).schema


def settings_of(optimizer: str) -> dict:
    """The hyperparameters every implementation runs with: defaults plus the schema's
    benchmark values."""
    schema = schema_of(optimizer)
    return schema.defaults(**schema.benchmark)


def torch_settings(cls, settings: dict) -> dict:
    """The settings torch.optim's ``cls`` takes (flatopt-only ones, such as ``caution``, are
    at their defaults in the benchmark's settings)."""
    accepted = inspect.signature(cls).parameters
    return {key: value for key, value in settings.items() if key in accepted}


def bytes_per_element(optimizer: str, dtype) -> int:
    """Bytes one step must move per element (reads plus writes), from the schema."""
    return schema_of(optimizer).bytes_per_element(settings_of(optimizer),
                                                  np.dtype(dtype).itemsize)


class Case:
    """One profile, optimizer and dtype: flatopt's optimizer and the shared gradients."""

    def __init__(self, profile: Profile, optimizer: str, dtype, seed: int = 0):
        self.profile = profile
        self.optimizer = optimizer
        self.dtype = np.dtype(dtype)
        self.settings = settings_of(optimizer)
        rng = np.random.default_rng(seed)
        cls = registry.lookup(OPTIMIZERS[optimizer])

        schema = cls.schema

        def params():
            for path, shape in profile.shapes:
                if schema.param_problem is not None and schema.param_problem(shape):
                    shape = matrix_shape(shape)
                yield path, np.zeros(shape, self.dtype)

        self.opt = cls(list(params()), **self.settings)
        for path, view in self.opt.params.items():  # filled in place: no second copy
            view[...] = rng.standard_normal(view.shape, dtype=np.float32)
        for path, view in self.opt.grads.items():
            view[...] = rng.standard_normal(view.shape, dtype=np.float32)
        self.opt.grads.mark_present()
        (self.buffer,) = self.opt.buffers
        self.grads = {path: self.opt.grads[path] for path in self.opt.grads}

    def params_copy(self) -> dict[str, np.ndarray]:
        return {path: view.copy() for path, view in self.opt.params.items()}


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A near-square 2-D shape with ``shape``'s elements (for optimizers of matrices only)."""
    size = math.prod(shape)
    cols = 1
    while cols * 2 <= math.isqrt(size) and size % (cols * 2) == 0:
        cols *= 2
    return size // cols, cols


class FlatoptImpl:
    name = "flatopt"

    def __init__(self, case: Case):
        self.step = case.opt.step

    def close(self) -> None:
        pass


class FlatoptCautionImpl:
    """flatopt with ``caution=True`` (timm's cautious mask: a second reading pass over the
    buffer), for the optimizers that offer it; its own parameters and state, the case's
    gradients copied into its gradient buffer. Asked for by name (``--impls``)."""

    name = "flatopt-caution"

    def __init__(self, case: Case):
        cls = type(case.opt)
        if "caution" not in cls.schema.hyperparameters:
            raise RuntimeError(f"{cls.schema.name} has no caution option")
        self.opt = cls(case.params_copy(), **{**case.settings, "caution": True})
        for path, view in self.opt.grads.items():
            view[...] = case.grads[path]
        self.opt.grads.mark_present()
        self.step = self.opt.step

    def close(self) -> None:
        self.opt = self.step = None


def _sgd_loop(h, params, grads, state, t):
    lr, mu = h["lr"], h["momentum"]
    for path, p in params.items():
        g = grads[path]
        buf = state.setdefault(path, [np.zeros_like(p)])[0]
        if t == 1:
            buf[...] = g
        else:
            buf *= mu
            buf += g
        p -= lr * buf


def _adam_loop(h, params, grads, state, t, decoupled=False):
    lr, (b1, b2), eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
    step_size = lr / (1 - b1 ** t)
    bc2 = math.sqrt(1 - b2 ** t)
    for path, p in params.items():
        g = grads[path]
        m, v = state.setdefault(path, [np.zeros_like(p), np.zeros_like(p)])
        if wd and decoupled:
            p *= 1 - lr * wd
        elif wd:
            g = g + wd * p
        m += (1 - b1) * (g - m)
        v *= b2
        v += (1 - b2) * g * g
        denom = np.sqrt(v) / bc2 + eps
        p -= step_size * m / denom


NUMPY_LOOPS: dict[str, Callable] = {
    "SGD": _sgd_loop, "Adam": _adam_loop,
    "AdamW": lambda *args: _adam_loop(*args, decoupled=True),
}
"""What a careful user writes without flatopt, per registry name: NumPy in-place ops, one
parameter at a time (optimizers without one here are benchmarked without this baseline)."""


class NumpyLoopImpl:
    name = "numpy-loop"

    def __init__(self, case: Case):
        loop = NUMPY_LOOPS.get(OPTIMIZERS[case.optimizer])
        if loop is None:
            raise RuntimeError(f"no NumPy loop for {OPTIMIZERS[case.optimizer]}")
        self.loop, self.h = loop, case.settings
        self.params = case.params_copy()
        self.grads = case.grads
        self.state: dict = {}
        self.t = 0

    def step(self) -> None:
        self.t += 1
        self.loop(self.h, self.params, self.grads, self.state, self.t)

    def close(self) -> None:
        self.params = self.state = None


class TorchImpl:
    """torch.optim with ``foreach=False`` (for-loop), ``foreach=True`` or ``fused=True``; with
    ``source="reference"``, the optimizer's reference package (``REFERENCE_PACKAGES``)."""

    def __init__(self, case: Case, mode: str, source: str = "torch"):
        self.name = f"{source}-{mode}"
        schema = schema_of(case.optimizer)
        if source == "reference":
            if case.optimizer not in {name.lower() for name in REFERENCE_PACKAGES}:
                raise RuntimeError(f"no reference package for {OPTIMIZERS[case.optimizer]}")
            module, name = REFERENCE_PACKAGES[OPTIMIZERS[case.optimizer]]
            cls = getattr(importlib.import_module(module), name)
        elif schema.torch_name is None:
            raise RuntimeError(f"torch.optim has no {OPTIMIZERS[case.optimizer]}")
        else:
            cls = getattr(torch.optim, schema.torch_name)
        flags = {"forloop": dict(foreach=False), "foreach": dict(foreach=True),
                 "fused": dict(fused=True)}[mode]
        if source == "reference" and "foreach" not in inspect.signature(cls).parameters:
            if mode != "forloop":
                raise RuntimeError(f"{name} has no foreach path")
            flags = {}
        self.params = []
        for path, view in case.opt.params.items():
            t = torch.from_numpy(view.copy()).requires_grad_(True)
            t.grad = torch.from_numpy(case.grads[path])
            self.params.append(t)
        self.opt = cls(self.params, **torch_settings(cls, case.settings), **flags)
        if hasattr(self.opt, "train"):  # schedule-free: the reference starts in eval mode
            self.opt.train()
        self.step = self._step

    @torch.no_grad() if torch is not None else (lambda f: f)
    def _step(self) -> None:
        self.opt.step()

    def close(self) -> None:
        self.opt = self.params = None


class RooflineImpl:
    name = "roofline"

    def __init__(self, case: Case):
        slots = schema_of(case.optimizer).used_slots(case.settings)
        self.kernel = Roofline(case.buffer, len(slots))
        self.step = self.kernel.step

    def close(self) -> None:
        self.kernel = None


def available_impls() -> list[str]:
    names = ["flatopt", "numpy-loop"]
    if torch is not None:
        names += list(TORCH_IMPLS) + list(REFERENCE_IMPLS)
    return names + ["roofline"]


def make_impl(name: str, case: Case):
    """An implementation's runner; RuntimeError when it does not exist for this case."""
    if name == "flatopt":
        return FlatoptImpl(case)
    if name == "flatopt-caution":
        return FlatoptCautionImpl(case)
    if name == "numpy-loop":
        return NumpyLoopImpl(case)
    if name.startswith(("torch-", "reference-")):
        if torch is None:
            raise RuntimeError("torch is not installed")
        source, mode = name.split("-", 1)
        return TorchImpl(case, mode, source)
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
