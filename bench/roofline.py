"""The roofline kernel: an optimizer's memory traffic with trivial arithmetic.

It reads the gradient and reads and writes the parameters and each state slot the optimizer's
settings use (the schema's ``bytes_per_element``: Adam float32 28 B, SGD with momentum 20 B),
through flatopt's own CPU chunk walk over the same buffer layout, serial below the same size
threshold. Its time is what the memory system allows for exactly flatopt's traffic.
"""

from __future__ import annotations

import numpy as np

from flatopt.kernels import cpu
from flatopt.kernels.rule import Rule


def touch_span(arrays, scalars, columns, flags, k, start, stop, stride):
    g = arrays[1]
    for j in range(len(arrays)):
        if j != 1:
            target = arrays[j]
            for i in range(start, stop, stride):
                target[i] += g[i]


def touch_prepare(present, columns, scalars, flags, start, stop, stride):
    pass


RULE = Rule(name="roofline", span=touch_span, prepare=touch_prepare, helpers=(),
            slots=(), columns={})


class Roofline:
    """Same-traffic kernel over a copy of ``buffer``'s layout with ``n_slots`` state arrays;
    the gradient buffer is only read."""

    def __init__(self, buffer, n_slots: int):
        self.layout = buffer
        self.arrays = (np.zeros_like(buffer.params), buffer.grads,
                       *(np.zeros_like(buffer.params) for _ in range(n_slots)))
        self.kernels = cpu.compile_rule(RULE)
        self.scalars = np.zeros(0, buffer.dtype)

    def step(self) -> None:
        self.kernels.step(self.arrays, self.scalars, (), (), self.layout)
