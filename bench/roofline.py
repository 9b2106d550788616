"""The roofline kernel: the optimizer's memory traffic with trivial arithmetic.

For Adam/AdamW it reads ``p, g, m, v`` and writes ``p, m, v`` (7 arrays' worth of bytes per
element, 28 B in float32); for SGD with momentum it reads ``p, g, buf`` and writes ``p, buf``
(5 arrays, 20 B). It walks the same flat buffer in the same chunks as flatopt's kernels, and
runs serially below the same size threshold, so its time is what the memory system allows for
exactly flatopt's traffic.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from flatopt._layout import CHUNK_ELEMENTS
from flatopt.kernels import cpu


def _parallel_min_elements() -> int:
    return int(getattr(cpu, "PARALLEL_MIN_ELEMENTS", 0))


@njit(parallel=True, cache=True, error_model="numpy")
def _touch3_parallel(p, g, m, v, chunk_size):
    n_chunks = (p.size + chunk_size - 1) // chunk_size
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, p.size)
        pc, gc, mc, vc = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        for i in range(hi - lo):
            gi = gc[i]
            pc[i] += gi
            mc[i] += gi
            vc[i] += gi


@njit(cache=True, error_model="numpy")
def _touch3_serial(p, g, m, v):
    for i in range(p.size):
        gi = g[i]
        p[i] += gi
        m[i] += gi
        v[i] += gi


@njit(parallel=True, cache=True, error_model="numpy")
def _touch2_parallel(p, g, b, chunk_size):
    n_chunks = (p.size + chunk_size - 1) // chunk_size
    for c in prange(n_chunks):
        lo = c * chunk_size
        hi = min(lo + chunk_size, p.size)
        pc, gc, bc = p[lo:hi], g[lo:hi], b[lo:hi]
        for i in range(hi - lo):
            gi = gc[i]
            pc[i] += gi
            bc[i] += gi


@njit(cache=True, error_model="numpy")
def _touch2_serial(p, g, b):
    for i in range(p.size):
        gi = g[i]
        p[i] += gi
        b[i] += gi


def bytes_per_element(optimizer: str, dtype) -> int:
    """Bytes an optimizer step must move per element: reads plus writes."""
    arrays = 5 if optimizer == "sgd" else 7
    return arrays * np.dtype(dtype).itemsize


class Roofline:
    """Same-traffic kernel over flat arrays of ``length`` elements; ``grads`` is read only."""

    def __init__(self, optimizer: str, grads: np.ndarray):
        self.grads = grads
        n_state = 1 if optimizer == "sgd" else 2
        self.arrays = [np.zeros_like(grads) for _ in range(1 + n_state)]
        self.parallel = grads.size >= _parallel_min_elements()

    def step(self) -> None:
        g = self.grads
        if len(self.arrays) == 3:
            p, m, v = self.arrays
            if self.parallel:
                _touch3_parallel(p, g, m, v, CHUNK_ELEMENTS)
            else:
                _touch3_serial(p, g, m, v)
        else:
            p, b = self.arrays
            if self.parallel:
                _touch2_parallel(p, g, b, CHUNK_ELEMENTS)
            else:
                _touch2_serial(p, g, b)
