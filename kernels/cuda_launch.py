"""Making and launching flatopt's CUDA kernels, in one place.

Every kernel is made by :func:`make`: ``cuda.jit`` over one of the backends' functions, filed
under its name (the function's qualname: a rule's kernels carry the rule's name, fingerprint
and exactness) with its :class:`Source`, the module-level call that makes it. Every launch goes
through :func:`launch`. Together they let another process make the kernel a run launched from
the same functions and compile it with the same options: ``bench/cuda_launches.py`` records,
in Numba's simulator, what every optimizer configuration launches (:func:`recording`), and
``bench/cuda_static.py`` compiles each recorded kernel to PTX and SASS for real GPUs, on a
machine without one (:func:`remake`), so what CI compiles is what a GPU runs.

Every kernel declares launch bounds (``.maxntid THREADS_PER_BLOCK, .minnctapersm
MIN_BLOCKS`` in its PTX, honoured by ptxas and by the driver's JIT): a multiprocessor of
compute capability 8.0 to 9.0 then keeps at least ``MIN_BLOCKS`` blocks resident, half the
2,048 threads it holds, so the memory-bound walks keep enough loads in flight; ptxas keeps
such a kernel within 64 registers a thread (the compile tests check it spills nothing to get
there). The rules' walks over float64 data are the exception (``WIDE_MIN_BLOCKS``). The
simulator takes no launch bounds.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, NamedTuple

from numba import typeof, types

from ._cuda_import import numba_cuda, simulated

cuda = numba_cuda()

THREADS_PER_BLOCK = 256
"""The block size of every launch (the 8-bit walks' blocks are the 256-element 8-bit block;
tests may launch fewer threads, never more)."""
MIN_BLOCKS = 4
"""Blocks of ``THREADS_PER_BLOCK`` a multiprocessor must hold at once (launch bounds)."""
WIDE_MIN_BLOCKS = 2
"""The same for the rules' walks over float64 data: every value takes two registers and
IEEE float64 division and square root are instruction sequences, so the busiest rules need
up to about 96 registers, which 64 would spill; two blocks (a quarter of the threads, moving
8-byte elements: the bytes in flight of four blocks over float32) keep them unspilled."""
MAX_BLOCKS = 65_535


class Source(NamedTuple):
    """How a kernel is made: ``maker(*arguments)`` (module-level, so a Source pickles) makes
    it and files it; ``maker`` None: made when its module is imported."""

    maker: Callable | None = None
    arguments: tuple = ()


class Launch(NamedTuple):
    """One recorded launch: the kernel's name and source, the block size, the Numba types of
    the arguments (what the kernel is compiled for) and the values of its flags and other
    booleans and integers (None for every other argument)."""

    kernel: str
    source: Source
    threads: int
    types: tuple
    values: tuple = ()


KERNELS: dict[str, object] = {}
"""Every kernel made in this process, by name."""
SOURCES: dict[str, Source] = {}
_recorder: list | None = None
_running = False


def kernel_name(kernel) -> str:
    """The name a kernel is filed under (its Python function's qualname)."""
    return getattr(kernel, "py_func", kernel).__qualname__


def make(function: Callable, source: Source = Source(), min_blocks: int = MIN_BLOCKS,
         **options):
    """``cuda.jit(**options)(function)`` with launch bounds of ``min_blocks`` blocks per
    multiprocessor, filed under the function's qualname (which must be new, or come from the
    same source)."""
    name = function.__qualname__
    if SOURCES.get(name, source) != source:
        raise TypeError(f"two CUDA kernels are named {name!r}")
    if not simulated():
        options["launch_bounds"] = (THREADS_PER_BLOCK, min_blocks)
    kernel = KERNELS[name] = cuda.jit(**options)(function)
    SOURCES[name] = source
    return kernel


def remake(name: str, source: Source):
    """The kernel ``name`` made by ``source`` in this process."""
    if name not in KERNELS and source.maker is not None:
        source.maker(*source.arguments)
    return KERNELS[name]


def argument_type(value):
    """The Numba type a launch on a GPU gives ``value``. The simulator's device arrays wrap a
    NumPy array, typed as a device array of its layout would be (the simulator's own typing
    calls an empty array broadcast, layout "A"; a GPU's calls it "C")."""
    if isinstance(value, tuple):
        return types.BaseTuple.from_types([argument_type(item) for item in value])
    wrapped = getattr(value, "_ary", None)
    return typeof(value if wrapped is None else wrapped)


def _setting(value):
    """``value`` if it is a Python bool or int or a tuple of them (a flag, a format, a mode),
    else None."""
    if isinstance(value, tuple):
        return value if all(isinstance(item, (bool, int)) for item in value) else None
    return value if isinstance(value, (bool, int)) else None


def launch(kernel, blocks: int, threads: int, stream, *args) -> None:
    """``kernel[blocks, threads, stream](*args)``; inside :func:`recording`, recorded (and
    run only if it says so)."""
    if _recorder is not None:
        name = kernel_name(kernel)
        _recorder.append(Launch(name, SOURCES[name], threads,
                                tuple(map(argument_type, args)), tuple(map(_setting, args))))
        if not _running:
            return
    kernel[blocks, threads, stream](*args)


def grid(n: int) -> int:
    """Blocks for ``n`` units of ``THREADS_PER_BLOCK`` threads' work (chunks are one block's)."""
    return max(1, min(n, MAX_BLOCKS))


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[Launch]]:
    """Inside the block each launch is appended to the list it yields, and runs only with
    ``run`` (without, nothing reads back what a kernel would have written)."""
    global _recorder, _running
    if _recorder is not None:
        raise RuntimeError("CUDA launches are already being recorded")
    _recorder, _running = [], run
    try:
        yield _recorder
    finally:
        _recorder, _running = None, False


__all__ = ["THREADS_PER_BLOCK", "MIN_BLOCKS", "WIDE_MIN_BLOCKS", "MAX_BLOCKS", "Source", "Launch", "KERNELS",
           "SOURCES", "kernel_name", "argument_type", "make", "remake", "launch", "grid", "recording"]
