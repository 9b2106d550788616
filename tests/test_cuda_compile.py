"""Every CUDA kernel flatopt can launch, compiled for real GPUs on a machine without one
(issue 34): the enumeration of ``bench/cuda_launches.py`` (every registered rule x flags x
dtype x storage layout, bit_exact off and on, and the device's tool kernels, recorded in the
simulator from the functions a GPU runs) compiled by ``bench/cuda_static.py`` to PTX for
compute capability 8.0 and 9.0 with NVIDIA's NVVM and assembled by ``ptxas``. Each kernel
must compile, use no local memory (no spills), stay within the registers its launch bounds
allow (64 at 256 threads: half an SM's threads resident; the rules' walks over float64 data
128, a quarter: see the README's GPU section), and a float32 kernel must not compute in
float64.

The fast loop compiles the representatives' kernels (every family, every storage layout, both
dtypes, exact and not: ``bench.cuda_launches.representatives``); ``slow`` compiles every
kernel. Skipped, with the reason, only where numba-cuda or the compiler wheels are absent
(``pip install -e '.[cuda]'``; CI installs them). Nothing is cached between runs: the
compile workers get a fresh Numba cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cuda_launches, cuda_static

pytestmark = pytest.mark.cuda_compile

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = {"fast": 900, "all": 2400}
"""Seconds the enumeration and compiles may take (measured: about 90 s and 4 minutes on two
busy cores)."""


@pytest.fixture(scope="module")
def compiler():
    problem = cuda_static.compiler_problem()
    if problem:
        pytest.skip(f"no CUDA compiler here: {problem}")


def run_static(tmp_path_factory, which: str) -> dict:
    """``python -m bench.cuda_static [--fast] --json`` in a fresh process (only the built-in
    optimizers registered, whatever other tests registered here), its results read back."""
    out = tmp_path_factory.mktemp("cuda_static") / f"{which}.json"
    command = [sys.executable, "-m", "bench.cuda_static", "--json", str(out)]
    if which == "fast":
        command.append("--fast")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT[which],
                          env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert out.exists(), f"bench.cuda_static failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    report = json.loads(out.read_text())
    report["results"] = [cuda_static.Compiled(**{**row, "cc": tuple(row["cc"])})
                         for row in report["results"]]
    report["output"] = done.stdout
    return report


@pytest.fixture(scope="module")
def fast(compiler, tmp_path_factory):
    return run_static(tmp_path_factory, "fast")


@pytest.fixture(scope="module")
def every(compiler, tmp_path_factory):
    return run_static(tmp_path_factory, "all")


def check_compiled(report: dict) -> None:
    """Every kernel found compiled for every target, each with no problem."""
    found = {entry["kernel"] for entry in report["found"]}
    by_target = {}
    for result in report["results"]:
        by_target.setdefault(result.cc, []).append(result.kernel)
    assert set(by_target) == set(cuda_static.TARGETS)
    for cc, kernels in by_target.items():
        assert set(kernels) == found and len(kernels) == len(report["found"]), cc
    wrong = [p for result in report["results"] for p in cuda_static.problems(result)]
    assert wrong == [], "\n".join(wrong)


def check_coverage(report: dict, names) -> None:
    """Every family is there, for each optimizer its step walk (or its prepare, for one over
    whole matrices) in both dtypes, exact and not, and coded walks in every storage setting."""
    families = {entry["family"] for entry in report["found"]}
    assert families == set(cuda_launches.FAMILIES)
    import flatopt
    kernels = {entry["kernel"] for entry in report["found"]}
    for name in names:
        rule = flatopt.registry.lookup(name).schema.rule
        key = f"{rule.name}_{rule.fingerprint}"
        if rule.per_parameter is not None:
            assert f"prepare_{key}" in kernels, name
            continue
        for walk in ("step", "wide_step"):
            assert {f"{walk}_{key}", f"{walk}_{key}_flatoptnofma"} <= kernels, (name, walk)
    labels = " ".join(s for entry in report["found"] if entry["family"].startswith("coded")
                      for s in entry["scenarios"])
    for setting in ("float16", "bfloat16", "rounding=stochastic", "rounding=kahan",
                    "master_weights=True", "state_dtype=bfloat16", "state_dtype=int8",
                    "grad_dtype=float32"):
        assert setting in labels, setting


def test_the_representative_kernels_compile_for_sm80_and_sm90(fast):
    check_compiled(fast)


def test_a_bit_exact_ema_averages_without_fused_multiply_adds(fast):
    """NVVM contracts the EMA's ``a + w (v - a)`` into one rounding; a bit_exact device
    averages with the kernel compiled without contraction, as the CPU rounds."""
    lerps = [r for r in fast["results"] if r.family == "EMA lerp"]
    assert {r.kernel.endswith("flatoptnofma") for r in lerps} == {True, False}
    for result in lerps:
        assert (result.fma == 0) == result.kernel.endswith("flatoptnofma"), result


def test_the_representatives_launch_every_family_layout_and_dtype(fast):
    check_coverage(fast, cuda_launches.representatives())


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90(every):
    check_compiled(every)


@pytest.mark.slow
def test_every_optimizer_launches_its_walks_in_every_dtype_and_layout(every):
    import flatopt
    check_coverage(every, flatopt.registry.names())


def test_a_kernel_that_does_not_compile_is_reported(compiler):
    """A rule whose span calls what the CUDA target does not support (the simulator runs it
    as Python, so only a compile finds it): recorded as a launch, compiled by the same
    workers, and reported as a problem with the compiler's words."""
    import numpy as np
    from cuda_broken_rule import BROKEN
    from flatopt._layout import WalkLayout, chunk_table
    from flatopt.kernels import backend
    from flatopt.kernels.cuda_launch import recording
    p, g = np.zeros(8, np.float32), np.ones(8, np.float32)
    offsets, sizes = np.array([0]), np.array([8])
    layout = WalkLayout(np.ones(1, np.uint8), offsets, sizes, chunk_table(offsets, sizes, 8, 8),
                        8, 8)
    with recording() as launched:
        backend("cuda").compile(BROKEN).step((p, g), np.zeros(0, np.float32), (), (), layout,
                                             np.float32(1), False)
    found = [cuda_launches.Found(launch, "step", ("broken",)) for launch in launched]
    results = cuda_static.compile_all(found, timeout=TIMEOUT["fast"])
    assert len(results) == len(cuda_static.TARGETS)
    for result in results:
        [problem] = cuda_static.problems(result)
        assert "does not compile" in problem and "zeros(" in problem, problem
