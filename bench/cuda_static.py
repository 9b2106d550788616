"""Every CUDA kernel flatopt can launch, compiled for real GPUs on a machine without one: PTX
for compute capability 8.0 and 9.0 (``numba.cuda.compile_ptx``, NVVM from the
``nvidia-cuda-nvcc-cu12`` wheel), assembled to SASS by that wheel's ``ptxas -v``, which
reports each kernel's registers, stack, spills and shared memory.

    python -m bench.cuda_static                  # every kernel, both targets: the tables
    python -m bench.cuda_static --fast           # the representative set the fast tests take

The kernels are the enumeration's (``bench/cuda_launches.py``: recorded in the simulator, so
they come from the same functions a GPU runs), made again here by the calls that made them
(``kernels/cuda_launch.remake``) and compiled with their own ``cuda.jit`` options (launch
bounds included) in worker processes without the simulator, one per compute capability.
numba-cuda compiles a kernel's device functions for the current device's compute capability
(``CUDADispatcher.compile_device`` asks the driver), so a worker stands in a device of the
target's (:func:`target`); the kernel itself is compiled with ``cc=`` as asked.

Numba (and flatopt's kernels with it) is imported only inside functions here: the command
sets ``NUMBA_ENABLE_CUDASIM`` first (on for the enumeration, off in the compile workers), and
Numba reads it once, at import.

For each kernel the PTX is searched too: ``ld.global``/``st.global`` by width (a whole
kernel's, so loops unrolled and unswitched by flag count several times: the per-element
traffic is :mod:`bench.cuda_traffic`'s), and double-precision instructions in a kernel whose
arithmetic is float32 (a Python float literal would promote it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple

TARGETS = ((8, 0), (9, 0))
"""Compute capabilities compiled for: Ampere (A100) and Hopper (H100, H200)."""
REGISTERS_PER_SM = 65_536
THREADS_PER_SM = 2_048
BLOCKS_PER_SM = 32
REGISTER_GRANULE = 256
"""Registers are allocated per warp in units of 256 (compute capability 8.0 to 9.0)."""
OCCUPANCY = 0.5
"""The share of an SM's threads a kernel must be able to keep resident."""
FLOAT32_FAMILIES = ("step", "coded step", "coded 8-bit block step", "scaling",
                    "scaling (16-bit)", "accumulation", "accumulation (16-bit)", "EMA lerp",
                    "EMA decode (16-bit)", "EMA encode (16-bit)", "state map")
"""Families whose arithmetic is in the buffer's dtype: a float32 kernel of these has no
double-precision instruction. (Totals add in float64; prepare and finalize compute in float64
as the CPU does.)"""
F64 = re.compile(r"^\s*(?:@%p\d+\s+)?(?:add|sub|mul|fma|div|sqrt|rcp|min|max|neg|abs|setp"
                 r"|cvt\.rn\.f32)\S*\.f64\b", re.M)
FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?fma\.", re.M)
GLOBAL = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.global(?:\.[a-z0-9]+)*)\s", re.M)
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                         r"spill loads")
PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def register_budget(threads: int, occupancy: float = OCCUPANCY) -> int:
    """The most registers a thread may use so that blocks of ``threads`` keep ``occupancy``
    of an SM's threads resident (compute capability 8.0 to 9.0: 64 for 256 threads at 50%,
    128 at 25%)."""
    warps = -(-threads // 32)
    for registers in range(255, 0, -1):
        per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
        blocks = min(BLOCKS_PER_SM, THREADS_PER_SM // threads,
                     REGISTERS_PER_SM // (per_warp * warps))
        if blocks * threads >= occupancy * THREADS_PER_SM:
            return registers
    return 0


def occupancy(registers: int, threads: int) -> float:
    """The share of an SM's threads blocks of ``threads`` using ``registers`` a thread keep
    resident (compute capability 8.0 to 9.0)."""
    per_warp = -(-max(registers, 1) * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    blocks = min(BLOCKS_PER_SM, THREADS_PER_SM // threads,
                 REGISTERS_PER_SM // (per_warp * -(-threads // 32)))
    return blocks * threads / THREADS_PER_SM


# ----------------------------------------------------------------------------- the compiler
def ptxas() -> str | None:
    """The ptxas of the ``nvidia-cuda-nvcc-cu12`` wheel (or ``$PTXAS``, or one on PATH)."""
    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"]
    try:
        import nvidia.cuda_nvcc as wheel  # the compiler wheels (the "cuda" extra)
        for root in wheel.__path__:
            path = Path(root) / "bin" / "ptxas"
            if path.exists():
                return str(path)
    except ImportError:
        pass
    return shutil.which("ptxas")


def compiler_problem() -> str | None:
    """Why kernels cannot be compiled here (numba-cuda, libNVVM or ptxas missing), or None."""
    try:
        import numba_cuda  # noqa: F401 (only whether it is installed)
    except ImportError:
        return "numba-cuda is not installed (pip install -e '.[cuda]')"
    if ptxas() is None:
        return "ptxas was not found (the nvidia-cuda-nvcc-cu12 wheel: pip install -e '.[cuda]')"
    done = subprocess.run([sys.executable, "-c", "from numba.cuda.cudadrv.nvvm import NVVM; "
                           "NVVM()"], env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"},
                          capture_output=True, text=True)
    if done.returncode:
        return f"libNVVM cannot be loaded: {done.stderr.strip().splitlines()[-1:]}"
    return None


class _Device(NamedTuple):
    compute_capability: tuple


@contextlib.contextmanager
def target(cc: tuple) -> Iterator[None]:
    """Device functions compiled for ``cc`` with no GPU: numba-cuda 0.30 compiles them for
    ``get_current_device().compute_capability`` (a driver call), looked up in its dispatcher
    module at each compile; a device of ``cc`` stands in meanwhile."""
    from numba.cuda import dispatcher
    if not hasattr(dispatcher, "get_current_device"):
        raise RuntimeError("this numba-cuda no longer looks up get_current_device in "
                           "numba.cuda.dispatcher: bench/cuda_static.py needs updating")
    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Device(cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


class Compiled(NamedTuple):
    """One kernel compiled for one target."""

    kernel: str
    family: str
    cc: tuple
    threads: int
    min_blocks: int
    """The blocks per SM its launch bounds ask for (0: none declared)."""
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int
    globals: dict
    """PTX ``ld.global``/``st.global`` instructions by opcode, over the whole kernel."""
    f64: int
    """Double-precision arithmetic instructions in the PTX."""
    float32: bool
    """No argument holds float64."""
    fma: int
    """Fused multiply-adds in the PTX (a rule's own ``fma`` calls, and, without bit_exact,
    what NVVM contracts)."""
    seconds: float
    error: str | None = None

    @property
    def budget(self) -> int:
        """Registers allowed: the occupancy its launch bounds declare, at least
        ``OCCUPANCY`` unless the kernel is a walk over float64 data
        (``cuda_launch.WIDE_MIN_BLOCKS``, explained in the README)."""
        declared = self.min_blocks * self.threads / THREADS_PER_SM
        return register_budget(self.threads, min(declared, OCCUPANCY) if self.wide
                               else OCCUPANCY)

    @property
    def wide(self) -> bool:
        """A rule's step or reduce walk over float64 data (lower launch bounds)."""
        return self.kernel.startswith("wide_")


def assemble(ptx: str, cc: tuple) -> str:
    """ptxas -v's report for ``ptx`` assembled for ``sm_<cc>`` (raises on an error)."""
    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas(), f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(source), "-o",
                               str(Path(directory) / "kernel.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {done.stderr.strip()}")
    return done.stderr + done.stdout


def compile_ptx(found, cc: tuple) -> tuple[str, int]:
    """The PTX of ``found``'s kernel (a ``bench.cuda_launches.Found``) for ``cc``, compiled
    as its ``cuda.jit`` options say (in a process without the simulator, inside
    :func:`target`), and the blocks per SM its launch bounds declare."""
    from flatopt.kernels._cuda_import import numba_cuda
    from flatopt.kernels.cuda_launch import remake
    launch = found.launch
    kernel = remake(launch.kernel, launch.source)
    options = {key: kernel.targetoptions[key] for key in
               ("debug", "lineinfo", "fastmath", "opt", "launch_bounds")
               if key in kernel.targetoptions}
    ptx, _ = numba_cuda().compile_ptx(kernel.py_func, launch.types, cc=cc, **options)
    bounds = options.get("launch_bounds") or ()
    return ptx, bounds[1] if len(bounds) > 1 else 0


def compile_one(found, cc: tuple) -> Compiled:
    """``found``'s kernel compiled for ``cc`` and assembled: what ptxas and the PTX say (an
    error is recorded, not raised)."""
    start = time.perf_counter()
    launch = found.launch
    try:
        ptx, min_blocks = compile_ptx(found, cc)
        report = assemble(ptx, cc)
    except Exception as exc:  # a kernel that does not compile is the finding itself
        message = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines()
                   if line.strip() and not line.strip().startswith(("raised from", "During"))]
        return Compiled(launch.kernel, found.family, cc, launch.threads, 0, 0, 0, 0, 0, 0, {},
                        0, is_float32(launch.types), 0, time.perf_counter() - start,
                        " | ".join(message[:8]))
    registers = int(PTXAS_REGISTERS.search(report).group(1))
    stack, stores, loads = map(int, PTXAS_FRAME.search(report).groups())
    shared = PTXAS_SMEM.search(report)
    counts: dict[str, int] = {}
    for opcode in GLOBAL.findall(ptx):
        counts[opcode] = counts.get(opcode, 0) + 1
    return Compiled(launch.kernel, found.family, cc, launch.threads, min_blocks, registers,
                    stack, stores, loads, int(shared.group(1)) if shared else 0, counts,
                    len(F64.findall(ptx)), is_float32(launch.types), len(FMA.findall(ptx)),
                    time.perf_counter() - start)


# ----------------------------------------------------------------------------- workers
def _traffic_row(found, cc: tuple) -> dict:
    from bench.cuda_traffic import per_element
    try:
        return {"kernel": found.launch.kernel, "counts": per_element(found, cc), "error": None}
    except Exception as exc:  # reported in the table
        return {"kernel": found.launch.kernel, "counts": {}, "error": f"{exc}"[:300]}


JOBS = {"compile": lambda found, cc: compile_one(found, cc)._asdict(), "traffic": _traffic_row}


def _worker(job: str, cc: tuple, source: str, out: str) -> None:
    """Run ``job`` (``JOBS``) for ``cc`` on the pickled list of ``Found`` in ``source``,
    results (JSON) to ``out``."""
    with open(source, "rb") as f:
        work = pickle.load(f)
    results = []
    with target(cc):
        for found in work:
            results.append(JOBS[job](found, cc))
            with open(out, "w") as f:  # written as it goes: a timed-out worker keeps them
                json.dump(results, f)


def run_workers(job: str, found: list, targets=TARGETS, timeout: float | None = None,
                workers: int | None = None) -> list[dict]:
    """``job`` over every ``Found`` for every target, in worker processes without the
    simulator (``workers`` at once: by default one per target), results in order of
    target, then ``found``."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flatopt-cuda-static-")  # nothing reused
    # a kernel's source unpickles where this process imports it from (a test's own rules)
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    per_target = max(1, (workers or len(targets)) // len(targets))
    results: list = [None] * (len(found) * len(targets))
    with tempfile.TemporaryDirectory() as directory:
        running = []
        for t, cc in enumerate(targets):
            for i in range(per_target):
                n = t * per_target + i
                source, out = Path(directory) / f"work{n}.pkl", Path(directory) / f"out{n}.json"
                with open(source, "wb") as f:
                    pickle.dump(found[i::per_target], f)
                places = range(t * len(found) + i, (t + 1) * len(found), per_target)
                running.append((out, places, subprocess.Popen(
                    [sys.executable, "-m", "bench.cuda_static", "--worker", job,
                     f"{cc[0]}.{cc[1]}", str(source), str(out)], cwd=root, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for out, places, process in running:
            try:
                output, _ = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            done = json.loads(out.read_text()) if out.exists() else []
            if len(done) < len(places):
                raise RuntimeError(f"a {job} worker stopped after {len(done)} of "
                                   f"{len(places)} kernels: {output.strip()[-2000:]}")
            for place, row in zip(places, done):
                results[place] = row
    return results


def compile_all(found: list, targets=TARGETS, timeout: float | None = None,
                workers: int | None = None) -> list[Compiled]:
    """Every kernel of ``found`` compiled for every target (:func:`run_workers`)."""
    return [Compiled(**{**row, "cc": tuple(row["cc"])})
            for row in run_workers("compile", found, targets, timeout, workers)]


# ----------------------------------------------------------------------------- checks
def problems(result: Compiled) -> list[str]:
    """What is wrong with one compiled kernel: it does not compile; it uses local memory
    (spills, or an array a runtime index keeps out of registers); it uses more registers
    than its budget; or a float32 kernel of ``FLOAT32_FAMILIES`` computes in float64."""
    where = f"{result.kernel} for sm_{result.cc[0]}{result.cc[1]}"
    if result.error:
        return [f"{where} does not compile: {result.error}"]
    found = []
    if result.spill_stores or result.spill_loads:
        found.append(f"{where} spills {result.spill_stores} B and reloads "
                     f"{result.spill_loads} B")
    elif result.stack:
        found.append(f"{where} keeps {result.stack} B in local memory (its stack frame)")
    if result.registers > result.budget:
        found.append(f"{where} uses {result.registers} registers, over the budget of "
                     f"{result.budget} for {result.threads}-thread blocks")
    if result.float32 and result.family in FLOAT32_FAMILIES and result.f64:
        found.append(f"{where} is a float32 kernel with {result.f64} double-precision "
                     "instructions")
    return found


def is_float32(argument_types) -> bool:
    """Whether a kernel's arguments hold no float64 (its arithmetic should be float32)."""
    from numba import types

    def wide(t):
        if isinstance(t, types.BaseTuple):
            return any(map(wide, t.types))
        return (t.dtype if isinstance(t, types.Array) else t) == types.float64
    return not any(map(wide, argument_types))


# ----------------------------------------------------------------------------- tables
def enumerate_and_compile(fast: bool, targets=TARGETS, timeout: float | None = None):
    """(the enumeration's ``Found`` list, their compile results) for every kernel, or, with
    ``fast``, the representatives' (``bench.cuda_launches.representatives``). Call with the
    simulator on (``NUMBA_ENABLE_CUDASIM=1`` before Numba is imported)."""
    from bench import cuda_launches
    names = cuda_launches.representatives() if fast else None
    found = list(cuda_launches.enumerate_launches(names).values())
    return found, compile_all(found, targets, timeout)


def summary(results: list[Compiled]) -> list[dict]:
    """One row per family: kernels (a function compiled for one signature) and functions,
    the most registers (and which kernel), the budget, spills, stack, shared memory, compile
    seconds."""
    from bench.cuda_launches import FAMILIES
    rows = []
    for family in FAMILIES:
        mine = [r for r in results if r.family == family and not r.error]
        if not mine:
            continue
        worst = max(mine, key=lambda r: (r.registers, r.kernel))
        rows.append({"family": family, "functions": len({r.kernel for r in mine}),
                     "kernels": len(mine) // len({r.cc for r in mine}),
                     "compiled": len(mine), "registers": worst.registers,
                     "worst": f"{worst.kernel} sm_{worst.cc[0]}{worst.cc[1]}",
                     "budget": min(r.budget for r in mine),
                     "occupancy": min(occupancy(r.registers, r.threads) for r in mine),
                     "spill_bytes": max(r.spill_stores + r.spill_loads for r in mine),
                     "stack": max(r.stack for r in mine),
                     "shared": max(r.shared for r in mine),
                     "seconds": sum(r.seconds for r in mine)})
    return rows


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


def markdown(rows: list[dict]) -> str:
    return markdown_table(
        ["family", "kernels (functions)", "compiles", "registers, most", "budget",
         "occupancy, least", "spills", "stack", "shared"],
        [[row["family"], f"{row['kernels']} ({row['functions']})", row["compiled"],
          row["registers"], row["budget"],
          f"{row['occupancy']:.0%}", f"{row['spill_bytes']} B", f"{row['stack']} B",
          f"{row['shared']} B"] for row in rows])


OPTIONS = {
    "--fast": {"action": "store_true",
               "help": "the representatives' kernels only (the fast tests' set)"},
    "--json": {"metavar": "PATH", "help": "write every result to PATH"},
    "--timeout": {"type": float, "help": "seconds a compile worker may take"},
    "--no-traffic": {"action": "store_true",
                     "help": "skip the table of loads and stores per element"},
    "--worker": {"nargs": 4, "metavar": ("JOB", "CC", "IN", "OUT"), "help": argparse.SUPPRESS},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, options in OPTIONS.items():
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    if args.worker:
        job, cc, source, out = args.worker
        _worker(job, tuple(map(int, cc.split("."))), source, out)
        return 0
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # the enumeration; the workers turn it off
    problem = compiler_problem()
    if problem:
        print(f"cannot compile here: {problem}", file=sys.stderr)
        return 2
    from bench import cuda_launches
    start = time.perf_counter()
    found, results = enumerate_and_compile(args.fast, timeout=args.timeout)
    elapsed = time.perf_counter() - start
    rows = summary(results)
    print(markdown(rows))
    wrong = [p for r in results for p in problems(r)]
    print(f"\n{len(found)} kernels, {len(results)} compiles in {elapsed:.0f} s; "
          f"{len(wrong)} problems")
    for line in wrong:
        print(f"  {line}")
    if not args.no_traffic:
        from bench import cuda_traffic
        jobs = cuda_traffic.traffic_jobs(None if not args.fast else
                                         cuda_launches.representatives())
        table = cuda_traffic.rows(jobs, run_workers("traffic", [f for f, _ in jobs], ((9, 0),),
                                                    args.timeout, workers=2))
        print("\nPer element, counted in the PTX for sm_90 (bench/cuda_traffic.py):\n")
        print(cuda_traffic.markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"found": [{"kernel": x.launch.kernel, "family": x.family,
                                  "threads": x.launch.threads,
                                  "types": [str(t) for t in x.launch.types],
                                  "scenarios": list(x.scenarios)} for x in found],
                       "results": [r._asdict() for r in results], "seconds": elapsed}, f,
                      indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
