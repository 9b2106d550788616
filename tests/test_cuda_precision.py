"""Reduced-precision buffers on the CUDA backend (run by Numba's CUDA simulator here, over host
arrays: ``Optimizer._set_backend("cuda")``): the storage codec around a rule gives the CPU's
bits (stochastic rounding streams, bfloat16 and 8-bit state, master weights, Kahan) for the
same float32 inputs, whatever the block and grid sizes; whole optimizer steps agree with the
CPU's up to the simulator's rounding of the rule itself (its ``fma`` rounds twice)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba_cuda")

import flatopt  # noqa: E402
from flatopt.errors import GradientError  # noqa: E402
from flatopt._layout import WalkLayout, chunk_table  # noqa: E402
from flatopt.kernels import backend  # noqa: E402
from flatopt.kernels.coded import (BF16, COMPENSATION_AT, DIRECT, F16, KAHAN, MASTER,  # noqa: E402
                                   MASTER_AT, NATIVE, NEAREST, POSITIONS, Q8_SIGNED,
                                   Q8_UNSIGNED, STOCHASTIC, TABLES, UNUSED, Layout)
from flatopt.kernels.rule import Rule  # noqa: E402
from flatopt.kernels.tools import untouched_prepare  # noqa: E402

# The simulator runs the codec's uint64 hash on NumPy scalars, which warn when they wrap
# (the wrap is the hash); its threads do not see np.errstate.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

BF = ml_dtypes.bfloat16


# ----------------------------------------------------------------------------- the codec alone
def probe_span(arrays, scalars, columns, flags, k, start, stop, stride):
    """A rule whose arithmetic rounds the same everywhere (one add, one multiply per value),
    so that CPU and simulator hand the codec the same float32 values."""
    p, g, m, v = arrays
    for i in range(start, stop, stride):
        p[i] = p[i] - g[i]
        m[i] = m[i] + g[i]
        v[i] = g[i] * g[i]


PROBE = Rule(name="codec_probe", span=probe_span, prepare=untouched_prepare, helpers=(),
             slots=("m", "v"), columns={})

# (params format, parameter mode, rounding, grads format, state formats)
PROBES = {
    "bf16-stochastic-bf16-state": (BF16, DIRECT, STOCHASTIC, BF16, (BF16, BF16)),
    "f16-stochastic-int8-state": (F16, DIRECT, STOCHASTIC, NATIVE, (Q8_SIGNED, Q8_UNSIGNED)),
    "bf16-master-int8-state": (BF16, MASTER, NEAREST, BF16, (Q8_SIGNED, Q8_UNSIGNED)),
    "bf16-kahan-float32-state": (BF16, KAHAN, NEAREST, F16, (NATIVE, NATIVE)),
    "f16-nearest-bf16-state": (F16, DIRECT, NEAREST, F16, (BF16, BF16)),
}
SIZES = np.array([2 * 256 + 77, 100])  # ragged tails; offsets 256-aligned
OFFSETS = np.array([0, 3 * 256])
LENGTH = 4 * 256
CHUNK = 512  # two chunks for the first parameter, a multiple of the 8-bit block


def _stored(fmt, values, rng):
    if fmt == NATIVE:
        return values.astype(np.float32).view(np.uint8)
    if fmt in (BF16, F16):
        return values.astype(BF if fmt == BF16 else np.float16).view(np.uint8)
    codes = rng.integers(0, 256, values.size).astype(np.uint8)
    return codes


def probe_arguments(case, seed=5):
    """The coded walk's leading arguments over fresh random arrays (one copy per call):
    ``(stored, absmax, tables, seed)`` in the walk's ``POSITIONS``, and their layout."""
    param, mode, rounding, grad, state = PROBES[case]
    rng = np.random.default_rng(seed)
    values = lambda: (rng.standard_normal(LENGTH) * 3).astype(np.float32)  # noqa: E731
    none, no_scales = np.zeros(0, np.uint8), np.zeros(0, np.float32)
    stored = [none] * POSITIONS
    absmax = [no_scales] * POSITIONS
    formats = [UNUSED] * POSITIONS
    stored[0], formats[0] = _stored(param, values(), rng), param
    stored[1], formats[1] = _stored(grad, values(), rng), grad
    for position, fmt in enumerate(state, start=2):
        stored[position], formats[position] = _stored(fmt, values(), rng), fmt
        if fmt in (Q8_SIGNED, Q8_UNSIGNED):
            absmax[position] = rng.random(LENGTH // 256).astype(np.float32) * 4
    if mode == MASTER:
        stored[MASTER_AT], formats[MASTER_AT] = values().view(np.uint8), NATIVE
    if mode == KAHAN:
        compensation = (values() * np.float32(1e-3)).astype(BF if param == BF16 else np.float16)
        stored[COMPENSATION_AT], formats[COMPENSATION_AT] = compensation.view(np.uint8), param
    return ((tuple(stored), tuple(absmax), TABLES, np.uint64(seed)),
            Layout(tuple(formats), mode, rounding))


def run_probe(kernels, arguments, steps=2, **launch):
    layout = WalkLayout(np.array([1, 1], np.uint8), OFFSETS, SIZES,
                        chunk_table(OFFSETS, SIZES, LENGTH, CHUNK), CHUNK, LENGTH)
    for draw in range(steps):
        kernels.step((*arguments, np.uint64(draw), np.uint64(0)), np.zeros(0, np.float32), (),
                     (), layout, np.float32(0.5), draw == 0, **launch)
    return [np.array(a) for a in (*arguments[0], *arguments[1])]


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow)
                                  if case == "bf16-master-int8-state" else case
                                  for case in PROBES])  # the simulator is slow
