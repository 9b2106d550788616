"""The device-resident optimizer (``device="cuda"``), run by Numba's CUDA simulator here (or on
a GPU with NUMBA_ENABLE_CUDASIM=0, see bench/gpu_check.py): the same results as the CPU
optimizer for every registered optimizer, gradients from NumPy, numba device arrays and any
``__cuda_array_interface__`` exporter, errors for wrong arrays and devices, the training tools,
checkpoints and state dicts between CPU and CUDA, and the fallback of ``device="auto"``."""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("numba_cuda")

import flatopt  # noqa: E402
from flatopt import _device  # noqa: E402
from flatopt._layout import chunk_table  # noqa: E402
from flatopt.kernels._cuda_import import numba_cuda, simulated  # noqa: E402
from optimizers import cases, fit_shape, random_settings  # noqa: E402

cuda = numba_cuda()
SMALL_CHUNK = 64
SHAPES = {"a": (150,), "b": (), "c": (0,), "d": (3, 41), "e": (7,)}
# Bit equality with the CPU is promised on a GPU with bit_exact=True. Without it NVVM's
# multiply-add contraction changes the last bit of a few elements; the simulator computes
# with Python's math on NumPy scalars, whose roundings differ from the CPU kernel's in places.
EXACT = False
EXACT_WHEN_BIT_EXACT = not simulated()
TOLERANCE = {np.float32: dict(rtol=2e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}


def host(array) -> np.ndarray:
    return np.asarray(array) if isinstance(array, np.ndarray) else array.copy_to_host()


def build(name, dtype, seed, **kwargs):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(fit_shape(name, s)).astype(dtype)
              for k, s in SHAPES.items()}
    groups = [{"params": {k: params[k] for k in ("a", "b", "c")}, **random_settings(name, rng)},
              {"params": {k: params[k] for k in ("d", "e")}, **random_settings(name, rng)}]
    return flatopt.registry.lookup(name)(groups, **kwargs)


def use_small_chunks(opt):
    for buf in opt.buffers:
        buf.chunk_size = SMALL_CHUNK
        buf.chunk_first = chunk_table(buf.offsets, buf.sizes, buf.length, SMALL_CHUNK)
        if opt._device is not None:
            opt._device.refresh_layout(buf)


def random_grads(name, dtype, rng, shapes=SHAPES, keep=0.7):
    return {k: rng.standard_normal(fit_shape(name, s)).astype(dtype)
            for k, s in shapes.items() if rng.random() < keep}


def assert_same(cuda_opt, cpu_opt, dtype=np.float32, exact=EXACT):
    check = np.testing.assert_array_equal if exact else \
        (lambda a, b, err_msg: np.testing.assert_allclose(a, b, **TOLERANCE[dtype],
                                                          err_msg=err_msg))
    for path in cpu_opt.index.paths:
        check(host(cuda_opt.params[path]), cpu_opt.params[path], err_msg=path)
        ours, theirs = cuda_opt.state_of(path), cpu_opt.state_of(path)
        assert (ours is None) == (theirs is None), path
        for field, a, b in zip(ours._fields if ours else (), ours or (), theirs or ()):
            if isinstance(b, np.ndarray):
                check(a, b, err_msg=f"{path}.{field}")
            else:
                assert a == b, (path, field)


class FakeExporter:
    """A device array seen only through ``__cuda_array_interface__`` (as CuPy and torch show
    theirs). Under the simulator its memory is a host array (the simulator's "device"
    pointers are host pointers, which the adapter wraps); on a GPU, device memory."""

    def __init__(self, array: np.ndarray, device=None, strides=None, typestr=None):
        self.memory = array if simulated() else cuda.to_device(array)
        self.shape, self.dtype = array.shape, array.dtype
        if device is not None:
            self.device = device
        self._strides = strides
        self._typestr = typestr

    @property
    def __cuda_array_interface__(self):
        pointer = self.memory.ctypes.data if simulated() else \
            self.memory.device_ctypes_pointer.value
        return {"shape": self.shape, "typestr": self._typestr or self.dtype.str,
                "data": (pointer, False), "strides": self._strides, "version": 3,
                "stream": None}


# ----------------------------------------------------------------------------- every rule
@pytest.mark.parametrize("name", cases("test_device_optimizer_matches_cpu",
                                       slow_beyond_representatives=2))
