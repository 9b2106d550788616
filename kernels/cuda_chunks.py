"""The chunk walk of every CUDA kernel over a flat buffer, written once.

The layout is the CPU's (``kernels/cpu.py``): chunks of ``chunk_size`` elements of a buffer of
``total``, ``chunk_first[c]`` the first parameter reaching into chunk ``c``. Blocks
grid-stride over the chunks, and for every present parameter ``k`` of a chunk the walk calls
``visit(context, state, k, start, stop)`` on the overlap ``[start, stop)`` of the two.
``context`` holds the kernel's arguments the visit reads, ``state`` what a thread carries from
one overlap to the next (a gradient reduction's running totals; None where nothing is
carried): the visit returns it, and the walk returns the last one.

A kernel calls the walk its maker bound with :func:`chunk_walk` (as ``walk``); the visit and
the walk are device functions inlined into the kernel by Numba (``inline="always"``), so NVVM
gets each kernel as the loop written by hand (left to NVVM, the extra call levels changed
what it unrolled and unswitched). A kernel cached on disk that inlines the walk carries
:data:`FINGERPRINT` in its name (``kernels.cuda.reduce_gradients_kernel``): Numba's cache
checks the kernel's own file only, so an edit here must change the name it is cached under.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

from numba import uint64

from ._bind import instantiate
from .cuda_launch import cuda

FINGERPRINT = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:8]
"""A digest of this file: part of the name of a disk-cached kernel that inlines the walk."""


def _walk(present, offsets, sizes, chunk_first, chunk_size, total, context, state):
    n_params = offsets.size
    for c in range(cuda.blockIdx.x, chunk_first.size, cuda.gridDim.x):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                state = visit(context, state, k, max(lo, offsets[k]),  # noqa: F821 (bound)
                              min(hi, offsets[k] + sizes[k]))
            k += 1
    return state


def chunk_walk(visit, name: str, **bound):
    """The walk calling ``visit`` (a template: a plain function of a backend module, whose
    ``bound`` names are resolved as ``_bind.instantiate`` resolves them), as a device function
    named ``chunk_walk_<name>``."""
    device = cuda.jit(device=True, inline="always")
    visit = device(instantiate(visit, f"{visit.__name__.lstrip('_')}_{name}", **bound))
    return device(instantiate(_walk, f"chunk_walk_{name}", visit=visit))


@cuda.jit(device=True, inline="always")
def thread_elements(start, stop):
    """This thread's elements of the overlap ``[start, stop)``: ``range``'s start, stop and
    stride, the threads of a block striding over it (so loads and stores coalesce).
    Unsigned: Numba then drops its negative-index wrap (an add and a live array length per
    access)."""
    return uint64(start + cuda.threadIdx.x), uint64(stop), uint64(cuda.blockDim.x)


__all__ = ["chunk_walk", "thread_elements"]
