"""An independent NumPy reference of each update rule, one parameter at a time.

Written from torch.optim's documented order of operations (../shared/reference/
torch_optim_semantics.md), sharing no code with flatopt's kernels, so the conformance suite is
meaningful without torch. Arithmetic is done in the parameter's dtype; scalars are formed in
Python double and rounded once to that dtype, as torch does.
"""

from __future__ import annotations

import numpy as np


class ReferenceOptimizer:
    """``groups``: list of (dict path -> array, hyperparameters dict). ``kind``: a registry
    name with a rule in ``RULES``."""

    def __init__(self, kind: str, groups):
        if kind not in RULES:
            raise LookupError(f"no NumPy reference for {kind!r}: add its update rule to "
                              "tests/reference.py (RULES)")
        self.kind = kind
        self.rule = RULES[kind]
        self.groups = [({k: v.copy() for k, v in params.items()}, dict(hp)) for params, hp in groups]
        self.state: dict[str, dict] = {}

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {k: v for params, _ in self.groups for k, v in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        for params, hp in self.groups:
            for path, p in params.items():
                g = grads.get(path)
                if g is None:
                    continue  # a missing gradient skips the parameter entirely
                params[path] = self.rule(self.state.setdefault(path, {}), p, g, hp)


def sgd(state, p, g, hp):
    t = p.dtype.type
    g = -g if hp["maximize"] else g.copy()
    if hp["weight_decay"] != 0:
        g = g + t(hp["weight_decay"]) * p
    if hp["momentum"] != 0:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = g.copy()
        else:
            buf = state["momentum_buffer"]
            state["momentum_buffer"] = buf * t(hp["momentum"]) + t(1 - hp["dampening"]) * g
        buf = state["momentum_buffer"]
        g = g + t(hp["momentum"]) * buf if hp["nesterov"] else buf
    return p + t(-hp["lr"]) * g

def adam(state, p, g, hp, decoupled=False):
    t = p.dtype.type
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
    if hp["amsgrad"] and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = np.zeros_like(p)
    g = -g if hp["maximize"] else g.copy()
    state["step"] += 1
    if wd != 0:
        if decoupled:
            p = p * t(1 - lr * wd)
        else:
            g = g + t(wd) * p
    weight, m = t(1 - beta1), state["exp_avg"]
    # torch's lerp works from the nearer end: m + w(g - m), or g + (w - 1)(g - m) for w >= .5
    m = state["exp_avg"] = (m + weight * (g - m) if abs(weight) < 0.5
                            else g + (weight - t(1)) * (g - m))
    v = state["exp_avg_sq"] = state["exp_avg_sq"] * t(beta2) + t(1 - beta2) * g * g
    step = float(state["step"])
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    if hp["amsgrad"]:
        state["max_exp_avg_sq"] = np.maximum(state["max_exp_avg_sq"], v)
        v = state["max_exp_avg_sq"]
    denom = np.sqrt(v) / t(bias_correction2_sqrt) + t(hp["eps"])
    return p + (t(-step_size) * m) / denom


def adamw(state, p, g, hp):
    return adam(state, p, g, hp, decoupled=True)


RULES = {"SGD": sgd, "Adam": adam, "AdamW": adamw}
"""Registry name -> reference rule ``(state, p, g, hyperparameters) -> new p``; ``state`` is
the parameter's dict, filled by the rule (empty until the parameter has state)."""
