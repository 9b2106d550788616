"""When a CPU kernel runs on Numba's threads, and kernels compiled for both ways.

Every CPU kernel that has a ``prange`` loop is a :class:`Threaded`: one Python function compiled
twice. ``serial`` is compiled without ``parallel=True``, so ``prange`` is ``range`` and nothing in
it calls Numba's thread pool: a small buffer is updated on the calling thread with no launch and
no wake-up of worker threads (which, right after NumPy's BLAS or beside a busy process, wait for
a core: milliseconds). ``parallel`` has its ``prange`` loop as its only parallel region: in a
``parallel=True`` function ``np.zeros``, ``.sum()`` and array expressions are parallel loops too,
each a launch of its own, so these kernels allocate with ``np.empty`` and combine partial results
in plain loops (``tests/test_threads.py`` counts the regions in the compiled code).

:func:`run_serially` picks between the two by the number of elements a call touches.
"""

from __future__ import annotations

from typing import Callable

from numba import get_num_threads, njit

from ._bind import instantiate

# Below this many elements a kernel runs on the calling thread. In a back-to-back loop a parallel
# launch pays off from ~32K elements, but in a training loop the worker threads have gone to
# sleep between steps, and waking them costs tens of microseconds on a quiet machine and
# milliseconds when BLAS's spinning threads or another process hold the cores
# (``python -m bench.inloop``).
PARALLEL_MIN_ELEMENTS = 1 << 17


def run_serially(n_elements: int) -> bool:
    """Whether a kernel call over ``n_elements`` should stay on the calling thread."""
    return n_elements < PARALLEL_MIN_ELEMENTS or get_num_threads() == 1


class Threaded:
    """One kernel, compiled as ``serial`` and as ``parallel`` from the same function (so both
    compute the same values in the same order wherever the order is fixed by the code).

    The two are compiled under different names (``<name>_serial``, ``<name>_parallel``): Numba's
    on-disk cache is keyed by name and signature, not by compile options, so one name for both
    would let either load the other's machine code."""

    def __init__(self, function: Callable, name: str, *, cache: bool = True,
                 bound: dict[str, Callable] | None = None, **options):
        self.name = name
        self.function = function
        self.bound = bound or {}
        self.options = options
        self.serial = njit(cache=cache, **options)(self._named("serial"))
        self.parallel = njit(parallel=True, cache=cache, **options)(self._named("parallel"))
        ALL.append(self)

    def _named(self, way: str) -> Callable:
        return instantiate(self.function, f"{self.name}_{way}", **self.bound)

    def uncached(self) -> "Threaded":
        """The same kernel compiled afresh in this process (its LLVM IR can be inspected; one
        loaded from the disk cache has none). Not listed in :data:`ALL`."""
        copy = Threaded.__new__(Threaded)
        copy.name, copy.function, copy.bound, copy.options = (self.name, self.function,
                                                              self.bound, self.options)
        copy.serial = njit(cache=False, **self.options)(self._named("serial"))
        copy.parallel = njit(parallel=True, cache=False, **self.options)(self._named("parallel"))
        return copy

    def for_size(self, n_elements: int):
        """``serial`` or ``parallel``, by :func:`run_serially`."""
        return self.serial if run_serially(n_elements) else self.parallel

    def __repr__(self) -> str:
        return f"Threaded({self.name!r})"


ALL: list[Threaded] = []
"""Every threaded kernel made in this process (the tests inspect them all)."""


def threaded(**options) -> Callable[[Callable], Threaded]:
    """Decorator: ``@threaded(cache=True, error_model="numpy")`` over a module-level kernel."""
    def decorate(function: Callable) -> Threaded:
        return Threaded(function, f"{function.__module__.rsplit('.', 1)[-1]}."
                        f"{function.__qualname__}", **options)
    return decorate


__all__ = ["ALL", "PARALLEL_MIN_ELEMENTS", "Threaded", "run_serially", "threaded"]
