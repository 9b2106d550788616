"""Test setup, done before numba is imported anywhere:

- a fresh Numba cache directory per run, so edited kernels are never masked by a stale cache;
  under pytest-xdist (``-n``) the workers share the one their controller made, so a kernel one
  worker compiled loads in the others (Numba writes its cache files atomically);
- Numba's CUDA simulator, so the CUDA kernels run on the CPU here (set NUMBA_ENABLE_CUDASIM=0
  on a machine with a GPU to run them on the device instead).
"""

import os
import tempfile

if "PYTEST_XDIST_WORKER" not in os.environ or "FLATOPT_TEST_NUMBA_CACHE" not in os.environ:
    os.environ["FLATOPT_TEST_NUMBA_CACHE"] = tempfile.mkdtemp(prefix="flatopt-numba-cache-")
os.environ["NUMBA_CACHE_DIR"] = os.environ["FLATOPT_TEST_NUMBA_CACHE"]
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