def test_device_optimizer_matches_cpu(name):
    """Buffers on the device, several chunks per parameter and chunks spanning parameters,
    missing gradients, two groups, the gradient multiplier: the CPU optimizer's results."""
    dtype = np.float32
    cpu_opt, cuda_opt = build(name, dtype, 0), build(name, dtype, 0, device="cuda")
    assert cuda_opt.device == "cuda" and not isinstance(cuda_opt.params["a"], np.ndarray)
    use_small_chunks(cuda_opt)
    rng = np.random.default_rng(7)
    for step in range(3):
        grads = random_grads(name, dtype, rng)
        scale = 2.0 if step == 1 else None
        cpu_opt.step(grads, grad_scale=scale)
        cuda_opt.step(grads, grad_scale=scale)
    assert_same(cuda_opt, cpu_opt)


def test_float64_and_in_place_gradients():
    """float64 buffers; gradients written into ``opt.grads[path]`` (a device view) and marked
    present, as a CuPy or torch backward writing in place would."""
    cpu_opt = build("Adam", np.float64, 1)
    cuda_opt = build("Adam", np.float64, 1, device="cuda")
    rng = np.random.default_rng(3)
    for _ in range(2):
        grads = random_grads("Adam", np.float64, rng, keep=1.0)
        for path, value in grads.items():  # the device view, written in place
            if value.ndim and value.size:
                cuda_opt.grads[path].copy_to_device(np.ascontiguousarray(value))
            else:  # 0-d and empty views: through the setter
                cuda_opt.grads[path] = value
        cuda_opt.grads.mark_present()
        cpu_opt.step(grads)
        cuda_opt.step()
    assert_same(cuda_opt, cpu_opt, np.float64)


# ----------------------------------------------------------------------------- interop
def test_gradients_from_device_arrays_and_exporters():
    cpu_opt, cuda_opt = build("AdamW", np.float32, 2), build("AdamW", np.float32, 2,
                                                               device="cuda")
    rng = np.random.default_rng(5)
    grads = random_grads("AdamW", np.float32, rng, keep=1.0)
    given = {"a": cuda.to_device(grads["a"]),          # a numba device array
             "d": FakeExporter(grads["d"].copy()),      # any __cuda_array_interface__
             "e": grads["e"], "b": grads["b"]}         # NumPy: copied in from the host
    cpu_opt.step({k: grads[k] for k in given})
    cuda_opt.step(given)
    assert_same(cuda_opt, cpu_opt)
    assert cuda_opt.grads.present_paths() == ["a", "b", "d", "e"]
    # one gradient given as a view of another's slot in the flat buffer is read first
    cuda_opt.step({"a": cuda_opt.grads["a"], "e": cuda_opt.grads["a"][:7]})
    cpu_opt.step({"a": cpu_opt.grads["a"], "e": cpu_opt.grads["a"][:7]})
    assert_same(cuda_opt, cpu_opt)


def test_interface_adapter_wraps_without_copy():
    exporter = FakeExporter(np.arange(6, dtype=np.float32).reshape(2, 3))
    wrapped = _device.wrap_interface(exporter, exporter.__cuda_array_interface__)
    exporter.memory[0, 0] = 42.0  # the wrapper sees the exporter's memory
    assert host(wrapped)[0, 0] == 42.0 and wrapped.shape == (2, 3)


def test_wrong_gradients_are_refused_before_anything_changes():
    opt = build("Adam", np.float32, 0, device="cuda")
    before = host(opt.params["d"]).copy()
    cases = [
        (FakeExporter(np.zeros((3, 41), np.float32),
                      device=types.SimpleNamespace(type="cuda", index=1)),
         flatopt.DeviceError, "GPU 1"),
        (FakeExporter(np.zeros((3, 41), np.float32),
                      device=types.SimpleNamespace(type="cpu", index=None)),
         flatopt.DeviceError, "on the CPU"),
        (FakeExporter(np.zeros((41, 3), np.float32)), flatopt.GradientError, "shape"),
        (FakeExporter(np.zeros((3, 41), np.float64)), flatopt.GradientError, "dtype"),
        (FakeExporter(np.zeros((3, 41), np.float32), strides=(4, 12)), flatopt.GradientError,
         "C-contiguous"),
        (cuda.to_device(np.zeros(5, np.float32)), flatopt.GradientError, "device array"),
        ([0.0] * 123, flatopt.GradientError, "list"),
    ]
    for value, error, words in cases:
        with pytest.raises(error, match=words):
            opt.step({"d": value, "a": np.ones(150, np.float32)})
        with pytest.raises(error, match=words):
            opt.grads["d"] = value
    assert np.array_equal(host(opt.params["d"]), before)
    assert opt.grads.present_paths() == []