def test_codec_gives_the_cpu_bits_whatever_the_launch(case):
    arguments, layout = probe_arguments(case)
    cpu = run_probe(backend("cpu").compile_coded(PROBE, layout), arguments)
    cuda = backend("cuda").compile_coded(PROBE, layout)
    for launch in ({}, {"threads": 64, "blocks": 1}):  # 8-bit walks: always 256 threads
        ours = run_probe(cuda, probe_arguments(case)[0], **launch)
        for j, (a, b) in enumerate(zip(ours, cpu)):
            np.testing.assert_array_equal(a, b, err_msg=f"{case} {launch} array {j}")
    # the walk did store: the parameters moved and the 8-bit scales were recomputed
    assert not np.array_equal(cpu[0], probe_arguments(case)[0][0][0])


# ----------------------------------------------------------------------------- whole steps
N = 2 * 256 + 77  # 8-bit state for tensors from 256 elements here (see the test)
CONFIGS = {
    "bf16-stochastic-bf16-state": (BF, dict(rounding="stochastic", state_dtype="bfloat16",
                                            seed=11)),
    "bf16-int8-state": (BF, dict(rounding="stochastic", state_dtype="int8")),
    "bf16-master-weights": (BF, dict(master_weights=True)),
    "bf16-kahan": (BF, dict(rounding="kahan")),
    "f16-stochastic": (np.float16, dict(rounding="stochastic", seed=3)),
    "bf16-cautious-bf16-state": (BF, dict(state_dtype="bfloat16", caution=True)),
    "bf16-master-float32-grads": (BF, dict(master_weights=True, grad_dtype="float32")),
}


def gradient_dtype(dtype, kwargs):
    return np.float32 if kwargs.get("grad_dtype") == "float32" else dtype


