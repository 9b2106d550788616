"""The CPU backend: every rule compiled into two Numba kernels over one flat buffer.

A buffer holds many parameters back to back (with alignment padding between them). Work is cut
into fixed-size element chunks, independent of parameter boundaries, so threads get even work
whether the buffer holds one huge tensor or thousands of small ones. ``chunk_first[c]`` is the
slot of the first parameter that reaches into chunk ``c``; a chunk walks the parameters it
overlaps and hands each overlap to the rule's ``span``, so padding is never touched. This walk
is written once (``_step_walk``); every rule plugs its span into it. Per-parameter bookkeeping
runs first, serially, in ``_prepare_walk`` (a parameter spanning several chunks is counted once).

How the element loops are kept fast (each point was measured; see ``bench/``):

- ``error_model="numpy"``: with Numba's default ("python") every float division checks for
  zero to raise ``ZeroDivisionError``, a branch per element that stops LLVM from vectorising.
  IEEE division is what torch does anyway.
- Spans run over unsigned (``uint64``) index ranges with a stride of one: with signed indices
  Numba's negative-index wraparound check could not be proved dead and the loop stayed scalar.
- Flags stay run-time arguments: once the loop vectorises, LLVM hoists or selects the rule's
  flag branches. Flags that change which arrays are written (AMSGrad, SGD's momentum) get
  separate loops in the span.
- Small buffers (below ``PARALLEL_MIN_ELEMENTS``), and any buffer when Numba runs on one
  thread, take a serial path inside the same kernel (``serial=True``, see :func:`run_serially`):
  the parallel launch's fixed cost exceeds the whole update of a small buffer.
- Kernels are cached on disk (``cache=True``) under the rule's name and source fingerprint,
  so a process loads them instead of compiling, and an edited rule compiles afresh.
"""

from __future__ import annotations

from typing import NamedTuple

from numba import get_num_threads, njit, prange, uint64

from .._layout import aligned_zeros
from ._bind import bind, instantiate
from .rule import Rule

# Below this many elements a buffer is updated on the calling thread. In a back-to-back loop a
# parallel launch costs a few microseconds and pays off from ~32K elements, but in a training
# loop the forward and backward passes run between steps, the worker threads have gone to sleep
# and waking them costs tens of microseconds (more when BLAS threads compete for the cores):
# the demo's 74K-element buffer took 75-87 us serially against 80-650 us in parallel on 2 cores.
PARALLEL_MIN_ELEMENTS = 1 << 17


def _prepare_walk(present, columns, scalars, flags):
    """Prepare every parameter with a gradient, in order; returns how many there are."""
    n_present = 0
    for k in range(present.size):
        if present[k] != 0:
            n_present += 1
    if n_present:
        prepare(present, columns, scalars, flags, 0, present.size, 1)  # noqa: F821 (bound)
    return n_present


def _step_walk(arrays, scalars, columns, flags, present, offsets, sizes, chunk_first,
               chunk_size, serial):
    n_params = offsets.size
    total = arrays[0].size
    one = uint64(1)
    if serial:
        for k in range(n_params):
            if present[k] != 0:
                span(arrays, scalars, columns, flags, k, uint64(offsets[k]),  # noqa: F821
                     uint64(offsets[k] + sizes[k]), one)
        return
    for c in prange(chunk_first.size):
        lo = c * chunk_size
        hi = min(lo + chunk_size, total)
        k = chunk_first[c]
        while k < n_params and offsets[k] < hi:
            if present[k] != 0:
                span(arrays, scalars, columns, flags, k, uint64(max(lo, offsets[k])),  # noqa: F821
                     uint64(min(hi, offsets[k] + sizes[k])), one)
            k += 1


def run_serially(n_elements: int) -> bool:
    """Whether a buffer of ``n_elements`` should skip the parallel launch."""
    return n_elements < PARALLEL_MIN_ELEMENTS or get_num_threads() == 1


class CompiledRule(NamedTuple):
    """A rule's two CPU kernels (Numba dispatchers, compiled on first call or loaded)."""

    prepare_kernel: object
    step_kernel: object

    def prepare(self, present, columns, scalars, flags) -> int:
        return self.prepare_kernel(present, columns, scalars, flags)

    def step(self, arrays, scalars, columns, flags, layout) -> None:
        self.step_kernel(arrays, scalars, columns, flags, layout.present, layout.offsets,
                         layout.sizes, layout.chunk_first, layout.chunk_size,
                         run_serially(layout.length))


_compiled: dict[tuple[str, bool], CompiledRule] = {}


def compile_rule(rule: Rule, cache: bool = True) -> CompiledRule:
    """The rule's CPU kernels (one pair per rule and fingerprint, per process). ``cache=False``
    gives kernels that always compile in this process (to inspect their LLVM IR)."""
    key = f"{rule.name}_{rule.fingerprint}"
    compiled = _compiled.get((key, cache))
    if compiled is None:
        functions = bind(rule, njit(inline="always", error_model="numpy"))
        prepare = njit(cache=cache)(instantiate(
            _prepare_walk, f"prepare_{key}", prepare=functions[rule.prepare.__name__]))
        step = njit(parallel=True, cache=cache, error_model="numpy")(instantiate(
            _step_walk, f"step_{key}", span=functions[rule.span.__name__]))
        compiled = _compiled[key, cache] = CompiledRule(prepare, step)
    return compiled


class CpuBackend:
    """Buffers in host memory, stepped by the kernels above."""

    name = "cpu"

    @staticmethod
    def compile(rule: Rule) -> CompiledRule:
        return compile_rule(rule)

    @staticmethod
    def zeros(n_elements: int, dtype):
        """A zero-filled buffer, 64-byte aligned (see ``flatopt._layout``)."""
        return aligned_zeros(n_elements, dtype)

    def __repr__(self) -> str:
        return "CpuBackend()"


__all__ = ["CpuBackend", "CompiledRule", "compile_rule", "run_serially",
           "PARALLEL_MIN_ELEMENTS"]