def test_torch_style_tensor_that_cannot_export():
    class RequiresGrad:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires "
                               "grad")
    opt = build("SGD", np.float32, 0, device="cuda")
    with pytest.raises(flatopt.GradientError, match="detach"):
        opt.step({"e": RequiresGrad()})


def test_add_param_group_on_the_device():
    cpu_opt, cuda_opt = build("Adagrad", np.float32, 8), build("Adagrad", np.float32, 8,
                                                               device="cuda")
    extra = {"z": np.linspace(-1, 1, 33, dtype=np.float32)}
    for opt in (cpu_opt, cuda_opt):
        opt.add_param_group({"params": dict(extra), "lr": 0.05})
    grads = {"z": np.ones(33, np.float32), "a": np.ones(150, np.float32)}
    cpu_opt.step(grads)
    cuda_opt.step(grads)
    assert_same(cuda_opt, cpu_opt)


@pytest.mark.skipif(simulated(), reason="the simulator's arrays export no interface")
def test_views_are_zero_copy_for_torch():
    opt = build("SGD", np.float32, 0, device="cuda")
    view = opt.grads["d"]
    assert view.__cuda_array_interface__["shape"] == (3, 41)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    tensor = torch.as_tensor(view, device="cuda")
    assert tensor.data_ptr() == view.__cuda_array_interface__["data"][0]
    tensor.fill_(2.0)  # a torch kernel writes the flat gradient buffer
    torch.cuda.synchronize()
    opt.grads.mark_present(["d"])
    opt.step()
    cpu_opt = build("SGD", np.float32, 0)
    cpu_opt.step({"d": np.full((3, 41), 2.0, np.float32)})
    assert_same(opt, cpu_opt)