@pytest.mark.parametrize("config", list(CONFIGS))
def test_adamw_on_the_cuda_backend_matches_the_cpu(config, monkeypatch):
    """The simulator's AdamW rounds its fma twice (the CPU once), so a float32 value the codec
    stores may differ in its last bits (a moment's lerp that cancels: 0 against 3.6e-10): the
    16-bit values then round to the same or a neighbouring value, an 8-bit code to the
    same or the neighbouring code. The test compares values with one 16-bit rounding's
    tolerance and asserts that almost all bits are equal. (8-bit state is kept for tensors
    from 256 elements instead of 4096, so that the simulated buffers stay small.)"""
    monkeypatch.setattr(flatopt._storage, "MIN_8BIT_SIZE", 256)
    dtype, kwargs = CONFIGS[config]
    rng = np.random.default_rng(1)
    w = {"a": rng.standard_normal(N).astype(dtype), "b": rng.standard_normal(100).astype(dtype)}
    cpu, sim = (flatopt.AdamW({k: v.copy() for k, v in w.items()}, lr=1e-2, weight_decay=0.1,
                              **kwargs) for _ in range(2))
    sim._set_backend("cuda")
    for step in range(2):
        grads = {k: rng.standard_normal(v.shape).astype(gradient_dtype(dtype, kwargs))
                 for k, v in w.items()}
        cpu.step(grads, grad_scale=2.0 if step else None)
        sim.step(grads, grad_scale=2.0 if step else None)
    assert not np.array_equal(sim.params["a"], w["a"])  # it stepped
    assert_buffers_close(sim.buffers, cpu.buffers, dtype, draws=2)


def assert_buffers_close(mine, cpus, dtype, draws):
    """Every stored array of reduced-precision buffers ``mine`` as CPU ``cpus``'s, up to
    the simulator's rounding of the rule (see above)."""
    rtol = 2.0 ** -7 if dtype == BF else 2.0 ** -10  # one 16-bit ulp, relative
    for ours, theirs in zip(mine, cpus):
        assert ours.coded and ours.draws == theirs.draws == draws
        assert_close(ours.params, theirs.params, rtol)
        if ours.master is not None:
            np.testing.assert_allclose(ours.master, theirs.master, rtol=1e-5, atol=1e-6)
        if ours.compensation is not None:
            assert_close(ours.compensation, theirs.compensation, 1e-2, same=0.9)
        for name, flat in theirs.state.items():
            mine = ours.state[name]
            if flat.dtype == np.uint8:  # the same or the neighbouring code, scales close
                assert np.abs(mine.astype(int) - flat.astype(int)).max() <= 1, name
                assert (mine != flat).mean() < 0.01, name
                np.testing.assert_allclose(ours.absmax[name], theirs.absmax[name], rtol=1e-5)
            elif flat.dtype == np.float32:  # the last bits of float32 state may differ
                np.testing.assert_allclose(mine, flat, rtol=1e-5, atol=1e-6, err_msg=name)
            else:
                assert_close(mine, flat, rtol, name)


def assert_close(ours, theirs, rtol, name="", same=0.99):
    """Values within ``rtol`` (and a small absolute tolerance for moments that cancel), and
    at least the fraction ``same`` of them bit for bit equal."""
    np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), rtol=rtol,
                               atol=1e-6, err_msg=name)
    assert (ours.view(np.uint8) == theirs.view(np.uint8)).mean() >= same, name


# ----------------------------------------------------------------------------- device="cuda"
def device_bits(dtype):
    return np.dtype(np.uint16) if np.dtype(dtype) == np.dtype(BF) else np.dtype(dtype)


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow)
                                    if c in ("bf16-int8-state", "f16-stochastic") else c
                                    for c in CONFIGS])
