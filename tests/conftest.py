"""Test setup, done before numba is imported anywhere:

- a fresh Numba cache directory per run, so edited kernels are never masked by a stale cache;
- Numba's CUDA simulator, so the CUDA kernels run on the CPU here (set NUMBA_ENABLE_CUDASIM=0
  on a machine with a GPU to run them on the device instead).
"""

import os
import tempfile

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flatopt-numba-cache-")
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
