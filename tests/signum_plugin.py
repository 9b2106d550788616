"""A test-only optimizer defined outside flatopt, the way a new one is added: one rule (three
functions and their layouts), one schema + class, one registry line. Signum (sign-SGD with
momentum, Bernstein et al. 2018) with decoupled weight decay::

    p = p * (1 - lr * weight_decay)
    m = beta * m + (1 - beta) * g
    p = p - lr * sign(m)

Importing this module registers ``SignumTest``.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

import flatopt
from flatopt.kernels.layouts import positions
from flatopt.kernels.rule import Rule
from flatopt.schema import MAX_STEP, Column, Hyperparameter, Schema, Slot, non_negative


class Scalars(NamedTuple):
    neg_lr: float
    beta: float
    one_minus_beta: float
    decay_factor: float


class Flags(NamedTuple):
    has_weight_decay: bool


class Columns(NamedTuple):
    step: int


S, F, C = positions(Scalars), positions(Flags), positions(Columns)


def signum_rule(p, g, m, neg_lr, beta, one_minus_beta, decay_factor, has_weight_decay):
    if has_weight_decay:
        p = p * decay_factor
    m = beta * m + one_minus_beta * g
    if m > 0:
        p = p + neg_lr
    elif m < 0:
        p = p - neg_lr
    return p, m


def signum_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, m = arrays
    for i in range(start, stop, stride):
        p[i], m[i] = signum_rule(p[i], g[i], m[i], scalars[S.neg_lr], scalars[S.beta],
                                 scalars[S.one_minus_beta], scalars[S.decay_factor],
                                 flags[F.has_weight_decay])


def signum_prepare(present, columns, scalars, flags, start, stop, stride):
    steps = columns[C.step]
    for k in range(start, stop, stride):
        if present[k] != 0:
            steps[k] += 1


RULE = Rule(name="signum_test", span=signum_span, prepare=signum_prepare,
            helpers=(signum_rule,), slots=("momentum",), columns={"step": "int64"},
            scalars=Scalars, flags=Flags)


class SignumState(NamedTuple):
    step: int
    momentum: np.ndarray


def _beta(value: Any) -> float:
    beta = non_negative(value)
    if beta >= 1:
        raise flatopt.schema.Invalid(f"must be in [0, 1), got {value!r}")
    return beta


SCHEMA = Schema(
    name="SignumTest", rule=RULE, record=SignumState,
    hyperparameters={"lr": Hyperparameter(1e-3, non_negative, (1e-3, 1e-2)),
                     "beta": Hyperparameter(0.9, _beta, (0.0, 0.5, 0.9)),
                     "weight_decay": Hyperparameter(0.0, non_negative, (0.0, 0.1))},
    columns={"step": Column("int64", MAX_STEP, marker=True)},
    slots={"momentum": Slot()})


@flatopt.registry.register
class SignumTest(flatopt.Optimizer):
    schema = SCHEMA

    def __init__(self, params, lr=1e-3, beta=0.9, weight_decay=0.0):
        super().__init__(params, lr=lr, beta=beta, weight_decay=weight_decay)

    def kernel_scalars(self, s: Mapping[str, Any], dtype) -> Scalars:
        return Scalars(neg_lr=-s["lr"], beta=s["beta"], one_minus_beta=1.0 - s["beta"],
                       decay_factor=1.0 - s["lr"] * s["weight_decay"])

    def kernel_flags(self, s: Mapping[str, Any]) -> Flags:
        return Flags(has_weight_decay=s["weight_decay"] != 0)
