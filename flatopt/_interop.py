"""Arrays from other libraries on the GPU: anything exposing ``__cuda_array_interface__``
(CuPy, PyTorch, Numba) checked against a parameter, and wrapped without a copy; which GPU holds
it. Used by :class:`flatopt._device.CudaDevice` for gradients given as device arrays."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ._layout import ParamInfo
from .kernels import _cuda_import


def simulator_array_type():
    """The simulator's device array type under ``NUMBA_ENABLE_CUDASIM=1``, else None."""
    if not _cuda_import.simulated():
        return None
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray


def is_numba_device_array(value: Any) -> bool:
    fake = simulator_array_type()
    if fake is not None:
        return isinstance(value, fake)
    return bool(getattr(value, "__cuda_ndarray__", False))  # numba-cuda's own marker


def exporter_device(value: Any, pointer: int | None) -> int | None:
    """The ordinal of the GPU holding ``value``: from a ``device`` attribute as torch
    (``.type``, ``.index``) and CuPy (``.id``) give it, else from the driver's pointer
    attributes; None when it cannot be told (the simulator)."""
    device = getattr(value, "device", None)
    if device is not None:
        if getattr(device, "type", "cuda") != "cuda":
            return -1  # a torch tensor on the CPU (or another backend)
        for name in ("index", "id"):
            ordinal = getattr(device, name, None)
            if isinstance(ordinal, int):
                return ordinal
    if pointer and simulator_array_type() is None:
        try:
            from cuda.bindings import driver as cu
            err, ordinal = cu.cuPointerGetAttribute(
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)
            if int(err) == 0:
                return int(ordinal)
        except Exception:  # older bindings: leave it to the copy to fail
            return None
    return None


def c_contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """Whether ``strides`` lay ``shape`` out in C order (the stride of a dimension of size 1
    does not matter, as in NumPy)."""
    expected = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def interface_problem(info: ParamInfo, desc: Any, accepted=None,
                      held=None) -> str | None:
    """Why a ``__cuda_array_interface__`` dict cannot be the gradient of ``info``, or None:
    its dtype must be one of ``accepted`` (by default the parameter's), which the message
    names as ``held``."""
    accepted = (info.dtype,) if accepted is None else accepted
    held = info.dtype if held is None else held
    if not isinstance(desc, dict) or not {"shape", "typestr", "data"} <= set(desc):
        return (f"gradient for {info.path!r}: its __cuda_array_interface__ is not a dict with "
                "shape, typestr and data")
    shape = tuple(desc["shape"])
    if shape != info.shape:
        return (f"gradient for {info.path!r} has shape {shape}, but the parameter has shape "
                f"{info.shape}")
    dtype = np.dtype(desc["typestr"])
    if dtype not in accepted:
        return (f"gradient for {info.path!r} has dtype {dtype}, but the gradient is "
                f"{held}; cast it on the device first")
    strides = desc.get("strides")
    if strides is not None and not c_contiguous(shape, tuple(strides), dtype.itemsize):
        return (f"gradient for {info.path!r} is not C-contiguous (strides {tuple(strides)}); "
                "make it contiguous on the device first (cupy.ascontiguousarray, "
                "tensor.contiguous())")
    if desc.get("mask") is not None:
        return f"gradient for {info.path!r} has a mask, which flatopt would ignore"
    return None


def wrap_interface(value: Any, desc: dict):
    """A numba device array over the memory ``value`` exports (no copy). Under the simulator
    "device" pointers are host pointers, so the memory is wrapped as a NumPy array."""
    fake = simulator_array_type()
    if fake is None:
        from numba import cuda
        return cuda.from_cuda_array_interface(desc, owner=value, sync=True)
    dtype, shape = np.dtype(desc["typestr"]), tuple(desc["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    pointer = desc["data"][0]
    if nbytes == 0:
        return fake(np.empty(shape, dtype))
    raw = (ctypes.c_char * nbytes).from_address(pointer)
    return fake(np.frombuffer(raw, dtype).reshape(shape))
