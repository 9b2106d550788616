"""Stochastic gradient descent with momentum (torch.optim.SGD semantics)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from . import _hyper
from ._layout import FlatBuffer
from .kernels import cpu
from .optimizer import Optimizer


class SGDParamState(NamedTuple):
    """One parameter's SGD state (views into the flat state buffer)."""

    momentum_buffer: np.ndarray


class SGD(Optimizer):
    r"""SGD with momentum, dampening, Nesterov, weight decay and maximize.

    For each parameter with a gradient (a missing gradient skips the parameter entirely)::

        g = -grad if maximize else grad
        g = g + weight_decay * p                     if weight_decay != 0
        if momentum != 0:
            buf = g                                  the first step this parameter has a gradient
            buf = momentum * buf + (1 - dampening) * g        later steps
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g

    The momentum buffer is seeded with the (decayed) gradient itself, undampened, exactly as
    ``torch.optim.SGD`` does. Hyperparameters are read from ``param_groups`` at every step.
    """

    hyperparameters = {
        "lr": (1e-3, _hyper.non_negative),
        "momentum": (0.0, _hyper.non_negative),
        "dampening": (0.0, _hyper.unit_fraction),
        "weight_decay": (0.0, _hyper.non_negative),
        "nesterov": (False, _hyper.flag),
        "maximize": (False, _hyper.flag),
    }
    state_record = SGDParamState

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, **unknown: Any):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         **unknown)

    @staticmethod
    def _cross_check(values: dict[str, Any]) -> list[str]:
        if values["nesterov"] and (values["momentum"] <= 0 or values["dampening"] != 0):
            return ["nesterov=True requires momentum > 0 and dampening = 0 "
                    f"(momentum={values['momentum']}, dampening={values['dampening']})"]
        return []

    def _init_buffer(self, buf: FlatBuffer) -> None:
        buf.per_param["momentum_initialized"] = np.zeros(len(buf), dtype=np.uint8)
        buf.per_param["first"] = np.zeros(len(buf), dtype=np.uint8)

    def _step_buffer(self, buf: FlatBuffer, s: dict[str, Any]) -> None:
        has_momentum = s["momentum"] != 0
        first = buf.per_param["first"]
        if not cpu.sgd_prepare(buf.present, buf.per_param["momentum_initialized"], first,
                               has_momentum):
            return  # no gradient in this buffer: nothing changes, no state is allocated
        # Without momentum the kernel never touches the momentum argument.
        momentum_buffer = buf.state_buffer("momentum_buffer") if has_momentum else buf.grads
        cpu.sgd_step(buf.params, buf.grads, momentum_buffer, buf.offsets, buf.sizes, buf.present,
                     first, buf.chunk_first, buf.chunk_size, self._kernel_scalars(buf, s),
                     s["weight_decay"] != 0, has_momentum, s["nesterov"], s["maximize"],
                     cpu.run_serially(buf.length))

    def _scalars(self, s: dict[str, Any], dtype: np.dtype) -> list[float]:
        return [-s["lr"], s["weight_decay"], s["momentum"], 1.0 - s["dampening"]]

    def _state_slots(self, settings: Mapping) -> dict[str, str]:
        return {"momentum_buffer": "optional"}

    def _param_state(self, buf: FlatBuffer, slot: int, copy: bool) -> dict | None:
        if not buf.per_param["momentum_initialized"][slot]:
            return None
        view = buf.view(buf.state["momentum_buffer"], slot)
        return {"momentum_buffer": view.copy() if copy else view}

    def _set_param_state(self, buf: FlatBuffer, slot: int, entry: Mapping) -> None:
        value = entry.get("momentum_buffer")
        if value is not None:  # torch < 2.3 saved momentum_buffer=None when momentum == 0
            buf.view(buf.state_buffer("momentum_buffer"), slot)[...] = value
            buf.per_param["momentum_initialized"][slot] = 1

    def _clear_param_state(self, buf: FlatBuffer) -> None:
        buf.per_param["momentum_initialized"][:] = 0