# ----------------------------------------------------------------------------- training tools
def test_training_tools_on_the_device():
    name, dtype = "Adam", np.float32
    cpu_opt, cuda_opt = build(name, dtype, 4), build(name, dtype, 4, device="cuda")
    cpu_ema, cuda_ema = flatopt.EMA(cpu_opt, 0.9), flatopt.EMA(cuda_opt, 0.9)
    rng = np.random.default_rng(9)
    for step in range(3):
        grads = random_grads(name, dtype, rng, keep=1.0)
        half = {k: v / 2 for k, v in grads.items()}
        for opt in (cpu_opt, cuda_opt):
            opt.zero_grad()
            opt.grads.add(half)
            opt.grads.add(half)
        results = [opt.step(max_grad_norm=1.0, skip_nonfinite=True)
                   for opt in (cpu_opt, cuda_opt)]
        assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-6)
        cpu_ema.update()
        cuda_ema.update()
    # the device's norm adds in another order: the clip factor may differ in its last bit
    assert_same(cuda_opt, cpu_opt, exact=False)
    for path in cpu_opt.index.paths:
        np.testing.assert_allclose(host(cuda_ema.params[path]), cpu_ema.params[path],
                                   rtol=2e-5, atol=1e-6)
    with cuda_ema.swapped():
        np.testing.assert_allclose(host(cuda_opt.params["a"]), cpu_ema.params["a"], rtol=2e-5)
    np.testing.assert_allclose(host(cuda_opt.params["a"]), cpu_opt.params["a"], rtol=2e-5)
    saved = cuda_ema.state_dict()
    assert isinstance(saved["averages"]["a"], np.ndarray)
    cuda_ema.load_state_dict(cpu_ema.state_dict())
    np.testing.assert_array_equal(host(cuda_ema.params["d"]), cpu_ema.params["d"])

    bad = {"a": np.full(150, np.nan, dtype)}
    before = host(cuda_opt.params["a"]).copy()
    assert cuda_opt.step(bad, skip_nonfinite=True).skipped
    np.testing.assert_array_equal(host(cuda_opt.params["a"]), before)
    cuda_opt.step({"a": np.full(150, 3.0, dtype)})
    norm = flatopt.clip_grad_norm(cuda_opt, 1.0, norm_type=float("inf"))
    assert norm == 3.0
    np.testing.assert_allclose(host(cuda_opt.grads["a"]), 3.0 / (3.0 + 1e-6), rtol=1e-6)
    cuda_opt.step({"a": np.full(150, np.nan, dtype)})
    assert np.isnan(flatopt.clip_grad_norm(cuda_opt, 1.0, norm_type=float("inf")))
    cuda_opt.zero_grad(set_to_none=False)
    assert not host(cuda_opt.grads["a"]).any()


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["Adam", "Lion", "Muon", "Adafactor"])
def test_checkpoints_move_between_cpu_and_cuda(name, tmp_path):
    dtype = np.float32
    cpu_opt, cuda_opt = build(name, dtype, 6), build(name, dtype, 6, device="cuda")
    rng = np.random.default_rng(11)
    for _ in range(2):
        grads = random_grads(name, dtype, rng)
        cpu_opt.step(grads)
        cuda_opt.step(grads)
    flatopt.save(tmp_path / "cuda.h5", cuda_opt)
    flatopt.save(tmp_path / "cpu.h5", cpu_opt)
    assert (tmp_path / "cuda.h5").read_bytes() == (tmp_path / "cpu.h5").read_bytes() \
        or not EXACT
    into_cpu, into_cuda = build(name, dtype, 99), build(name, dtype, 99, device="cuda")
    flatopt.load(tmp_path / "cuda.h5", into_cpu, hyperparameters="saved")
    flatopt.load(tmp_path / "cpu.h5", into_cuda, hyperparameters="saved")
    assert_same(into_cuda, into_cpu)
    grads = random_grads(name, dtype, rng, keep=1.0)
    for opt in (cpu_opt, into_cpu, into_cuda):
        opt.step(grads)
    assert_same(into_cuda, cpu_opt)
    # state dicts: host copies, loadable either way
    state = into_cuda.state_dict()
    first = next(iter(state["state"].values()))
    assert all(isinstance(v, np.ndarray) for v in first.values() if hasattr(v, "shape"))
    fresh = build(name, dtype, 99, device="cuda")
    fresh.load_state_dict(cpu_opt.state_dict())
    for path in cpu_opt.index.paths:
        ours, theirs = fresh.state_of(path), cpu_opt.state_of(path)
        assert (ours is None) == (theirs is None)


# ----------------------------------------------------------------------------- devices
def test_device_argument_and_fallback(monkeypatch):
    params = {"w": np.ones(4, np.float32)}
    with pytest.raises(flatopt.DeviceError, match="device must be one of"):
        flatopt.SGD(params, lr=0.1, device="gpu")
    with pytest.raises(flatopt.DeviceError, match="stream= is for"):
        flatopt.SGD(params, lr=0.1, stream=0)
    assert flatopt.SGD(params, lr=0.1).device == "cpu"
    missing = "numba-cuda is not installed (No module named 'numba_cuda'); install it"
    monkeypatch.setattr(_device, "cuda_problem", lambda: missing)
    with pytest.raises(flatopt.DeviceError, match="numba-cuda is not installed"):
        flatopt.Adam(params, device="cuda")
    opt = flatopt.Adam(params, device="auto")
    assert opt.device == "cpu"
    assert "device=auto: running on the CPU because numba-cuda is not installed" in repr(opt)
    opt.step({"w": np.ones(4, np.float32)})


def test_stream_option():
    stream = cuda.stream()
    cpu_opt, cuda_opt = build("SGD", np.float32, 3), build("SGD", np.float32, 3,
                                                           device="cuda", stream=stream)
    assert cuda_opt._device.stream is stream
    grads = random_grads("SGD", np.float32, np.random.default_rng(2), keep=1.0)
    cpu_opt.step(grads)
    cuda_opt.step(grads)
    stream.synchronize()
    assert_same(cuda_opt, cpu_opt)
    with pytest.raises(flatopt.DeviceError, match="stream must be"):
        build("SGD", np.float32, 3, device="cuda", stream="default")


