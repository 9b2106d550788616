"""Test setup: a fresh Numba cache directory per run, so edited kernels are never masked by a
stale cache (set before numba is imported anywhere)."""

import os
import tempfile

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flatopt-numba-cache-")
