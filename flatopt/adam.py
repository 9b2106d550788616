"""Adam and AdamW (torch.optim.Adam / AdamW semantics); AdamW is Adam with decoupled decay."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from . import _hyper
from ._layout import FlatBuffer
from .kernels import cpu
from .optimizer import Optimizer

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class AdamParamState(NamedTuple):
    """One parameter's Adam state; arrays are views into the flat state buffers."""

    step: int
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    max_exp_avg_sq: np.ndarray | None = None


def lerp_from_end(settings: Mapping) -> bool:
    """torch's lerp(m, g, w) computes from g when the weight w = 1 - beta1 is not below 0.5."""
    return not abs(1.0 - settings["betas"][0]) < 0.5


class Adam(Optimizer):
    r"""Adam, with L2 weight decay, AMSGrad and maximize; AdamW when decoupled.

    For each parameter with a gradient, with ``t`` that parameter's own step count (a
    parameter that first gets a gradient later has its own bias correction)::

        g = -grad if maximize else grad
        t = t + 1
        p = p * (1 - lr * weight_decay)              AdamW (decoupled), whatever g is
        g = g + weight_decay * p                     Adam (L2 into the gradient)
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                        if amsgrad; then v_max is used for v
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    A missing gradient skips the parameter entirely (no step count, no decay); a zero
    gradient is a real step. Hyperparameters are read from ``param_groups`` at every step.
    """

    decoupled_weight_decay: bool = False
    hyperparameters = {
        "lr": (1e-3, _hyper.non_negative),
        "betas": ((0.9, 0.999), _hyper.betas),
        "eps": (1e-8, _hyper.non_negative),
        "weight_decay": (0.0, _hyper.non_negative),
        "amsgrad": (False, _hyper.flag),
        "maximize": (False, _hyper.flag),
    }
    state_record = AdamParamState

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, amsgrad: bool = False, *,
                 maximize: bool = False, **unknown: Any):
        if weight_decay is None:
            weight_decay = self.hyperparameters["weight_decay"][0]
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, **unknown)

    def _init_buffer(self, buf: FlatBuffer) -> None:
        buf.per_param["step"] = np.zeros(len(buf), dtype=np.int64)
        buf.per_param["neg_step_size"] = np.zeros(len(buf), dtype=buf.dtype)
        buf.per_param["bias_correction2_sqrt"] = np.zeros(len(buf), dtype=buf.dtype)

    def _step_buffer(self, buf: FlatBuffer, s: dict[str, Any]) -> None:
        beta1, beta2 = s["betas"]
        p = buf.per_param
        if not cpu.adam_prepare(buf.present, p["step"], p["neg_step_size"],
                                p["bias_correction2_sqrt"], s["lr"], beta1, beta2):
            return  # no gradient in this buffer: nothing changes, no state is allocated
        exp_avg = buf.state_buffer("exp_avg")
        exp_avg_sq = buf.state_buffer("exp_avg_sq")
        # Without amsgrad the kernel never touches the v_max argument.
        max_exp_avg_sq = buf.state_buffer("max_exp_avg_sq") if s["amsgrad"] else exp_avg_sq
        cpu.adam_step(buf.params, buf.grads, exp_avg, exp_avg_sq, max_exp_avg_sq, buf.offsets,
                      buf.sizes, buf.present, p["neg_step_size"], p["bias_correction2_sqrt"],
                      buf.chunk_first, buf.chunk_size, self._kernel_scalars(buf, s),
                      s["weight_decay"] != 0, self.decoupled_weight_decay, s["amsgrad"],
                      s["maximize"], lerp_from_end(s), cpu.run_serially(buf.length))

    def _scalars(self, s: dict[str, Any], dtype: np.dtype) -> list[float]:
        beta1, beta2 = s["betas"]
        lr, weight_decay = s["lr"], s["weight_decay"]
        weight = float(dtype.type(1.0 - beta1))  # torch's lerp weight, in the tensor's dtype
        lerp_coefficient = weight - 1.0 if lerp_from_end(s) else weight  # exact: Sterbenz
        return [lerp_coefficient, beta2, 1.0 - beta2, s["eps"], weight_decay,
                1.0 - lr * weight_decay]

    def _state_slots(self, settings: Mapping) -> dict[str, str]:
        return {"step": "required", "exp_avg": "required", "exp_avg_sq": "required",
                "max_exp_avg_sq": "required" if settings["amsgrad"] else "optional"}

    def _param_state(self, buf: FlatBuffer, slot: int, copy: bool) -> dict | None:
        step = int(buf.per_param["step"][slot])
        if step == 0:
            return None
        entry: dict[str, Any] = {"step": step}
        for name in _MOMENTS:
            if name in buf.state:
                view = buf.view(buf.state[name], slot)
                entry[name] = view.copy() if copy else view
        return entry

    def _set_param_state(self, buf: FlatBuffer, slot: int, entry: Mapping) -> None:
        buf.per_param["step"][slot] = int(entry["step"])
        for name in _MOMENTS:
            if entry.get(name) is not None:
                buf.view(buf.state_buffer(name), slot)[...] = entry[name]

    def _clear_param_state(self, buf: FlatBuffer) -> None:
        buf.per_param["step"][:] = 0
        for flat in buf.state.values():
            flat.fill(0)  # a parameter without state starts from zero moments


class AdamW(Adam):
    """AdamW: :class:`Adam` with decoupled weight decay (``p *= 1 - lr * weight_decay`` before
    the moments) and a default ``weight_decay`` of 1e-2. Same rule body, one flag."""

    decoupled_weight_decay = True
    hyperparameters = {**Adam.hyperparameters, "weight_decay": (1e-2, _hyper.non_negative)}
