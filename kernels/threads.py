"""When a CPU kernel runs on Numba's threads, and kernels compiled for both ways.

Every CPU kernel that has a ``prange`` loop is a :class:`Threaded`: one Python function compiled
twice. ``serial`` is compiled without ``parallel=True``, so ``prange`` is ``range`` and nothing in
it calls Numba's thread pool: a small buffer is updated on the calling thread with no launch and
no wake-up of worker threads. ``parallel`` has its ``prange`` loop as its only parallel region:
in a ``parallel=True`` function ``np.zeros``, ``.sum()`` and array expressions are parallel loops
too, each a launch of its own, so these kernels allocate with ``np.empty`` and combine partial
results in plain loops (``tests/test_threads.py`` counts the regions in the compiled code). Both
compute the same values in the same order, so the choice never changes a result.

Which one runs (the *policy*, ``FLATOPT_PARALLEL`` or :func:`set_policy`):

- ``"auto"`` (default): below :data:`PARALLEL_MIN_ELEMENTS`, with one Numba thread or one usable
  core (CPU affinity and a container's CPU quota), serial; a parallel call runs on at most
  the usable cores' worth of threads. Above, each kernel times both ways for each size it is called with and runs the
  faster, trying the other again every :data:`RETRY_EVERY` calls. Measured because the answer
  depends on where the step runs: back to back the threads win (2x on 2 cores); right after
  NumPy matmuls, BLAS's idle threads spin on the other cores for milliseconds and Numba's
  workers wait for them (the same step took 4 ms in parallel, 1 ms serially); beside a busy
  process, 13-29 ms against 2 ms (``python -m bench.inloop``).
- ``"always"``: parallel above the size threshold (the previous behaviour, for benchmarks).
- ``"never"``: every kernel on the calling thread.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from numba import get_num_threads, njit, set_num_threads

from ..errors import EnvironmentVariableError
from ._bind import instantiate

# Below this many elements a kernel always runs on the calling thread: a parallel launch pays
# off back to back from ~32K elements, but in a training loop the workers have gone to sleep
# between steps and waking them costs tens of microseconds on a quiet machine.
PARALLEL_MIN_ELEMENTS = 1 << 17
RETRY_EVERY = 64
"""In ``"auto"``, every this many calls of a size the way not chosen runs once (its time is
what it costs now: BLAS threads and other processes come and go)."""
POLICIES = ("auto", "always", "never")


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def _usable_cores(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity, and a container's CPU quota
    (cgroup v2 ``cpu.max``: "quota period", or "max"), whichever is smaller."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return cores


USABLE_CORES = _usable_cores()
_policy: str | None = "auto"
"""None while ``FLATOPT_PARALLEL`` holds an unknown value (and no :func:`set_policy` since)."""
_environment_problem = ""


def set_policy(policy: str) -> str:
    """Set when threaded kernels run in parallel (``"auto"``, ``"always"``, ``"never"``, see
    the module docstring); returns the previous policy."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"parallel policy must be one of {POLICIES}, got {policy!r}")
    previous, _policy = _policy, policy
    return "auto" if previous is None else previous


def get_policy() -> str:
    check_policy()
    return _policy


def check_policy() -> None:
    """Raise :class:`EnvironmentVariableError` while ``FLATOPT_PARALLEL`` names no policy:
    called where an operation over several buffers begins, so that it fails before it
    changes anything (a kernel call raises it too)."""
    if _policy is None:
        raise EnvironmentVariableError(_environment_problem)


def _policy_from_environment(value: str | None) -> None:
    """The policy ``FLATOPT_PARALLEL`` names. An unknown value does not fail the import (so
    ``flatopt inspect`` and checkpoint reading still work): it is kept as a problem that the
    first threaded kernel call raises, until :func:`set_policy` chooses one."""
    global _policy, _environment_problem
    policy = (value or "").strip().lower() or "auto"
    if policy in POLICIES:
        _policy, _environment_problem = policy, ""
    else:
        _policy = None
        _environment_problem = (f"environment variable FLATOPT_PARALLEL={value!r} is not one "
                                f"of {', '.join(POLICIES)}; unset it or pick one (or call "
                                "flatopt.set_parallel_policy() before stepping)")


def run_serially(n_elements: int) -> bool:
    """Whether a kernel call over ``n_elements`` stays on the calling thread whatever the
    timings say."""
    check_policy()  # first: whether it raises must not depend on the buffer's size
    return (n_elements < PARALLEL_MIN_ELEMENTS or _policy == "never" or USABLE_CORES == 1
            or get_num_threads() == 1)


class _Timings:
    """Recent seconds per call of each way for one size (exponential averages), and whether
    each has run once (its first call may load or compile it: not counted)."""

    __slots__ = ("seconds", "warm", "calls", "retry")

    def __init__(self):
        self.seconds = [0.0, 0.0]  # serial, parallel
        self.warm = [False, False]
        self.calls = 0
        self.retry = False

    def choose(self) -> int:
        self.calls += 1
        for way in (0, 1):
            if not self.warm[way] or not self.seconds[way]:
                return way
        best = 0 if self.seconds[0] <= self.seconds[1] else 1
        if self.retry or self.calls % RETRY_EVERY == 0:
            self.retry = False
            return 1 - best
        return best

    def record(self, way: int, seconds: float) -> None:
        if not self.warm[way]:
            self.warm[way] = True
        elif not self.seconds[way]:
            self.seconds[way] = seconds
        else:
            # a call twice as slow as usual: conditions changed (BLAS threads started
            # spinning, a process got busy), so the other way's figure is stale: try it next
            self.retry = seconds > 2 * self.seconds[way]
            self.seconds[way] = 0.75 * self.seconds[way] + 0.25 * seconds


class Threaded:
    """One kernel, compiled as ``serial`` and as ``parallel`` from the same function; calling
    it (``kernel(n_elements, *args)``) runs the way the policy picks for ``n_elements``.

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
        self.timings: dict[int, _Timings] = {}
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
        copy.timings = {}
        return copy

    def __call__(self, n_elements: int, *args):
        if run_serially(n_elements):
            return self.serial(*args)
        if _policy == "always":
            return self._parallel(*args)
        timings = self.timings.get(n_elements)
        if timings is None:
            timings = self.timings[n_elements] = _Timings()
        way = timings.choose()
        start = time.perf_counter()
        result = self._parallel(*args) if way else self.serial(*args)
        timings.record(way, time.perf_counter() - start)
        return result

    def _parallel(self, *args):
        """The parallel way on at most USABLE_CORES threads: Numba starts as many threads as
        the machine has cores, a container may grant fewer. Numba's thread count is per
        calling thread, so it is lowered for this call only and put back."""
        threads = get_num_threads()
        if threads <= USABLE_CORES:
            return self.parallel(*args)
        set_num_threads(USABLE_CORES)
        try:
            return self.parallel(*args)
        finally:
            set_num_threads(threads)

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


_policy_from_environment(os.environ.get("FLATOPT_PARALLEL"))

__all__ = ["ALL", "PARALLEL_MIN_ELEMENTS", "POLICIES", "RETRY_EVERY", "Threaded", "USABLE_CORES",
           "check_policy", "get_policy", "run_serially", "set_policy", "threaded"]
