"""The device-resident optimizer (``device="cuda"``): flat buffers in GPU memory.

What lives where:

- on the device: every buffer's parameters, gradients and state slots (numba-cuda device
  arrays; a reduced-precision buffer's master weights, Kahan compensation and 8-bit block
  scales too, and its 16-bit arrays as uint16 bit patterns, since Numba has no bfloat16), and
  mirrors of what the kernels read per step: presence, the rule's per-parameter columns, its
  scalars, and the layout (offsets, sizes, chunk table);
- on the host: the index, validation, presence and the per-parameter columns, which stay
  authoritative there. Each step runs the rule's ``prepare`` (step counts, bias corrections) on
  the host with the CPU kernel, in float64 as the CPU optimizer does, then queues the upload of
  presence and columns and the kernels on the optimizer's stream: no step waits for the device
  unless its semantics need a device value on the host (a clipping norm, a non-finite check);
- a host mirror of the parameter and state buffers (the ``FlatBuffer`` arrays themselves),
  refreshed from the device only when host code needs it: ``state_dict``, ``state_of``,
  checkpoint saves (:meth:`Optimizer.host_buffers`) and restores (:meth:`CudaDevice.host_side`,
  which pushes the result back). The mirror is allocated zero-filled, so its pages cost
  memory only once something is copied into them.

Rules over whole matrices (``Rule.per_parameter``, Muon's Newton-Schulz in NumPy) are run on
the host: the present parameters' values, gradients and state are copied to the mirror, updated
there and copied back (correct, but a round trip per step: documented as not GPU-speed).

Arrays from other libraries: anything exposing ``__cuda_array_interface__`` (CuPy, PyTorch,
Numba) is wrapped without a copy (:func:`wrap_interface`) and copied device to device into the
flat buffer; NumPy arrays are copied in from the host. An array on another GPU is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from . import _codec
from ._host import Device, HostDevice, per_parameter_update
from ._device_buffers import DeviceBuffer, DeviceLayout
from ._interop import (exporter_device, interface_problem, is_numba_device_array,
                       simulator_array_type, wrap_interface)
from ._layout import FlatBuffer, ParamInfo
from ._views import gradient_problem, value_problem
from .errors import DeviceError, GradientError
from .kernels import backend as kernel_backend
from .kernels import _cuda_import  # its functions are looked up at each call (tests patch them)
from .kernels.coded import NATIVE, NEAREST, POSITIONS, UNUSED, DIRECT, Layout
from .kernels.tools import SCALE_GRADIENTS

DEVICES = ("cpu", "cuda", "auto")

INSTALL_HINT = ("install numba-cuda with the CUDA toolkit libraries for your driver: "
                "pip install 'flatopt[cuda]' (numba-cuda[cu12], for a CUDA 12 driver) or "
                "pip install 'numba-cuda[cu13]' for a CUDA 13 driver")


# ----------------------------------------------------------------------------- availability
def cuda_problem() -> str | None:
    """Why CUDA kernels cannot run here (driver, numba-cuda or toolkit missing), or None."""
    try:
        cuda = _cuda_import.numba_cuda()
    except ImportError as exc:
        return f"numba-cuda is not installed ({exc}); {INSTALL_HINT}"
    if getattr(cuda, "implementation", None) != "NVIDIA":
        # Numba's own, deprecated CUDA target (numba-cuda replaces it when installed): its
        # simulator lacks what flatopt uses, such as default_stream
        return ("numba-cuda is not installed (numba.cuda is Numba's own built-in CUDA "
                f"target); {INSTALL_HINT}")
    if _cuda_import.simulated():
        return None
    try:
        from numba.cuda.cudadrv.driver import driver
        if driver.get_device_count() < 1:
            return ("the CUDA driver found no GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES")
    except Exception as exc:  # CudaSupportError and friends, worded by numba-cuda
        return (f"no usable CUDA driver ({type(exc).__name__}: {exc}); install the NVIDIA "
                "driver (nvidia-smi must list the GPU)")
    try:
        from numba.cuda.cudadrv.nvvm import NVVM
        NVVM()
    except Exception as exc:
        return (f"the CUDA toolkit's libNVVM was not found ({type(exc).__name__}: {exc}); "
                f"{INSTALL_HINT}")
    try:
        cuda.get_current_device()
    except Exception as exc:
        return f"the GPU cannot be used ({type(exc).__name__}: {exc})"
    return None


def resolve(device: Any, stream: Any, bit_exact: Any, rule, who: str):
    """(the device: a :class:`HostDevice` or a :class:`CudaDevice`, a note for ``repr`` or
    None), chosen once for the optimizer's life."""
    if device not in DEVICES:
        raise DeviceError(f"{who}: device must be one of {DEVICES}, got {device!r}")
    if not isinstance(bit_exact, bool):
        raise DeviceError(f"{who}: bit_exact must be True or False, got {bit_exact!r}")
    if device == "cpu":
        if stream is not None:
            raise DeviceError(f"{who}: stream= is for device='cuda' (or 'auto'); this "
                              "optimizer runs on the CPU")
        return HostDevice(rule), None
    problem = cuda_problem()
    if problem is None:
        return CudaDevice(rule, stream, bit_exact, who), None
    if device == "cuda":
        raise DeviceError(f"{who}: device='cuda' cannot be used: {problem}. Use device='cpu', "
                          "or device='auto' to fall back to the CPU")
    return HostDevice(rule), f"auto: running on the CPU because {problem}"