def test_cuda_problem_names_what_is_missing(monkeypatch):
    import flatopt.kernels._cuda_import as importer

    def no_numba_cuda():
        raise ImportError("No module named 'numba_cuda'")
    monkeypatch.setattr(importer, "numba_cuda", no_numba_cuda)
    problem = _device.cuda_problem()
    assert "numba-cuda is not installed" in problem and "flatopt[cuda]" in problem
    assert "cu13" in problem


def test_numbas_own_cuda_target_is_not_numba_cuda(monkeypatch):
    """Without numba-cuda, ``numba.cuda`` is Numba's own (deprecated) target,
    whose simulator lacks what flatopt uses (``default_stream``): a DeviceError naming it, not
    an AttributeError; "auto" falls back to the CPU."""
    import flatopt.kernels._cuda_import as importer
    builtin = types.SimpleNamespace(implementation="Built-in")
    monkeypatch.setattr(importer, "numba_cuda", lambda: builtin)
    monkeypatch.setattr(importer, "simulated", lambda: True)
    params = {"w": np.ones(4, np.float32)}
    with pytest.raises(flatopt.DeviceError, match="numba-cuda is not installed.*Numba's own"):
        flatopt.SGD(params, lr=0.1, device="cuda")
    opt = flatopt.SGD(params, lr=0.1, device="auto")
    assert opt.device == "cpu" and "numba-cuda is not installed" in repr(opt)


def test_numpy_row_stack_shim(monkeypatch):
    """numba-cuda 0.30 needs np.row_stack, which NumPy 2.5 removed: put back when missing."""
    monkeypatch.delattr(np, "row_stack", raising=False)
    numba_cuda()
    assert np.row_stack is np.vstack


def test_bit_exact_kernels_compile_without_contraction():
    from flatopt.kernels import cuda as kernels
    from flatopt.optimizers.adam import SCHEMA
    exact = kernels.compile_rule(SCHEMA.rule, exact=True)
    plain = kernels.compile_rule(SCHEMA.rule)
    assert exact is not plain
    assert kernels.NO_FMA_MARKER in exact.step_kernel.py_func.__qualname__
    assert kernels.NO_FMA_MARKER not in plain.step_kernel.py_func.__qualname__
    assert kernels.no_fma_options(["define void @x_flatoptnofma_1()"], {"opt": 3}) == \
        {"opt": 3, "fma": False}
    assert kernels.no_fma_options("define void @step_adam()", {"opt": 3}) == {"opt": 3}
    cpu_opt = build("Adam", np.float32, 0)
    cuda_opt = build("Adam", np.float32, 0, device="cuda", bit_exact=True)
    assert "bit_exact" in repr(cuda_opt)
    grads = random_grads("Adam", np.float32, np.random.default_rng(1), keep=1.0)
    cpu_opt.step(grads)
    cuda_opt.step(grads)
    assert_same(cuda_opt, cpu_opt, exact=EXACT_WHEN_BIT_EXACT)


def test_device_views_zero_a_missing_gradient_once_and_take_assigned_parameters():
    """The stale-gradient rule and opt.params[path] = value on device buffers, as on the CPU."""
    opt = flatopt.SGD({"a": np.zeros(5, np.float32), "b": np.zeros(3, np.float32)}, lr=1.0,
                      device="cuda")
    opt.step({"a": np.full(5, 4.0, np.float32), "b": np.full(3, 4.0, np.float32)})
    opt.zero_grad()
    assert (host(opt.grads["a"]) == 0).all()  # missing: zeroed when taken
    opt.grads.add({"a": np.ones(5, np.float32)})
    opt.step()
    np.testing.assert_array_equal(host(opt.params["a"]), -5.0)
    np.testing.assert_array_equal(host(opt.params["b"]), -4.0)
    opt.params["b"] = np.full(3, 7.0, np.float32)
    np.testing.assert_array_equal(host(opt.params["b"]), 7.0)
    with pytest.raises(flatopt.ParamError, match="value for 'b' has shape"):
        opt.params["b"] = np.zeros(4, np.float32)
    with pytest.raises(flatopt.ParamError, match="takes a NumPy array"):
        opt.params["b"] = opt.params["a"]
