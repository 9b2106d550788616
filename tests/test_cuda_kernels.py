"""The CUDA backend (run by Numba's CUDA simulator here, or on a GPU) gives the CPU backend's
results for every registered optimizer: same rule functions, same chunk walk, several chunks
per parameter and chunks spanning parameters, missing gradients, several groups."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt._layout import chunk_table
from optimizers import cases, fit_shape, random_settings, slow_beyond

pytest.importorskip("numba_cuda")
from flatopt.kernels._cuda_import import numba_cuda  # noqa: E402 (the NumPy 2.5 shim first)

numba_cuda()

SMALL_CHUNK = 64
SHAPES = {"a": (150,), "b": (), "c": (0,), "d": (3, 41), "e": (7,)}
TOLERANCE = {np.float32: dict(rtol=2e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}


def build(name, dtype, seed):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(fit_shape(name, s)).astype(dtype)
              for k, s in SHAPES.items()}
    groups = [{"params": {k: params[k] for k in ("a", "b", "c")}, **random_settings(name, rng)},
              {"params": {k: params[k] for k in ("d", "e")}, **random_settings(name, rng)}]
    return flatopt.registry.lookup(name)(groups)


def use_small_chunks(opt):
    for buf in opt.buffers:
        buf.chunk_size = SMALL_CHUNK
        buf.chunk_first = chunk_table(buf.offsets, buf.sizes, buf.length, SMALL_CHUNK)


@pytest.mark.parametrize("dtype", slow_beyond([np.float32, np.float64]),
                         ids=["float32", "float64"])
@pytest.mark.parametrize("seed", slow_beyond(range(3)))
@pytest.mark.parametrize("name", cases("test_cuda_backend_matches_cpu",  # the simulator is slow:
                                       slow_beyond_representatives=2))  # two in the fast loop
def test_cuda_backend_matches_cpu(name, seed, dtype):
    cpu_opt, cuda_opt = build(name, dtype, seed), build(name, dtype, seed)
    cuda_opt._set_backend("cuda")
    use_small_chunks(cuda_opt)
    rng = np.random.default_rng(100 + seed)
    for step in range(4):
        grads = {k: rng.standard_normal(fit_shape(name, s)).astype(dtype)
                 for k, s in SHAPES.items() if rng.random() < 0.7}
        scale = 2.0 if step % 2 else None  # the walk's gradient multiplier too
        cpu_opt.step(grads, grad_scale=scale)
        cuda_opt.step(grads, grad_scale=scale)
        for path in SHAPES:
            np.testing.assert_allclose(cuda_opt.params[path], cpu_opt.params[path],
                                       **TOLERANCE[dtype], err_msg=path)
            ours, theirs = cuda_opt.state_of(path), cpu_opt.state_of(path)
            assert (ours is None) == (theirs is None), path
            for field, a, b in zip(ours._fields if ours else (), ours or (), theirs or ()):
                if isinstance(b, np.ndarray):
                    np.testing.assert_allclose(a, b, **TOLERANCE[dtype], err_msg=field)
                else:
                    assert a == b, field
