"""Stateless kernels behind flatopt's optimizers (installed as ``flatopt.kernels``).

``rules/`` holds one module per update rule (its element-wise body, span and prepare
functions, and the layouts of their arguments, see :class:`rule.Rule`); ``cpu`` and ``cuda``
are the backends, each compiling every rule into kernels over whole flat buffers with one chunk
walk. :func:`backend` is the dispatch point the optimizers call.
"""

from __future__ import annotations

from .cpu import COUNT_NONFINITE, MAX_ABS, SUM_POWERS, SUM_SQUARES, CpuBackend

__all__ = ["backend", "COUNT_NONFINITE", "MAX_ABS", "SUM_POWERS", "SUM_SQUARES"]
"""The modes of the gradient reductions (norms, non-finite counts) every backend runs."""


def backend(name: str = "cpu"):
    """The backend called ``name``: ``"cpu"`` (Numba, host memory) or ``"cuda"`` (numba-cuda,
    imported only when asked for, as an optional dependency)."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend()
    raise ValueError(f"unknown kernel backend {name!r}: 'cpu' or 'cuda'")
