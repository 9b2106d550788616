"""Optimizer-step benchmarks for pytest-benchmark: ``pytest bench/`` (add ``--bench-large``
for the 64M-element and GPT-2 profiles). For the side-by-side table, ratios and plot use
``python -m bench``; here each implementation is a separate benchmark in one group per case.
"""

from __future__ import annotations

import gc

import pytest

from bench.impls import OPTIMIZERS, Case, available_impls, make_impl, max_threads, set_threads
from bench.profiles import PROFILES

LARGE = {"1x64M", "64x1M", "gpt2"}
PROFILE_PARAMS = [pytest.param(name, marks=pytest.mark.large) if name in LARGE else name
                  for name in ("1000x100", "10000x1000", "1x64M", "64x1M", "gpt2")]


@pytest.fixture(scope="module")
def cases():
    cache: dict = {}
    yield cache
    cache.clear()
    gc.collect()


@pytest.fixture(autouse=True)
def threads(request):
    set_threads(request.config.getoption("--bench-threads") or max_threads())
    yield
    set_threads(max_threads())


def _case(cases, profile, optimizer):
    key = (profile, optimizer)
    if key not in cases:
        cases.clear()  # one case alive at a time: large profiles take GBs
        gc.collect()
        cases[key] = Case(PROFILES[profile], optimizer, "float32")
    return cases[key]


@pytest.mark.parametrize("impl", available_impls())
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("profile", PROFILE_PARAMS)
def test_step(benchmark, cases, profile, optimizer, impl):
    if impl == "numpy-loop" and profile in LARGE:
        pytest.skip("naive loop on a large profile: see python -m bench")
    case = _case(cases, profile, optimizer)
    runner = make_impl(impl, case)
    benchmark.group = f"{profile} {optimizer} float32"
    benchmark.extra_info.update(n_elements=case.profile.n_elements,
                                n_tensors=case.profile.n_tensors)
    small = case.profile.n_elements < 1_000_000
    benchmark.pedantic(runner.step, rounds=20 if small else 5,
                       iterations=20 if small else 1, warmup_rounds=1)
    runner.close()