# ----------------------------------------------------------------------------- the device
class CudaDevice(Device):
    """One optimizer's device side: its stream, kernels and device buffers (the host
    buffers, ``hosts``, are their mirror)."""

    name = "cuda"
    live_on_host = False

    def __init__(self, rule, stream: Any, bit_exact: bool, who: str):
        super().__init__(rule)
        self.host = kernel_backend("cpu")  # prepare, and the host mirror's arrays
        self.host_kernels = self.host.compile(rule)
        self.kernels_module = kernel_backend("cuda")
        self.cuda = self.kernels_module.cuda
        self.stream = self._stream(stream, who)
        self.bit_exact = bit_exact
        self.kernels = self.kernels_module.compile(rule, exact=bit_exact)
        self.ordinal = 0 if simulator_array_type() else self.cuda.get_current_device().id
        self.buffers: list[DeviceBuffer] = []
        self.host_depth = 0  # host_side blocks open

    def _stream(self, stream: Any, who: str):
        cuda = self.cuda
        if stream is None:
            return cuda.default_stream()
        if isinstance(stream, int) and not isinstance(stream, bool):
            return cuda.external_stream(stream)
        for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            handle = getattr(stream, attribute, None)
            if isinstance(handle, int):
                return cuda.external_stream(handle)
        if hasattr(stream, "synchronize") and hasattr(stream, "auto_synchronize"):  # numba's
            return stream
        raise DeviceError(f"{who}: stream must be a numba-cuda stream, a torch.cuda.Stream, "
                          f"a cupy.cuda.Stream or a raw stream handle (int), got "
                          f"{type(stream).__name__}")

    def __repr__(self) -> str:
        exact = ", bit_exact" if self.bit_exact else ""
        return f"cuda:{self.ordinal}{exact}"

    # ------------------------------------------------------------------- construction
    def attach(self, buffers: list[FlatBuffer]) -> None:
        """Upload new buffers (their host arrays hold the initial values)."""
        super().attach(buffers)
        for buf in buffers:
            self.buffers.append(DeviceBuffer(self.cuda, buf, self.stream))

    def flat(self, buf: FlatBuffer) -> tuple[Any, Any]:
        d = self.buffers[buf.number]
        return d.params, d.grads

    def refresh_layout(self, buf: FlatBuffer) -> None:
        """Upload ``buf``'s chunk table again (after tests change the chunk size)."""
        d = self.buffers[buf.number]
        d.layout = DeviceLayout(d.layout.present, d.layout.offsets, d.layout.sizes,
                                self.cuda.to_device(buf.chunk_first, stream=self.stream),
                                buf.chunk_size, buf.length)

    def _upload(self, flat: np.ndarray):
        return self.cuda.to_device(_codec.as_bits(flat), stream=self.stream)

    def allocate(self, buf: FlatBuffer, used) -> None:
        """Device slots for the slots the settings use (the host mirror's, just allocated,
        holds their initial values, and an 8-bit slot's block scales)."""
        d = self.buffers[buf.number]
        for name in used:
            if name not in d.state:
                d.state[name] = self._upload(buf.state[name])
            if name in buf.absmax and name not in d.absmax:
                d.absmax[name] = self._upload(buf.absmax[name])

    def _bind(self, buf: FlatBuffer, plan, rule) -> DeviceBuffer:
        """The device arguments of ``plan`` (made once per plan: a settings change)."""
        d = self.buffers[buf.number]
        if d.plan is not plan:
            self.allocate(buf, plan.used)
            if buf.coded:
                d.coded = _codec.coded_plan(buf, plan.schema, plan.used, device=d)
                d.kernels = self.kernels_module.compile_coded(rule, d.coded.layout,
                                                              exact=self.bit_exact)
            else:
                d.arrays = (d.params, d.grads,
                            *(d.state[name] if name in plan.used else d.grads
                              for name in rule.slots))
                d.kernels = self.kernels
            d.scalars = self.cuda.to_device(plan.scalars, stream=self.stream)
            d.prepare_scalars = self.cuda.to_device(plan.prepare_scalars, stream=self.stream)
            if plan.sums is not None:
                d.sums = self.cuda.to_device(plan.sums, stream=self.stream)
                d.zero_sums = np.zeros_like(plan.sums)
            d.plan = plan
        return d

    # ------------------------------------------------------------------- stepping
    def prepare(self, buf: FlatBuffer, plan) -> int:
        """The rule's prepare on the host (step counts, bias corrections: float64 as on the
        CPU); the step uploads the columns."""
        return self.host_kernels.prepare(buf.present, buf.kernel_columns,
                                         plan.prepare_scalars, plan.flags)

    def update(self, buf: FlatBuffer, plan, arrays, multiplier, scale: bool) -> None:
        """The device part of one buffer's step, queued on the stream (``prepare`` has run on
        the host)."""
        rule = self.rule
        if rule.per_parameter is not None:
            present = np.flatnonzero(buf.present)
            self._pull(buf, present, ("params", "grads", *plan.used))
            per_parameter_update(rule, buf, plan, multiplier, scale, buf.state)
            self._push(buf, present, ("params", "grads", *plan.used))
            return
        d = self._upload_step(buf, plan, rule)
        stream = self.stream
        arrays = self._arguments(buf, d)
        if rule.reduces(plan.flags):
            d.sums.copy_to_device(d.zero_sums, stream=stream)
            d.kernels.reduce(arrays, d.scalars, d.columns, plan.flags, d.layout, d.sums,
                             multiplier, scale, stream=stream, zero_sums=False)
            d.kernels.finalize(d.layout.present, d.columns, d.prepare_scalars, plan.flags,
                               d.sums, stream=stream)
            scale = False  # the reduce pass scaled the gradients
        d.kernels.step(arrays, d.scalars, d.columns, plan.flags, d.layout, multiplier, scale,
                       stream=stream)

    @staticmethod
    def _arguments(buf: FlatBuffer, d: DeviceBuffer) -> tuple:
        """The kernel arrays of this step: a coded buffer's carry its draw."""
        return d.coded.arguments(buf.draws) if buf.coded else d.arrays

    def _upload_step(self, buf: FlatBuffer, plan, rule) -> DeviceBuffer:
        """The plan's device arguments, with this step's presence and columns uploaded."""
        d = self._bind(buf, plan, rule)
        for staged, value in zip(d.staged, (buf.present, *buf.kernel_columns)):
            staged[...] = value
        # From pageable memory the driver copies the staging array before returning (no
        # device wait), so the next step may refill it at once.
        d.packed.copy_to_device(d.staging, stream=self.stream)
        return d

    def reduce_pass(self, buf: FlatBuffer, plan, arrays, multiplier, scale: bool) -> None:
        """A rule with global reductions: the reduce pass queued, with this step's
        presence, columns and scalars (``combine`` rewrites them at every step)."""
        d = self._upload_step(buf, plan, self.rule)
        d.scalars.copy_to_device(plan.scalars, stream=self.stream)
        d.sums.copy_to_device(d.zero_sums, stream=self.stream)
        d.kernels.reduce(self._arguments(buf, d), d.scalars, d.columns, plan.flags, d.layout,
                         d.sums, multiplier, scale, stream=self.stream, zero_sums=False)

    def read_sums(self, staged: list) -> None:
        """The per-parameter totals of the queued reduce passes into each ``plan.sums``:
        one wait for the queued work, not one per buffer."""
        for buf, plan, _ in staged:
            self.buffers[buf.number].sums.copy_to_host(plan.sums, stream=self.stream)
        self.stream.synchronize()

    def step_pass(self, buf: FlatBuffer, plan, arrays) -> None:
        """A rule with global reductions: the step pass queued with the scalars ``combine``
        gave it (the reduce pass scaled the gradients)."""
        d = self.buffers[buf.number]
        d.scalars.copy_to_device(plan.scalars, stream=self.stream)
        d.kernels.step(self._arguments(buf, d), d.scalars, d.columns, plan.flags, d.layout,
                       plan.one, False, stream=self.stream)

    def reduce_present(self, mode: int, power: float) -> tuple[float, int]:
        """``HostDevice.reduce_present`` on the device: one launch per buffer into one
        accumulator, read back once (the step's only wait, and only when clipping or checking
        for non-finite gradients)."""
        k = self.kernels_module
        out = self.cuda.to_device(np.zeros(3), stream=self.stream)
        for buf, d in zip(self.hosts, self.buffers):
            d.layout.present.copy_to_device(buf.present, stream=self.stream)
            fmt = _codec.half_format(buf.grads.dtype)
            k.reduce_gradients(d.layout, d.grads if fmt == NATIVE else d.grads.view(np.uint16),
                               d.layout.present, power, mode, out, stream=self.stream, fmt=fmt)
        totals = out.copy_to_host(stream=self.stream)
        self.stream.synchronize()  # the copy above is asynchronous on a stream
        return k.combine_reduction(totals, mode)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every present gradient by ``factor`` (rounded to each buffer's dtype;
        16-bit gradients: in float32, rounded to nearest, by the coded walk over the
        gradients alone)."""
        kernels = self.kernels_module.compile(SCALE_GRADIENTS)
        for buf, d in zip(self.hosts, self.buffers):
            d.layout.present.copy_to_device(buf.present, stream=self.stream)
            fmt = _codec.half_format(buf.grads.dtype)
            if fmt == NATIVE:
                kernels.step((d.grads, d.grads), d.no_scalars, (), (), d.layout,  # as on
                             buf.dtype.type(factor), True, stream=self.stream)  # the host
                continue
            formats = (UNUSED, fmt) + (UNUSED,) * (POSITIONS - 2)
            coded = self.kernels_module.compile_coded(SCALE_GRADIENTS,
                                                      Layout(formats, DIRECT, NEAREST))
            stored = (d.empty.no_bytes, d.grads.view(np.uint8)) + \
                (d.empty.no_bytes,) * (POSITIONS - 2)
            coded.step((stored, (d.empty.no_scales,) * POSITIONS, d.empty.tables,
                        np.uint64(0), np.uint64(0), np.uint64(0)), d.no_scalars, (), (),
                       d.layout, np.float32(factor), True, stream=self.stream)

    def map_state(self, buf: FlatBuffer, rule, slots, scalars, flags, present) -> None:
        """``Optimizer._map_state`` for one buffer: ``rule``'s span over the parameters
        ``present`` marks, on the device arrays, queued on the stream (the next step uploads
        its own presence over ``present``'s)."""
        d = self.buffers[buf.number]
        d.layout.present.copy_to_device(present, stream=self.stream)
        kernels = self.kernels_module.compile(rule, exact=self.bit_exact)
        kernels.step((d.params, d.grads, *(d.state[name] for name in slots)),
                     self.cuda.to_device(scalars, stream=self.stream), (), flags, d.layout,
                     buf.dtype.type(1), False, stream=self.stream)

    # ------------------------------------------------------------------- gradients in
    def gradient_problem(self, info: ParamInfo, value: Any) -> str | None:
        """None: device values are checked by :meth:`sources`."""
        return None

    def value_problem(self, info: ParamInfo, value: Any) -> str | None:
        if not isinstance(value, (np.ndarray, np.generic)):
            return (f"value for {info.path!r} is a {type(value).__name__}; on "
                    "device='cuda', opt.params[path] = value takes a NumPy array (copy a "
                    "device array with opt.params[path].copy_to_device(array); not for "
                    "16-bit parameters with master weights or Kahan compensation, which "
                    "opt.params[path] = array resets)")
        return value_problem(info, value, "value")

    def _source(self, info: ParamInfo, value: Any) -> tuple[Any, str | None]:
        """(the value as a device array or a host NumPy array, or a problem). A bfloat16
        gradient on the device comes as its bit patterns (uint16 or int16: Numba, CuPy and
        torch's ``__cuda_array_interface__`` have no bfloat16)."""
        dtype = self.hosts[info.buffer].grads.dtype
        if isinstance(value, (np.ndarray, np.generic)):
            return np.asarray(value), gradient_problem(info, value, dtype)
        accepted = (np.dtype(np.uint16), np.dtype(np.int16)) \
            if _codec.bits_dtype(dtype) != dtype else (dtype,)
        held = f"{dtype} (as uint16 or int16 bit patterns)" if len(accepted) > 1 else dtype
        if is_numba_device_array(value):
            if value.shape != info.shape or value.dtype not in accepted:
                return None, (f"gradient for {info.path!r} is a device array of shape "
                              f"{value.shape} and dtype {value.dtype}; the gradient is "
                              f"{info.shape} {held}")
            return value, None
        try:
            desc = value.__cuda_array_interface__
        except AttributeError:
            desc = None
        except Exception as exc:  # torch: a CPU tensor, or one that requires grad
            return None, (f"gradient for {info.path!r}: {type(value).__name__} cannot be read "
                          f"on the device ({exc}); pass tensor.detach() on the GPU (a bfloat16 "
                          "one as tensor.view(torch.int16)), or a NumPy array")
        if desc is None:
            return None, (f"gradient for {info.path!r} is a {type(value).__name__}; give a "
                          "NumPy array or a device array with __cuda_array_interface__ (CuPy, "
                          f"PyTorch, Numba) of shape {info.shape} and dtype {info.dtype}")
        problem = interface_problem(info, desc, accepted, held)
        if problem:
            return None, problem
        ordinal = exporter_device(value, desc["data"][0])
        if ordinal is not None and ordinal != self.ordinal:
            where = "the CPU" if ordinal < 0 else f"GPU {ordinal}"
            return None, (f"gradient for {info.path!r} is on {where}, but the optimizer's "
                          f"buffers are on GPU {self.ordinal}; move it there first (or build "
                          "the optimizer under that device's context)")
        return wrap_interface(value, desc), None

    def _overlaps_grads(self, source: Any) -> bool:
        """Whether a device source is (a view of) one of this optimizer's gradient buffers."""
        if isinstance(source, np.ndarray):
            return False
        fake = simulator_array_type()
        if fake is not None:
            return any(np.may_share_memory(source._ary, d.grads._ary) for d in self.buffers)
        start = source.device_ctypes_pointer.value or 0
        stop = start + source.nbytes
        for d in self.buffers:
            low = d.grads.device_ctypes_pointer.value or 0
            if start < low + d.grads.nbytes and low < stop:
                return True
        return False

    def sources(self, pairs) -> list:
        """[(info, source)] for [(info, value)]: every value checked (one GradientError naming
        them all, a DeviceError for a wrong device, before anything is copied), and values
        that alias the gradient buffer copied first."""
        problems, sources, wrong_device = [], [], False
        for info, value in pairs:
            source, problem = self._source(info, value)
            if problem:
                problems.append(problem)
                wrong_device |= " is on " in problem
            else:
                sources.append((info, source))
        if problems:
            raise (DeviceError if wrong_device else GradientError)("\n".join(problems))
        return [(info, self._copy(source) if self._overlaps_grads(source) else source)
                for info, source in sources]

    def _copy(self, source):
        copy = self.cuda.device_array(source.shape, source.dtype, stream=self.stream)
        copy.copy_to_device(source, stream=self.stream)
        return copy

    def _segment(self, flat, info: ParamInfo):
        return flat[info.offset:info.offset + info.size]

    def write_gradient(self, info: ParamInfo, source) -> None:
        """Copy a checked source into the flat gradient buffer (host to device, or device to
        device on the stream)."""
        self._write(self.buffers[info.buffer].grads, info, source)

    def _write(self, flat, info: ParamInfo, source) -> None:
        if info.size:
            target = self._segment(flat, info)
            values = source.reshape(info.size) if not isinstance(source, np.ndarray) else \
                np.ascontiguousarray(source).reshape(info.size)
            if values.dtype != target.dtype:  # 16-bit values: their bit patterns
                values = values.view(target.dtype)
            target.copy_to_device(values, stream=self.stream)

    def write_param(self, info: ParamInfo, source: np.ndarray) -> None:
        """Copy a checked NumPy array into the flat parameter buffer; a 16-bit parameter's
        master copy takes the values and its Kahan compensation is cleared
        (``_codec.reset_parameter``)."""
        d = self.buffers[info.buffer]
        self._write(d.params, info, source)
        if d.master is not None:
            self._write(d.master, info, np.asarray(source).astype(np.float32))
        if d.compensation is not None:
            self._fill(self._segment(d.compensation, info))

    def _fill(self, target) -> None:
        """``target[...] = 0`` on the device (a gradient or compensation segment)."""
        self.kernels_module.launch_elementwise(self.kernels_module.fill_kernel, target.size,
                                               self.stream, target, target.dtype.type(0))

    def zero_gradient(self, info: ParamInfo) -> None:
        """Zero one parameter's slice of the gradient buffer (a missing gradient's view)."""
        self._fill(self._segment(self.buffers[info.buffer].grads, info))

    def add_gradient(self, info: ParamInfo, source) -> None:
        """``grads[path] += source``; 16-bit gradients in float32, rounded to nearest."""
        if info.size:
            grads = self.buffers[info.buffer].grads
            if isinstance(source, np.ndarray):
                source = self._upload(np.ascontiguousarray(source))
            source = source.reshape(info.size)
            if source.dtype != grads.dtype:  # bfloat16 patterns given as int16
                source = source.view(grads.dtype)
            target = self._segment(grads, info)
            fmt = _codec.half_format(self.hosts[info.buffer].grads.dtype)
            if fmt == NATIVE:
                self.kernels_module.launch_elementwise(self.kernels_module.add_kernel,
                                                       info.size, self.stream, target, source)
            else:
                self.kernels_module.launch_elementwise(
                    self.kernels_module.half_kernels()["add"], info.size, self.stream,
                    target.view(np.uint16), source.view(np.uint16), fmt)

    def zero_grads(self) -> None:
        for d in self.buffers:
            self._fill(d.grads)

    # ------------------------------------------------------------------- host mirror
    def _flat(self, d: DeviceBuffer, buf: FlatBuffer, name: str):
        if name == "params":
            return d.params, buf.params
        if name == "grads":
            return d.grads, buf.grads
        return d.state[name], buf.state[name]

    def _segments(self, buf: FlatBuffer, slots, names):
        """(device segment, host segment) of parameters ``slots`` in the named arrays."""
        d = self.buffers[buf.number]
        for name in names:
            device, host = self._flat(d, buf, name)
            layout = buf.layout(name)  # a shaped slot packs its entries its own way
            for k in slots:
                a, b = int(layout.offsets[k]), int(layout.offsets[k] + layout.sizes[k])
                if b > a:
                    yield device[a:b], host[a:b]

    def _pull(self, buf: FlatBuffer, slots, names) -> None:
        """Copy parameters ``slots`` of the named arrays from the device to the mirror."""
        for device, host in self._segments(buf, slots, names):
            device.copy_to_host(_codec.as_bits(host), stream=self.stream)
        self.stream.synchronize()

    def _push(self, buf: FlatBuffer, slots, names) -> None:
        for device, host in self._segments(buf, slots, names):
            device.copy_to_device(_codec.as_bits(host), stream=self.stream)
        self.stream.synchronize()  # the host arrays may change as soon as we return

    def pull(self) -> None:
        """Refresh the host mirror of every parameter and state buffer (whole buffers, one
        copy each), waiting for the queued steps first."""
        for buf, d in zip(self.hosts, self.buffers):
            for device, host in d.mirrored(buf):
                device.copy_to_host(_codec.as_bits(host), stream=self.stream)
        self.stream.synchronize()

    def push(self) -> None:
        """Upload the host mirror (after a restore changed it): parameters, master copy,
        compensation, every state slot and block scale (allocating device arrays for new
        ones, dropping removed ones)."""
        for buf, d in zip(self.hosts, self.buffers):
            for device, host in ((d.state, buf.state), (d.absmax, buf.absmax)):
                for name in list(device):
                    if name not in host:
                        del device[name]
                for name, flat in host.items():
                    if name not in device:
                        device[name] = self._upload(flat)
            for device, host in d.mirrored(buf):
                device.copy_to_device(_codec.as_bits(host), stream=self.stream)
            d.plan = None
        self.stream.synchronize()

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        """Host code changes the mirror inside the block (a restore: it writes
        ``buf.params``, ``buf.state`` and ``opt.params`` views, which point at the mirror
        meanwhile); afterwards the device gets the result (or, if the block failed, what it
        had: the mirror was refreshed from it first). A block inside another is part of it
        (a checkpoint load's restore and its reduced-precision commit: one pull, one push)."""
        if self.host_depth:
            yield
            return
        self.pull()
        self.host_depth += 1
        device_views = dict(self.param_views)
        for buf in self.hosts:
            for slot, path in enumerate(buf.paths):
                self.param_views[path] = buf.view(buf.params, slot)
        try:
            yield
        finally:
            self.host_depth -= 1
            self.param_views.update(device_views)
            self.push()

    # ------------------------------------------------------------------- EMA support
    def copy_of(self, flat):
        return self._copy(flat)

    def copy_into(self, target, source) -> None:
        target.copy_to_device(source, stream=self.stream)

    def lerp(self, average, value, weight, from_end: bool) -> None:
        k = self.kernels_module  # bit_exact: the CPU's rounding (no fused multiply-add)
        k.launch_elementwise(k.exact_lerp_kernel() if self.bit_exact else k.lerp_kernel,
                             average.size, self.stream, average, value, weight, from_end)

    def master_of(self, buf: FlatBuffer) -> Any:
        return self.buffers[buf.number].master

    def float_values(self, buf: FlatBuffer) -> Any:
        """``HostDevice.float_values`` on the device (16-bit values decoded into the
        buffer's one scratch array: valid until the next call, as the EMA uses it)."""
        d = self.buffers[buf.number]
        fmt = _codec.half_format(buf.params.dtype)
        if fmt == NATIVE or d.master is not None:
            return d.params if fmt == NATIVE else d.master
        if d.decoded is None:  # allocated once, not at every EMA update
            d.decoded = self.cuda.device_array(buf.length, np.float32, stream=self.stream)
        self.kernels_module.launch_elementwise(self.kernels_module.half_kernels()["decode"],
                                               buf.length, self.stream, d.decoded,
                                               d.params.view(np.uint16), fmt)
        return d.decoded

    def put_rounded(self, buf: FlatBuffer, values) -> None:
        self.kernels_module.launch_elementwise(
            self.kernels_module.half_kernels()["encode"], buf.length, self.stream,
            self.buffers[buf.number].params.view(np.uint16), values,
            _codec.half_format(buf.params.dtype))

    def to_host(self, array) -> np.ndarray:
        host = array.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def upload(self, view, value) -> None:
        if view.size:
            view.copy_to_device(np.ascontiguousarray(value))