def test_device_cuda_keeps_reduced_precision_buffers_on_the_device(config, monkeypatch,
                                                                   tmp_path):
    """``device="cuda"`` with 16-bit parameters and reduced state: the buffers live on the
    device (bfloat16 as uint16 bit patterns), and a run with clipping, loss scaling,
    accumulation, a parameter written from outside and an EMA gives the CPU's values (up to
    the simulator's rounding); its checkpoint resumes bit for bit on the device."""
    monkeypatch.setattr(flatopt._storage, "MIN_8BIT_SIZE", 256)
    dtype, kwargs = CONFIGS[config]
    rng = np.random.default_rng(2)
    w = {"a": rng.standard_normal(N).astype(dtype), "b": rng.standard_normal(100).astype(dtype)}
    make = lambda device: flatopt.AdamW({k: v.copy() for k, v in w.items()}, lr=1e-2,  # noqa
                                        weight_decay=0.1, device=device, **kwargs)
    cpu, dev = make("cpu"), make("cuda")
    cpu_ema, dev_ema = flatopt.EMA(cpu, 0.9), flatopt.EMA(dev, 0.9)
    assert dev.params["a"].dtype == device_bits(dtype)
    assert not isinstance(dev.params["a"], np.ndarray)  # a device array
    grads = lambda: {k: rng.standard_normal(v.shape).astype(gradient_dtype(dtype, kwargs))  # noqa
                     for k, v in w.items()}
    for opt in (cpu, dev):  # a bfloat16 gradient on the device comes as its bit patterns
        with pytest.raises(GradientError, match="'a'"):
            opt.step({"a": np.zeros(N, np.float64)})
    g = grads()
    for opt, ema in ((cpu, cpu_ema), (dev, dev_ema)):
        opt.step(g, max_grad_norm=0.5)  # a norm over 16-bit gradients, then scaling
        ema.update()
    g1, g2 = grads(), grads()
    for opt, ema in ((cpu, cpu_ema), (dev, dev_ema)):
        opt.zero_grad()
        opt.grads.add(g1)
        opt.grads.add(g2)  # 16-bit accumulation, rounded to nearest
        flatopt.clip_grad_norm(opt, 1.0)  # the tool's own pass and scaling
        opt.step(grad_scale=2.0)
        ema.update()
        opt.params["b"] = w["b"]  # resets master weights and compensation
    g = grads()
    for opt, ema in ((cpu, cpu_ema), (dev, dev_ema)):
        opt.step(g)
        ema.update()
    assert_buffers_close(dev.host_buffers(), cpu.buffers, dtype, draws=3)
    for path in w:
        np.testing.assert_allclose(dev_ema.state_dict()["averages"][path],
                                   cpu_ema.params[path], rtol=1e-5, atol=1e-6)
        with dev_ema.swapped():  # the averages rounded to nearest into the parameters
            np.testing.assert_array_equal(
                dev.params[path].copy_to_host(),
                dev_ema.state_dict()["averages"][path].astype(dtype).view(device_bits(dtype)))
    before = {path: dev.params[path].copy_to_host() for path in w}
    for path in w:  # and back
        np.testing.assert_array_equal(dev.params[path].copy_to_host(), before[path])
    # a checkpoint of the device buffers resumes on the device bit for bit
    flatopt.save(tmp_path / "dev.h5", dev)
    resumed = make("cuda")
    flatopt.load(tmp_path / "dev.h5", resumed)
    g = grads()
    dev.step(g)
    resumed.step(g)
    for ours, theirs in zip(resumed.host_buffers(), dev.host_buffers()):
        assert ours.draws == theirs.draws == 4
        for name in ("params", "master", "compensation"):
            if getattr(theirs, name) is not None:
                np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name))
        for slots in ("state", "absmax"):
            mine, want = getattr(ours, slots), getattr(theirs, slots)
            assert set(mine) == set(want)
            for name in want:
                np.testing.assert_array_equal(mine[name], want[name], err_msg=name)
    # a load keeps on the device what it does not hold: a state dict, the parameters (the
    # master weights are state, as on the CPU)...
    snapshot = dev.state_dict()
    dev.step(grads())
    kept = {path: dev.params[path].copy_to_host() for path in w}
    dev.load_state_dict(snapshot)
    for path in w:
        np.testing.assert_array_equal(dev.params[path].copy_to_host(), kept[path])
        if "master" in snapshot["state"][path]:
            info = dev.index[path]
            buf = dev.host_buffers()[info.buffer]
            np.testing.assert_array_equal(buf.view(buf.master, info.slot),
                                          snapshot["state"][path]["master"])
    # ...and a checkpoint, the parameters it lacks
    only_a = flatopt.AdamW({"a": w["a"].copy()}, lr=1e-2, weight_decay=0.1, **kwargs)
    only_a.step({"a": grads()["a"]})
    flatopt.save(tmp_path / "a.h5", only_a)
    dev.step(grads())  # the host mirror is behind the device again
    b_before = dev.params["b"].copy_to_host()
    flatopt.load(tmp_path / "a.h5", dev, strict=False)
    np.testing.assert_array_equal(dev.params["b"].copy_to_host(), b_before)
    np.testing.assert_array_equal(dev.params["a"].copy_to_host(),
                                  only_a.params["a"].view(device_bits(dtype)))
