"""The CUDA kernels (run by Numba's CUDA simulator here, or on a GPU) give the CPU kernels'
results: same rule bodies, same layout, several chunks, missing gradients, every flag."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt._layout import chunk_table
from flatopt.adam import lerp_from_end

cuda = pytest.importorskip("numba.cuda")
from flatopt.kernels import cuda as cuda_kernels  # noqa: E402
from flatopt.kernels import cpu  # noqa: E402

SMALL_CHUNK = 64  # several chunks per parameter, and chunks spanning parameters


def random_grads(rng, shapes, dtype):
    """Gradients for about 70% of the parameters; the rest are missing."""
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()
            if rng.random() < 0.7}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("flags", [
    dict(amsgrad=False, maximize=False, weight_decay=0.0),
    dict(amsgrad=True, maximize=True, weight_decay=0.1),
], ids=["plain", "amsgrad-maximize-wd"])
@pytest.mark.parametrize("cls", [flatopt.Adam, flatopt.AdamW])
def test_cuda_adam_matches_cpu(cls, flags, dtype):
    rng = np.random.default_rng(0)
    shapes = {"a": (150,), "b": (), "c": (0,), "d": (3, 41)}
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    opt = cls(params, lr=0.05, **flags)
    (buf,) = opt.buffers
    chunks = chunk_table(buf.offsets, buf.sizes, buf.length, SMALL_CHUNK)
    p = buf.params.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    v_max = np.zeros_like(p)
    steps = np.zeros(len(buf), np.int64)
    neg_step_size = np.zeros(len(buf), dtype)
    bc2 = np.zeros(len(buf), dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-15)
    for _ in range(4):
        opt.step(random_grads(rng, shapes, dtype))
        s = opt.param_groups[0]
        beta1, beta2 = s["betas"]
        hyper = opt._kernel_scalars(buf, opt._group_settings()[0])
        cuda_kernels.adam_prepare(buf.present, steps, neg_step_size, bc2, s["lr"], beta1, beta2)
        cuda_kernels.adam_step(p, buf.grads, m, v, v_max, buf.offsets, buf.sizes, buf.present,
                               neg_step_size, bc2, chunks, SMALL_CHUNK, hyper,
                               s["weight_decay"] != 0, cls.decoupled_weight_decay,
                               s["amsgrad"], s["maximize"], lerp_from_end(s), threads=32)
        np.testing.assert_array_equal(steps, buf.per_param["step"])
        np.testing.assert_allclose(p, buf.params, **tol)
        np.testing.assert_allclose(m, buf.state["exp_avg"], **tol)
        np.testing.assert_allclose(v, buf.state["exp_avg_sq"], **tol)
        if flags["amsgrad"]:
            np.testing.assert_allclose(v_max, buf.state["max_exp_avg_sq"], **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("hp", [
    dict(momentum=0.0),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.05, maximize=True),
    dict(momentum=0.9, nesterov=True),
], ids=["plain", "momentum-dampening", "nesterov"])
def test_cuda_sgd_matches_cpu(hp, dtype):
    rng = np.random.default_rng(1)
    shapes = {"a": (150,), "b": (), "d": (3, 41)}
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    opt = flatopt.SGD(params, lr=0.05, **hp)
    (buf,) = opt.buffers
    chunks = chunk_table(buf.offsets, buf.sizes, buf.length, SMALL_CHUNK)
    p = buf.params.copy()
    momentum_buffer = np.zeros_like(p)
    initialized = np.zeros(len(buf), np.uint8)
    first = np.zeros(len(buf), np.uint8)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-14, atol=1e-15)
    for _ in range(4):
        opt.step(random_grads(rng, shapes, dtype))
        s = opt.param_groups[0]
        has_momentum = s["momentum"] != 0
        hyper = opt._kernel_scalars(buf, opt._group_settings()[0])
        cuda_kernels.sgd_prepare(buf.present, initialized, first, has_momentum)
        cuda_kernels.sgd_step(p, buf.grads, momentum_buffer, buf.offsets, buf.sizes, buf.present,
                              first, chunks, SMALL_CHUNK, hyper, s["weight_decay"] != 0,
                              has_momentum, s["nesterov"], s["maximize"], threads=32)
        np.testing.assert_allclose(p, buf.params, **tol)
        if has_momentum:
            np.testing.assert_array_equal(initialized, buf.per_param["momentum_initialized"])
            np.testing.assert_allclose(momentum_buffer, buf.state["momentum_buffer"], **tol)


def test_cuda_and_cpu_kernels_share_one_rule_body():
    from flatopt.kernels import rules
    assert cuda_kernels._adam_rule.py_func is rules.adam_rule
    assert cpu._adam_rule.py_func is rules.adam_rule
    assert cuda_kernels._sgd_rule.py_func is rules.sgd_rule
    assert cpu._sgd_rule.py_func is rules.sgd_rule
