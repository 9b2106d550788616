"""A rule whose span makes a call the CUDA target does not support (``np.zeros``: a kernel
cannot allocate; the CPU's Numba compiles it, the simulator runs it):
``tests/test_cuda_compile.py`` checks that the compile check fails on it. A module of its own,
so that a compile worker can import it."""

import numpy as np

from flatopt.kernels.rule import Rule
from flatopt.kernels.tools import untouched_prepare


def broken_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g = arrays
    previous = np.zeros(1, np.float32)
    for i in range(start, stop, stride):
        previous[0] = p[i]
        p[i] = previous[0] - g[i]


BROKEN = Rule(name="broken", span=broken_span, prepare=untouched_prepare, helpers=(),
              slots=(), columns={})
