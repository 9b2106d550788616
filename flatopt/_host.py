"""Where an optimizer's buffers live and its kernels run, as an object chosen once at
construction (``flatopt._device.resolve``): :class:`HostDevice` for buffers in host memory,
:class:`flatopt._device.CudaDevice` for buffers in GPU memory. Both have the same methods:

- construction: ``attach`` (new buffers), ``add_views`` (the per-path views behind
  ``opt.params`` and ``opt.grads``, in ``param_views`` and ``grad_views``), ``flat`` (a
  buffer's parameter and gradient arrays where they live; 16-bit ones on a GPU as bit
  patterns), ``new_slot``, ``arrays`` (a plan's kernel arrays, allocating the slots it uses);
- gradients and values in: ``gradient_problem`` / ``value_problem`` (what can be checked
  per value), ``sources`` (the checked values, copies of those that alias the gradient
  buffer), ``write_gradient``, ``add_gradient``, ``zero_gradient``, ``zero_grads``,
  ``write_param``;
- the step: ``prepare``, ``update``, and for rules with global reductions ``reduce_pass``,
  ``read_sums``, ``step_pass``; ``reduce_present`` (norms and non-finite counts of the present
  gradients), ``scale_gradients``, ``map_state``;
- host copies: ``pull`` (the host arrays hold the current values), ``host_side`` (host code
  rewrites them; the device gets the result), ``live_on_host``;
- EMA: ``copy_of``, ``copy_into``, ``lerp``, ``to_host``, ``upload``, and for 16-bit
  parameters ``float_values``, ``master_of``, ``put_rounded``.

Kernels come from ``flatopt.kernels.backend(name)`` only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from . import _codec
from ._layout import FlatBuffer, ParamInfo, WalkLayout
from ._views import gradient_problem, value_problem
from .kernels import MAX_ABS
from .kernels import backend as kernel_backend
from .kernels.tools import SCALE_GRADIENTS


def per_parameter_update(rule, buf: FlatBuffer, plan, multiplier, scale: bool,
                         state: dict) -> None:
    """A rule over whole matrices (``Rule.per_parameter``): its NumPy function per present
    parameter, on the buffer's host arrays, with the state slots of ``state`` (the buffer's
    own, or a replicated shard's)."""
    for k in np.flatnonzero(buf.present):
        if scale:
            buf.view(buf.grads, k)[...] *= multiplier
        rule.per_parameter(
            buf.view(buf.params, k), buf.view(buf.grads, k),
            {name: buf.state_view(name, k, state[name]) for name in plan.used}, plan.settings,
            {name: column[k] for name, column in buf.columns.items()})


class Device:
    """What every device shares: the host buffers it was given, the per-path views of their
    parameters and gradients (where they live), and the allocation of a plan's slots."""

    name = "cpu"
    live_on_host = True
    """Whether the host arrays of the buffers are the live ones (views of them stay valid)."""

    def __init__(self, rule):
        self.rule = rule
        self.hosts: list[FlatBuffer] = []
        self.param_views: dict[str, Any] = {}
        self.grad_views: dict[str, Any] = {}

    def attach(self, buffers: list[FlatBuffer]) -> None:
        """Take new buffers (their host arrays hold the initial values)."""
        self.hosts.extend(buffers)

    def add_views(self, infos: list[ParamInfo]) -> None:
        """The per-path views of new parameters, in the order given (``opt.params``
        iterates in it)."""
        for info in infos:
            buf = self.hosts[info.buffer]
            params, grads = self.flat(buf)
            self.param_views[info.path] = buf.view(params, info.slot)
            self.grad_views[info.path] = buf.view(grads, info.slot)

    def flat(self, buf: FlatBuffer) -> tuple[Any, Any]:
        return buf.params, buf.grads

    def master_of(self, buf: FlatBuffer) -> Any:
        """``buf``'s float32 master weights where they live, or None."""
        return buf.master

    def float_values(self, buf: FlatBuffer) -> Any:
        """``buf``'s parameters as the step computes them, where they live: a 16-bit
        buffer's master weights, or its values in float32 (a new array)."""
        if buf.params.dtype != buf.dtype:
            return buf.master if buf.master is not None else buf.params.astype(buf.dtype)
        return buf.params

    def put_rounded(self, buf: FlatBuffer, values) -> None:
        """``buf``'s 16-bit parameters = float32 ``values``, rounded to nearest (its master
        weights are left as they are)."""
        buf.params[...] = values.astype(buf.params.dtype)

    def zeros(self, n_elements: int, dtype):
        """A zero-filled host array (a state slot, or its host mirror)."""
        return self.host.zeros(n_elements, dtype)

    def new_slot(self, buf: FlatBuffer, name: str, initial: float):
        """A host state buffer for ``buf``'s slot ``name`` holding ``initial`` everywhere."""
        flat = self.zeros(buf.layout(name).length, buf.dtype)
        if initial:
            flat.fill(initial)
        return flat

    def allocate(self, buf: FlatBuffer, used) -> None:
        """Room where the buffers live for the slots ``used`` (host slots are the buffers)."""

    def arrays(self, buf: FlatBuffer, plan) -> tuple | None:
        """The plan's kernel arrays ``(params, grads, *slots)``, allocating the slots its
        settings use the first time the buffer has a gradient (None before: nothing to step,
        no state); unused slots are stood in for by the gradient buffer, which the kernel then
        never touches as a slot."""
        if plan.arrays is None:
            if not buf.present.any():
                return None
            for name in plan.used:
                if name not in buf.state:
                    buf.state[name] = (_codec.new_slot(buf, plan.schema, name,
                                                       plan.initial(name)) if buf.coded
                                       else self.new_slot(buf, name, plan.initial(name)))
            self.allocate(buf, plan.used)
            if buf.coded:
                plan.arrays = _codec.coded_plan(buf, plan.schema, plan.used)
                return plan.arrays
            plan.arrays = (buf.params, buf.grads,
                           *(buf.state[name] if name in plan.used else buf.grads
                             for name in self.rule.slots))
        return plan.arrays

    def refresh_layout(self, buf: FlatBuffer) -> None:
        """Take a changed chunk table of ``buf`` (tests change the chunk size)."""

    def read_sums(self, staged: list) -> None:
        """The per-parameter totals of the reduce passes are in each ``plan.sums``."""

    def pull(self) -> None:
        """The host arrays hold the current values (nothing to copy on the host)."""

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        """Host code rewrites the buffers' host arrays inside the block."""
        yield


