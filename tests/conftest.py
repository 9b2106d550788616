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

# FLATOPT_COMPILE_SECONDS=<file>: each test process appends the seconds it spent in Numba's
# compiler (the outermost compile of each dispatcher: what a warm cache would save) and how
# many compiles, so a run shows how much of its time is compiling (docs/guide/tests.md).
_compiling = {"seconds": 0.0, "count": 0, "depth": 0}


def pytest_configure(config):
    if not os.environ.get("FLATOPT_COMPILE_SECONDS"):
        return
    import time
    from numba.core import dispatcher

    compile_ = dispatcher.Dispatcher.compile

    def timed(self, sig):
        start = time.perf_counter()
        _compiling["depth"] += 1
        try:
            return compile_(self, sig)
        finally:
            _compiling["depth"] -= 1
            if _compiling["depth"] == 0:
                _compiling["seconds"] += time.perf_counter() - start
                _compiling["count"] += 1

    dispatcher.Dispatcher.compile = timed


def pytest_unconfigure(config):
    path = os.environ.get("FLATOPT_COMPILE_SECONDS")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} "
                    f"{_compiling['seconds']:.1f} {_compiling['count']}\n")
