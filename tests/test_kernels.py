"""The CPU kernels: the chunk table, no recompilation, float32 kept in float32, and the
parallel chunk walk equal to the serial one, for every registered optimizer."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt._layout import CHUNK_ELEMENTS, chunk_table
from flatopt.kernels import cpu, threads
from optimizers import cases


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the chunk table
def test_chunks_split_one_huge_tensor_and_many_small_ones_evenly():
    sizes = np.array([3 * CHUNK_ELEMENTS + 5], dtype=np.int64)
    first = chunk_table(np.array([0]), sizes, int(sizes[0]))
    assert len(first) == 4 and (first == 0).all()
    offsets = np.arange(0, 100 * 1024, 1024, dtype=np.int64)
    sizes = np.full(100, 1000, dtype=np.int64)
    first = chunk_table(offsets, sizes, 100 * 1024)
    chunk_starts = np.arange(len(first)) * CHUNK_ELEMENTS
    # each chunk starts at the first parameter ending after the chunk's start
    assert (offsets[first] + sizes[first] > chunk_starts).all()
    assert (first == 0).sum() == 1 and first[1] == CHUNK_ELEMENTS // 1024


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name", flatopt.registry.names())
def test_a_second_step_does_not_recompile(name):
    from optimizers import build, fit_params
    cls = flatopt.registry.lookup(name)
    opt = build(name, {"a": f32(5), "b": f32(40_000)})
    grads = fit_params(name, {"a": f32(5), "b": f32(40_000)})
    opt.step(grads, max_grad_norm=1.0)
    opt.step(grads)
    compiled = cpu.compile_rule(cls.schema.rule)
    kernels = [k for k in (compiled.prepare_kernel, compiled.finalize_kernel,
                           *(way for t in threads.ALL for way in (t.serial, t.parallel)))
               if k is not None and k.signatures]
    assert compiled.prepare_kernel in kernels  # (a rule over whole matrices has no step kernel)
    counts = {k: len(k.signatures) for k in kernels}
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
    for _ in range(3):
        opt.step(grads, max_grad_norm=1.0)
        opt.step(grads)
    assert {k: len(k.signatures) for k in kernels} == counts


@pytest.mark.parametrize("name", cases("test_float32_kernels_stay_in_float32",
                                       slow_beyond_representatives=4))
def test_float32_kernels_stay_in_float32(name):
    from optimizers import build, fit_params
    cls = flatopt.registry.lookup(name)
    opt = build(name, {"a": f32(100)})
    opt.step(fit_params(name, {"a": f32(100)}))
    # 100 elements: the serial kernel ran (it may have come from the disk cache)
    used = cpu.compile_rule(cls.schema.rule).step_kernel.serial
    kernel = cpu.compile_rule(cls.schema.rule, cache=False).step_kernel.serial
    for signature in used.signatures:
        kernel.compile(signature)
    ir = [text for sig, text in kernel.inspect_llvm().items() if sig[1].dtype.name == "float32"]
    assert ir and ("fmul float" in ir[0] or "fmul <" in ir[0])
    # the Python wrapper unboxes the scalar arguments through a C double, once per call; the
    # compiled kernel itself must not widen anything
    functions = ir[0].split("\ndefine ")
    kernel_code = "\n".join(line for f in functions[1:] if "7cpython" not in f.split("(")[0]
                             for line in f.splitlines() if not line.startswith("declare"))
    assert kernel_code and "fpext" not in kernel_code and "double" not in kernel_code


@pytest.mark.parametrize("name", cases("test_parallel_chunk_walk_equals_serial_walk",
                                       slow_beyond_representatives=4))
def test_parallel_chunk_walk_equals_serial_walk(name, monkeypatch):
    """The chunk walk (chunks of 64 elements spanning parameters, several per parameter)
    gives the serial walk's bits, missing gradients skipped in both."""
    from optimizers import fit_shape, random_settings
    rng = np.random.default_rng(5)
    settings = random_settings(name, rng)
    shapes = {k: fit_shape(name, s)
              for k, s in {"a": (300,), "b": (), "c": (0,), "d": (17, 9), "e": (64,)}.items()}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    cls = flatopt.registry.lookup(name)
    serial, chunked = cls(params, **settings), cls(params, **settings)
    for buf in chunked.buffers:
        buf.chunk_size = 64
        buf.chunk_first = chunk_table(buf.offsets, buf.sizes, buf.length, 64)
    for step in range(4):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()
                 if (step + ord(k)) % 3}  # a different third missing at each step
        serial.step(grads)
        monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(threads, "_policy", "always")
        chunked.step(grads)
        monkeypatch.undo()
    for path in shapes:
        assert chunked.params[path].tobytes() == serial.params[path].tobytes(), path