class HostDevice(Device):
    """Buffers in host memory, stepped by the kernels of backend ``name`` (``"cpu"``; the
    CUDA backend over host arrays runs under the simulator only, for tests)."""

    def __init__(self, rule, name: str = "cpu"):
        super().__init__(rule)
        self.host = kernel_backend("cpu")  # gradient norms, scaling, EMA, slots
        self.use_backend(name)

    def use_backend(self, name: str) -> None:
        """Step with the kernels of backend ``name`` from now on."""
        self.backend = kernel_backend(name)
        self.kernels = self.backend.compile(self.rule)

    def __repr__(self) -> str:
        return "cpu"

    def zeros(self, n_elements: int, dtype):
        return self.backend.zeros(n_elements, dtype)

    # ------------------------------------------------------------------- the step
    def prepare(self, buf: FlatBuffer, plan) -> int:
        """The rule's prepare over the present parameters; how many there are."""
        return self.kernels.prepare(buf.present, buf.kernel_columns, plan.prepare_scalars,
                                    plan.flags)

    def update(self, buf: FlatBuffer, plan, arrays: tuple, multiplier, scale: bool,
               part=None) -> None:
        """The update of one prepared buffer, over all of it or over ``part`` (a range of it
        with its own walk layout, state and reduce pass: a ZeRO-1 rank's
        ``BufferShard``): the rule's reduce and finalize passes when it has per-parameter
        totals, then its span over every chunk; or, for a rule over whole matrices, its NumPy
        function per present parameter."""
        rule, kernels, columns = self.rule, self.kernels, buf.kernel_columns
        if buf.coded:
            kernels, arrays = self.coded(buf, arrays)
        if rule.per_parameter is not None:
            per_parameter_update(rule, buf, plan, multiplier, scale,
                                 buf.state if part is None else part.state)
            return
        if rule.reduces(plan.flags):
            self.reduce_pass(buf, plan, arrays, multiplier, scale, part, kernels)
            kernels.finalize(buf.present, columns, plan.prepare_scalars, plan.flags,
                             plan.sums)
            scale = False  # the reduce pass scaled the gradients
        kernels.step(arrays, plan.scalars, columns, plan.flags, buf if part is None else part,
                     multiplier, scale)

    def coded(self, buf: FlatBuffer, plan_arrays) -> tuple:
        """The kernels and arguments that step a reduced-precision buffer."""
        return (self.backend.compile_coded(self.rule, plan_arrays.layout),
                plan_arrays.arguments(buf.draws))

    def reduce_pass(self, buf: FlatBuffer, plan, arrays: tuple, multiplier, scale: bool,
                    part=None, kernels=None) -> None:
        """The rule's reduce pass: per-parameter totals into ``plan.sums``."""
        if buf.coded and kernels is None:
            kernels, arrays = self.coded(buf, arrays)
        if part is not None:
            part.reduce(kernels or self.kernels, plan, arrays, multiplier, scale)
        else:
            (kernels or self.kernels).reduce(arrays, plan.scalars, buf.kernel_columns,
                                             plan.flags, buf, plan.sums, multiplier, scale)

    def step_pass(self, buf: FlatBuffer, plan, arrays: tuple, part=None) -> None:
        """The step pass of a rule with global reductions (its reduce pass scaled the
        gradients)."""
        kernels = self.kernels
        if buf.coded:
            kernels, arrays = self.coded(buf, arrays)
        kernels.step(arrays, plan.scalars, buf.kernel_columns, plan.flags,
                     buf if part is None else part, plan.one, False)

    def reduce_present(self, mode: int, power: float) -> tuple[float, int]:
        """(sum or max over every buffer, non-finite count) of the present gradients."""
        total, bad = 0.0, 0
        for buf in self.hosts:
            if not buf.chunk_first.size:
                continue
            if buf.grads.dtype != buf.dtype:  # 16-bit gradients
                value, count = self.host.reduce_coded_gradients(
                    buf.length, buf.grads.view(np.uint8), _codec.half_format(buf.grads.dtype),
                    buf.present, buf.offsets, buf.sizes, buf.chunk_first, buf.chunk_size,
                    buf.length, power, mode)
            else:
                value, count = self.host.reduce_gradients(
                    buf.length, buf.grads, buf.present, buf.offsets, buf.sizes,
                    buf.chunk_first, buf.chunk_size, power, mode)
            bad += int(count)
            if mode == MAX_ABS:
                total = value if not (value <= total) else total
            else:
                total += value
        return total, bad

    def scale_gradients(self, factor: float) -> None:
        """Multiply every present gradient by ``factor`` (rounded to each buffer's dtype)."""
        kernels = self.host.compile(SCALE_GRADIENTS)
        for buf in self.hosts:
            if buf.grads.dtype != buf.dtype:  # 16-bit gradients: rarely, so in NumPy
                _codec.scale_gradients(buf, factor)
                continue
            # the walk reads no parameter: the gradients stand in (16-bit parameters with
            # float32 gradients have no plain kernel type)
            kernels.step((buf.grads, buf.grads), np.zeros(0, buf.dtype), (), (), buf,
                         buf.dtype.type(factor), True)

    def map_state(self, buf: FlatBuffer, rule, slots, scalars, flags, present) -> None:
        """A tool rule's span over the parameters ``present`` marks (arrays ``(params,
        grads, *slots)``)."""
        layout = WalkLayout(present, buf.offsets, buf.sizes, buf.chunk_first, buf.chunk_size,
                            buf.length)
        self.backend.compile(rule).step(
            (buf.params, buf.grads, *(buf.state[name] for name in slots)), scalars, (), flags,
            layout, buf.dtype.type(1), False)

    # ------------------------------------------------------------------- values in
    def gradient_problem(self, info: ParamInfo, value: Any) -> str | None:
        return gradient_problem(info, value, self.hosts[info.buffer].grads.dtype)

    def value_problem(self, info: ParamInfo, value: Any) -> str | None:
        return value_problem(info, value, "value")

    def sources(self, pairs) -> list:
        """[(info, value)] of checked values, those that are views of the gradient buffer
        (``opt.grads[other]``) copied, so writing one gradient cannot change another."""
        return [(info, value.copy() if any(np.may_share_memory(value, buf.grads)
                                           for buf in self.hosts) else value)
                for info, value in pairs]

    def write_gradient(self, info: ParamInfo, source) -> None:
        self.grad_views[info.path][...] = source

    def add_gradient(self, info: ParamInfo, source) -> None:
        view = self.grad_views[info.path]
        view += source

    def zero_gradient(self, info: ParamInfo) -> None:
        self.grad_views[info.path].fill(0)

    def zero_grads(self) -> None:
        for buf in self.hosts:
            buf.grads.fill(0)

    def write_param(self, info: ParamInfo, value) -> None:
        self.param_views[info.path][...] = value
        _codec.reset_parameter(self.hosts[info.buffer], info.slot)

    # ------------------------------------------------------------------- EMA
    def copy_of(self, flat):
        return flat.copy()

    def copy_into(self, target, source) -> None:
        np.copyto(target, source)

    def lerp(self, average, value, weight, from_end: bool) -> None:
        self.host.lerp(average.size, average, value, weight, from_end)

    def to_host(self, array) -> np.ndarray:
        return array.copy()

    def upload(self, view, value) -> None:
        view[...] = value
