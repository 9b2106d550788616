"""The roofline kernel: an optimizer's memory traffic with trivial arithmetic.

It reads the gradient and reads and writes the parameters and each state slot the optimizer's
settings use (the schema's ``bytes_per_element``: Adam float32 28 B, SGD with momentum 20 B),
in one pass per element, through flatopt's own CPU chunk walk over the same buffer layout,
serial below the same size threshold. Its time is what the memory system allows for exactly
flatopt's traffic.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from flatopt.kernels import cpu
from flatopt.kernels.layouts import positions
from flatopt.kernels.rule import Rule

MAX_SLOTS = 4


class Flags(NamedTuple):
    one: bool
    two: bool
    three: bool
    four: bool


F = positions(Flags)


def touch_span(arrays, scalars, columns, flags, k, start, stop, stride):
    # One loop per slot count, so each is a plain loop that vectorises.
    p, g, a, b, c, d = arrays
    if flags[F.four]:
        for i in range(start, stop, stride):
            gi = g[i]
            p[i] += gi
            a[i] += gi
            b[i] += gi
            c[i] += gi
            d[i] += gi
    elif flags[F.three]:
        for i in range(start, stop, stride):
            gi = g[i]
            p[i] += gi
            a[i] += gi
            b[i] += gi
            c[i] += gi
    elif flags[F.two]:
        for i in range(start, stop, stride):
            gi = g[i]
            p[i] += gi
            a[i] += gi
            b[i] += gi
    elif flags[F.one]:
        for i in range(start, stop, stride):
            gi = g[i]
            p[i] += gi
            a[i] += gi
    else:
        for i in range(start, stop, stride):
            p[i] += g[i]


def touch_prepare(present, columns, scalars, flags, start, stop, stride):
    pass


# each slot count compiles its own walk with its loop alone (Rule.variants)
RULE = Rule(name="roofline", span=touch_span, prepare=touch_prepare, helpers=(),
            slots=("a", "b", "c", "d"), columns={}, flags=Flags, variants=Flags._fields)


class Roofline:
    """Same-traffic kernel over a copy of ``buffer``'s layout with ``n_slots`` state arrays;
    the gradient buffer is only read."""

    def __init__(self, buffer, n_slots: int):
        if n_slots > MAX_SLOTS:
            raise ValueError(f"the roofline kernel touches at most {MAX_SLOTS} state slots")
        self.layout = buffer
        params = np.zeros_like(buffer.params)
        slots = [np.zeros_like(buffer.params) for _ in range(n_slots)]
        self.arrays = (params, buffer.grads, *slots, *[params] * (MAX_SLOTS - n_slots))
        self.flags = tuple(n_slots == count for count in range(1, MAX_SLOTS + 1))
        self.kernels = cpu.compile_rule(RULE)
        self.scalars = np.zeros(0, buffer.dtype)

    def step(self) -> None:
        self.kernels.step(self.arrays, self.scalars, (), self.flags, self.layout,
                          self.scalars.dtype.type(1), False)
