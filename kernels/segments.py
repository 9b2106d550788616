"""The CPU reduce walks' bookkeeping, shared by the plain walk (``kernels/cpu.py``) and the
coded one (``kernels/coded.py``): a reduce pass keeps each chunk-parameter overlap's (each
*segment*'s) partial totals apart while chunks run in parallel, then adds them per parameter
in chunk order, so the totals do not depend on the thread count."""

from __future__ import annotations

import hashlib
import inspect
import sys

import numpy as np
from numba import njit


@njit(inline="always")
def overlaps(offsets, chunk_first, chunk_size, total, c):
    """How many parameters reach into chunk ``c``."""
    hi = min(c * chunk_size + chunk_size, total)
    k = chunk_first[c]
    count = 0
    while k < offsets.size and offsets[k] < hi:
        count += 1
        k += 1
    return count


@njit(inline="always")
def first_segments(offsets, chunk_first, chunk_size, total):
    """``first[c]``: the row of chunk ``c``'s first segment in the partial totals;
    ``first[n_chunks]`` is how many segments there are."""
    n_chunks = chunk_first.size
    first = np.empty(n_chunks + 1, np.int64)
    first[0] = 0
    for c in range(n_chunks):
        first[c + 1] = first[c] + overlaps(offsets, chunk_first, chunk_size, total, c)
    return first


@njit(inline="always")
def add_segments(sums, partial, first_segment, present, offsets, chunk_first, chunk_size,
                 total):
    """``sums[k]`` = the partial totals of parameter ``k``'s segments, added in chunk order
    (rows of absent parameters are never read)."""
    n_params = offsets.size
    for k in range(n_params):
        for j in range(sums.shape[1]):
            sums[k, j] = 0.0
    for c in range(chunk_first.size):
        hi = min(c * chunk_size + chunk_size, total)
        k = chunk_first[c]
        segment = first_segment[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                for j in range(sums.shape[1]):
                    sums[k, j] += partial[segment, j]
            k += 1
            segment += 1


FINGERPRINT = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:8]
"""In the names of the kernels that inline these (Numba's cache key): Numba's disk cache
checks the kernel's own source file only, so an edit here must change the name."""
