"""Importing numba-cuda, with the one compatibility fix it needs on current NumPy.

numba-cuda <= 0.30 registers an overload for ``np.row_stack`` while ``numba.cuda`` is imported;
NumPy 2.5 removed that alias of ``np.vstack``, so the import (and with it every kernel compile)
fails with ``module 'numpy' has no attribute 'row_stack'``. :func:`numba_cuda` puts the alias
back, only when it is missing and only right before the import: the one place flatopt imports
numba-cuda. It changes nothing on NumPy < 2.5, and on 2.5 the alias is what NumPy 2.4 had.
"""

from __future__ import annotations

import numpy as np


def numba_cuda():
    """The ``numba.cuda`` module (raises ImportError when numba-cuda is not installed)."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    from numba import cuda
    return cuda


def simulated() -> bool:
    """Whether numba runs CUDA kernels in its simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba import config
    return bool(config.ENABLE_CUDASIM)
