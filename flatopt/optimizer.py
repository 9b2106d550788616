"""The stateful optimizer base class: packing, groups, stepping, state, state dicts.

A subclass declares a :class:`~flatopt.schema.Schema` (hyperparameters, per-parameter columns,
state slots, its kernel rule) and three small methods that turn a group's settings into its
kernel arguments (:meth:`Optimizer.kernel_scalars`, :meth:`Optimizer.kernel_flags`,
:meth:`Optimizer.prepare_scalars`). Everything else is here, written once from the schema: state
get/set/reset, ``state_dict``/``load_state_dict``, and the contract checkpoints use
(:meth:`Optimizer.settings`, ``opt.buffers`` and :meth:`Optimizer.restore`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from . import _device, _params, _restore, _state_dict, _stepping
from ._stepping import StepResult
from ._layout import FlatBuffer, ParamIndex, ParamInfo, WalkLayout
from ._restore import BufferState
from ._validated import Validated
from ._views import Gradients, ParamViews, gradient_problem
from .errors import (GradientError, HyperparameterError, ParamError, StateDictError,
                     UnknownPathError)
from .errors import raise_problems as _raise
from .kernels import backend as kernel_backend
from .schema import Schema, describe_group, near



def _locked(method):
    """Run ``method`` holding the optimizer's lock (see ``Optimizer.lock``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return wrapper


def _torch_implementation_arguments(name: str, arguments: dict) -> None:
    """torch's implementation switches: ``foreach`` and ``fused`` are accepted and ignored
    (flatopt's step is always one fused kernel per buffer), so torch code ports unchanged;
    ``capturable`` and ``differentiable`` have no meaning here and are refused when set."""
    for key in ("foreach", "fused"):
        value = arguments.pop(key, None)
        if value is not None and not isinstance(value, bool):
            raise HyperparameterError(f"{name}: {key} must be None, True or False, got {value!r}")
    for key, why in (("capturable", "there are no CUDA graphs to capture"),
                     ("differentiable", "flatopt steps are not part of an autograd graph")):
        value = arguments.pop(key, False)
        if value is not False:
            raise HyperparameterError(f"{name}: {key}={value!r} has no meaning in flatopt "
                                      f"({why}); leave it out")


class _Plan:
    """A buffer's kernel arguments for one validated settings dict (rebuilt when it changes)."""

    __slots__ = ("settings", "scalars", "prepare_scalars", "flags", "used", "arrays", "one",
                 "sums")

    def __init__(self, settings, scalars, prepare_scalars, flags, used):
        self.settings = settings
        self.scalars = scalars
        self.one = scalars.dtype.type(1)  # the gradient multiplier of a plain step
        self.prepare_scalars = prepare_scalars
        self.flags = flags
        self.used = used
        self.arrays = None  # (params, grads, *slots), once the used slots are allocated
        self.sums = None  # per-parameter totals of a rule with a reduce pass


class Optimizer:
    """Base class: parameters packed into flat per-(group, dtype) buffers.

    Subclasses set ``schema`` and implement ``kernel_scalars``, ``kernel_flags`` and (when
    the rule's prepare step takes scalars) ``prepare_scalars``; register them with
    :func:`flatopt.registry.register` so checkpoints and tools find them.
    """

    schema: ClassVar[Schema]

    def __init__(self, params: Any, **defaults: Any):
        # comm= (an mpi4py communicator): data-parallel ZeRO-1, see flatopt.distributed
        comm = defaults.pop("comm", None)
        self._sharding = None
        if comm is None:
            self._build(params, defaults)
        else:
            from . import distributed
            self._sharding = distributed.build_together(
                self, comm, lambda: self._build(params, defaults))
        self.comm = comm

    def _build(self, params: Any, defaults: dict[str, Any]) -> None:
        name = f"{type(self).__name__}()"
        _torch_implementation_arguments(name, defaults)
        # where the buffers live (flatopt._device): "cpu" (default), "cuda", or "auto"
        device, stream = defaults.pop("device", "cpu"), defaults.pop("stream", None)
        bit_exact = defaults.pop("bit_exact", False)
        values, problems = self.schema.check_group(self.schema.defaults(**defaults), name,
                                                   extras=())
        _raise(problems, HyperparameterError)
        self.defaults: dict[str, Any] = values
        self.param_groups: list[dict[str, Any]] = []
        self.buffers: list[FlatBuffer] = []
        self.index = ParamIndex()
        self._param_views: dict[str, np.ndarray] = {}
        self._grad_views: dict[str, np.ndarray] = {}
        self._group_paths: list[tuple[str, ...]] = []
        self._validated: list[Validated | None] = []
        self._plans: list[_Plan | None] = []
        self._warned_no_gradient = False
        self.lock = threading.RLock()
        """Held by step, zero_grad, add_param_group, state_dict, load_state_dict, restore and
        by flatopt.save / flatopt.load for the whole save or load: one optimizer is safe to
        use from several threads (what the caller writes into ``opt.params``/``opt.grads``
        views is the caller's to order)."""
        self._backend = kernel_backend("cpu")
        self._kernels = self._backend.compile(self.schema.rule)
        self._device, self._device_note = _device.resolve(device, stream, bit_exact,
                                                          self.schema.rule, name)
        self.params = ParamViews(self, self._param_views)
        self.grads = Gradients(self, self._grad_views)
        structure: list[str] = []
        groups = _params.split_groups(params, structure)
        _raise(structure, ParamError)
        self._add_groups(groups, require_params=True)

    @property
    def sharding(self):
        """The ZeRO-1 sharding of the state over the ranks of ``comm=`` (a
        ``flatopt.distributed.Sharding``), or None for an optimizer that holds all of it."""
        return self._sharding

    @property
    def device(self) -> str:
        """Where the buffers live and the kernels run: "cpu" or "cuda"."""
        return "cpu" if self._device is None else "cuda"

    def host_buffers(self) -> list[FlatBuffer]:
        """``opt.buffers`` with their parameter and state arrays holding the current values in
        host memory (for checkpoint saves). On the CPU these are the live buffers; on CUDA
        the host mirror, refreshed from the device now (it waits for queued steps)."""
        if self._device is not None:
            self._device.pull(self)
        return self.buffers

    def _host_side(self):
        """A context in which host code may rewrite the buffers' host arrays (a restore);
        on CUDA the device gets the result at its end."""
        return contextlib.nullcontext() if self._device is None else \
            self._device.host_side(self)

    def _set_backend(self, name: str) -> None:
        """Run the kernels of backend ``name`` ("cpu" or "cuda") from the next step on, on
        the buffers where they are: host buffers with the CUDA backend work only under the
        simulator (tests/test_cuda_kernels.py uses this); ``device="cuda"`` is the real
        thing."""
        self._backend = kernel_backend(name)
        self._kernels = self._backend.compile(self.schema.rule)
        self._plans = [None] * len(self.buffers)

    # ----------------------------------------------------------------- construction
    @_locked
    def add_param_group(self, group: Mapping[str, Any]) -> None:
        """Add a group (e.g. an unfrozen layer): new buffers; existing ones are untouched."""
        if not isinstance(group, Mapping):
            raise ParamError(f"param_group must be a dict, got {type(group).__name__}")
        self.settings()  # the existing groups must be intact before more are added
        self._add_groups([group])

    def _check_entries(self, group: Mapping, where: str, seen: dict[str, str],
                       problems: list[str]) -> list[tuple[str, np.ndarray]]:
        entries = []
        for path, array in _params.as_pairs(group["params"], where, problems):
            problem = _params.path_problem(path)
            if problem is None and (path in seen or path in self.index):
                problem = (f"path {path!r} appears more than once (also in "
                           f"{seen.get(path, 'an existing group')}); every path must be unique")
            if problem is None:
                seen[path] = where
                array = np.asarray(array) if isinstance(array, np.generic) else array
                problem = _params.array_problem(path, array)
            if problem is None and self.schema.param_problem is not None:
                reason = self.schema.param_problem(array.shape)
                problem = f"parameter {path!r} {reason}" if reason else None
            if problem is None and any(np.shares_memory(array, buf.params)
                                       for buf in self.buffers):
                problem = (f"parameter {path!r} is a view of this optimizer's own buffer (it "
                           "is already optimized under another path)")
            if problem is None:
                entries.append((path, array))
            else:
                problems.append(f"{where}: {problem}")
        return entries

    def _add_groups(self, groups: list, require_params: bool = False) -> None:
        """Validate every group completely, then build their buffers (all or nothing)."""
        param_problems: list[str] = []
        hyper_problems: list[str] = []
        seen: dict[str, str] = {}
        staged = []
        for number, group in enumerate(groups, start=len(self.param_groups)):
            if not isinstance(group, Mapping) or "params" not in group:
                what = "has no 'params' entry" if isinstance(group, Mapping) else \
                    f"must be a dict, got {type(group).__name__}"
                param_problems.append(f"param group {number} {what}")
                continue
            where = describe_group(number, group)
            overrides = {k: v for k, v in group.items() if k != "params"}
            values, problems = self.schema.check_group({**self.defaults, **overrides}, where)
            hyper_problems += problems
            staged.append((values, self._check_entries(group, where, seen, param_problems)))
        all_arrays = [entry for _, entries in staged for entry in entries]
        param_problems += _params.tied_problems(all_arrays)
        if require_params and not all_arrays and not param_problems:
            param_problems.append("optimizer got an empty parameter list; give a dict "
                                  "{path: array} with at least one parameter")
        _raise(param_problems, ParamError)
        _raise(hyper_problems, HyperparameterError)
        infos: list[ParamInfo] = []
        next_id = len(self.index)
        for values, entries in staged:
            ids = {path: next_id + k for k, (path, _) in enumerate(entries)}
            next_id += len(entries)
            infos += self._build_buffers(len(self.param_groups), entries, ids, values)
            paths = tuple(path for path, _ in entries)
            self.param_groups.append({"params": paths, **values})
            self._group_paths.append(paths)
            self._validated.append(None)
        # Views are handed out in id order, as the user gave them; new ids come last.
        infos.sort(key=lambda info: info.id)
        self.index._extend(infos)
        if self._device is not None:
            self._device.attach(self.buffers[len(self._device.buffers):])
        for info in infos:
            buf = self.buffers[info.buffer]
            params, grads = (buf.params, buf.grads) if self._device is None else \
                self._device.flat(buf)
            self._param_views[info.path] = buf.view(params, info.slot)
            self._grad_views[info.path] = buf.view(grads, info.slot)

    def _build_buffers(self, group: int, entries: list, ids: dict,
                       settings: Mapping[str, Any]) -> list[ParamInfo]:
        """One buffer per dtype of the group's entries, filled with their values (and, for an
        eager schema, the state its settings use, at its initial values)."""
        rule = self.schema.rule
        infos = []
        for dtype in dict.fromkeys(array.dtype for _, array in entries):
            members = [(path, array) for path, array in entries if array.dtype == dtype]
            columns = {name: rule.column_dtype(name, dtype) for name in rule.columns}
            buf = FlatBuffer(len(self.buffers), group, dtype, [ids[p] for p, _ in members],
                             [p for p, _ in members], [a.shape for _, a in members], columns,
                             self.schema.shaped_slots)
            for slot, (path, array) in enumerate(members):
                buf.view(buf.params, slot)[...] = array
                infos.append(ParamInfo(ids[path], path, array.shape, array.dtype, group,
                                       buf.number, slot, int(buf.offsets[slot]),
                                       int(buf.sizes[slot])))
            if self.schema.eager:
                for name in self.schema.used_slots(settings):
                    buf.state[name] = self._new_slot(buf, name, settings)
            self.buffers.append(buf)
            self._plans.append(None)
        return infos

    def _new_slot(self, buf: FlatBuffer, name: str, settings: Mapping[str, Any]):
        """A state buffer for ``buf`` holding fresh state: zeros, or the slot's initial value."""
        flat = self._backend.zeros(buf.layout(name).length, buf.dtype)
        initial = self.schema.initial_value(name, settings)
        if initial:
            flat.fill(initial)
        return flat

    # ----------------------------------------------------------------- settings
    def settings(self) -> list[dict[str, Any]]:
        """Every group's values (hyperparameters, and label and initial_lr when set), read
        from ``param_groups`` and validated now, as torch reads them at every step. Raises
        :class:`HyperparameterError` naming every problem; the returned dicts are shared,
        never modify them."""
        groups = self.param_groups
        if not isinstance(groups, list) or len(groups) != len(self._group_paths):
            count = len(groups) if isinstance(groups, list) else type(groups).__name__
            raise HyperparameterError(
                f"param_groups was changed from {len(self._group_paths)} groups to {count}; "
                "groups cannot be removed or replaced: use add_param_group() to add one, and "
                "set a group's lr to 0 (or leave its gradients missing) to freeze it")
        settings = []
        problems: list[str] = []
        for number, group in enumerate(groups):
            if not isinstance(group, dict):
                problems.append(f"param group {number} was replaced by a "
                                f"{type(group).__name__}; change values inside the group dict")
                continue
            validated = self._validated[number]
            changes = None if validated is None else validated.changes(group)
            if changes == {}:
                settings.append(validated.values)
                continue
            if changes is not None and "params" not in changes:  # values changed: those only
                values, value_problems = self.schema.check_group(changes, "",
                                                                 base=validated.values)
                if not value_problems:
                    settings.append(values)
                    self._validated[number] = Validated(group, values, validated, changes)
                    continue
            where = describe_group(number, group)
            if group.get("params") is not self._group_paths[number]:
                problems.append(f"{where}: 'params' was changed or the groups were reordered; "
                                "groups keep their parameters: use add_param_group() to add "
                                "parameters")
            values, value_problems = self.schema.check_group(group, where)
            problems += value_problems
            settings.append(values)
            if not value_problems:
                self._validated[number] = Validated(group, values)
        _raise(problems, HyperparameterError)
        return settings

    # ----------------------------------------------------------------- stepping
    def kernel_scalars(self, settings: Mapping[str, Any], dtype: np.dtype):
        """The rule's ``Scalars`` for a group (float64 values, rounded once to ``dtype``)."""
        return self.schema.rule.scalars()

    def kernel_flags(self, settings: Mapping[str, Any]):
        """The rule's ``Flags`` for a group."""
        return self.schema.rule.flags()

    def prepare_scalars(self, settings: Mapping[str, Any]):
        """The rule's ``PrepareScalars`` for a group (float64)."""
        return self.schema.rule.prepare_scalars()

    def check_step(self, settings: list[dict[str, Any]]) -> None:
        """Raise if the optimizer cannot step with these group settings (a schedule-free
        optimizer in eval mode); called before a step changes anything. Nothing by default."""

    def after_step(self, settings: list[dict[str, Any]]) -> None:
        """After a step that was taken (not skipped), write into ``param_groups`` the group
        state (``Hyperparameter.state``) the step advanced, from the ``settings`` it stepped
        with: schedule-free's counters. Nothing by default; :meth:`before_step` is the hook
        for group state the kernels read."""

    def _map_state(self, rule, slots: tuple[str, ...], arguments) -> None:
        """Run a tool rule's span (``kernels/rules/schedulefree.py``'s ``SWITCH``) over every
        parameter that has state, wherever the buffers live: its arrays are ``(params, grads,
        *slots)``; ``arguments(buf)`` gives the buffer's ``(scalars, flags)`` (scalars an
        array in the buffer's dtype), or None to leave it alone. A buffer whose ``slots`` are
        not allocated has no state. Sharded: each rank its own range, then the parameters
        are gathered (collective: every rank calls it)."""
        if self._sharding is not None:
            self._sharding.map_state(rule, slots, arguments)
            return
        kernels = None
        for buf in self.buffers:
            args = arguments(buf)
            if args is None or any(name not in buf.state for name in slots):
                continue
            scalars, flags = args
            present = np.asarray(self.schema.stateful(buf.columns), np.uint8)
            if self._device is not None:
                self._device.map_state(buf, rule, slots, scalars, flags, present)
                continue
            kernels = kernels or self._backend.compile(rule)
            layout = WalkLayout(present, buf.offsets, buf.sizes, buf.chunk_first,
                                  buf.chunk_size, buf.length)
            kernels.step((buf.params, buf.grads, *(buf.state[name] for name in slots)),
                         scalars, (), flags, layout, buf.dtype.type(1), False)

    def _plan(self, buf: FlatBuffer, settings: dict) -> _Plan:
        """The kernel arguments for ``settings`` (a new plan each time they change: a
        scheduler's new ``lr`` costs this once per buffer and step, a few microseconds)."""
        rule = self.schema.rule
        # with global reductions, combine() writes the scalars at every step
        scalars = (rule.scalars(*[0.0] * len(rule.scalars._fields)) if rule.global_reductions
                   else self.kernel_scalars(settings, buf.dtype))
        prepare = self.prepare_scalars(settings)
        flags = self.kernel_flags(settings)
        for value, layout in ((scalars, rule.scalars), (prepare, rule.prepare_scalars),
                              (flags, rule.flags)):
            if type(value) is not layout:
                raise TypeError(f"{type(self).__name__} gave a {type(value).__name__} where "
                                f"rule {rule.name!r} takes its {layout.__name__}")
        plan = _Plan(settings, np.array(scalars, dtype=buf.dtype),
                     np.array(prepare, dtype=np.float64), tuple(map(bool, flags)),
                     self.schema.used_slots(settings))
        previous = self._plans[buf.number]
        if previous is not None and previous.used == plan.used:  # the same slots: keep them
            plan.arrays, plan.sums = previous.arrays, previous.sums
        elif rule.reductions:
            plan.sums = np.zeros((len(buf), len(rule.reductions)))
        self._plans[buf.number] = plan
        return plan

    def _arrays(self, buf: FlatBuffer, plan: _Plan) -> tuple:
        """The kernel's arrays, allocating the slots the settings use; unused slots are
        stood in for by the gradient buffer, which the kernel then never touches as a slot."""
        for name in plan.used:
            if name not in buf.state:
                buf.state[name] = self._new_slot(buf, name, plan.settings)
        if self._device is not None:
            self._device.allocate(buf, plan.used)
        plan.arrays = (buf.params, buf.grads,
                       *(buf.state[name] if name in plan.used else buf.grads
                         for name in self.schema.rule.slots))
        return plan.arrays

    @_locked
    def step(self, grads: Mapping[str, np.ndarray | None] | None = None, *,
             max_grad_norm: float | None = None, norm_type: float = 2.0,
             grad_scale: float | None = None, skip_nonfinite: bool = False,
             error_if_nonfinite: bool = False) -> StepResult:
        """Take one optimization step.

        Without ``grads``, steps on the flat gradient buffer (``opt.grads``), updating exactly
        the parameters whose gradients are marked present. With ``grads`` (path -> array), the
        arrays are copied in first and define presence: an absent path, or ``None``, is a
        missing gradient. Nothing changes if any gradient or hyperparameter is invalid.

        Options, each applied to the present gradients inside the step's own pass over them
        (the gradient buffer then holds the gradients the update used, as torch leaves them):

        - ``grad_scale``: the gradients are ``grad_scale`` times the true ones (a loss scale,
          or the number of accumulated micro-batches): divided out.
        - ``max_grad_norm`` (``norm_type``): clip the total norm of the gradients (after the
          scale is removed) as ``torch.nn.utils.clip_grad_norm_`` does: multiply by
          ``min(1, max_grad_norm / (norm + 1e-6))``. One extra reading pass computes the norm.
        - ``skip_nonfinite``: when a present gradient holds NaN or infinity, skip the whole
          step: no parameter, state or step count changes.
        - ``error_if_nonfinite``: raise :class:`GradientError` instead (nothing changes).

        Returns a :class:`StepResult` (``skipped``, ``grad_norm``, ``nonfinite``).
        With ``comm=``, every rank calls ``step`` (see :mod:`flatopt.distributed`).
        """
        if self._sharding is not None:
            return self._sharding.step(grads, max_grad_norm=max_grad_norm, norm_type=norm_type,
                                       grad_scale=grad_scale, skip_nonfinite=skip_nonfinite,
                                       error_if_nonfinite=error_if_nonfinite)
        settings = self.settings()
        self.check_step(settings)
        if grads is not None:
            self._stage_gradients(grads)
        multiplier, result = _stepping.gradient_multiplier(
            self, max_grad_norm=max_grad_norm, norm_type=norm_type, grad_scale=grad_scale,
            skip_nonfinite=skip_nonfinite, error_if_nonfinite=error_if_nonfinite)
        if result.skipped:
            return result
        settings = self._advance(settings)
        scale = multiplier != 1.0
        kernels = self._kernels
        together = self.schema.rule.global_reductions
        stepped = False
        staged = []
        for buf in self.buffers:
            plan = self._plans[buf.number]
            if plan is None or plan.settings is not settings[buf.group]:
                plan = self._plan(buf, settings[buf.group])
            arrays = plan.arrays
            if arrays is None:
                if not buf.present.any():
                    continue  # nothing to step: no state is allocated
                arrays = self._arrays(buf, plan)
            if kernels.prepare(buf.present, buf.kernel_columns, plan.prepare_scalars,
                               plan.flags):
                stepped = True
                if together:
                    staged.append((buf, plan, arrays))
                else:
                    self._update(buf, plan, arrays, buf.dtype.type(multiplier) if scale
                                 else plan.one, scale)
        if staged:
            self._update_together(
                settings, staged,
                lambda buf, plan, arrays: self._reduce_pass(
                    buf, plan, arrays, buf.dtype.type(multiplier) if scale else plan.one,
                    scale),
                self._step_pass)
        self.after_step(settings)
        if not stepped and not self._warned_no_gradient:
            self._warned_no_gradient = True
            warnings.warn(f"{type(self).__name__}.step(): no gradient is marked present, so "
                          "nothing was updated. Gradients written into opt.grads[path] (with "
                          "out= or [...] =) must be marked with opt.grads.mark_present(); "
                          "opt.grads[path] = value and step(grads) mark them for you. (Said "
                          "once per optimizer.)", stacklevel=3)
        return result

    def _update(self, buf: FlatBuffer, plan: _Plan, arrays: tuple, multiplier, scale: bool):
        """The update of one prepared buffer: the rule's reduce and finalize passes when it
        has per-parameter totals, then its span over every chunk; or, for a rule over whole
        matrices, its NumPy function per present parameter."""
        kernels, rule, columns = self._kernels, self.schema.rule, buf.kernel_columns
        if self._device is not None:
            self._device.update(self, buf, plan, multiplier, scale)
            return
        if rule.per_parameter is not None:
            self._update_per_parameter(buf, plan, multiplier, scale)
            return
        if rule.reduces(plan.flags):
            kernels.reduce(arrays, plan.scalars, columns, plan.flags, buf, plan.sums,
                           multiplier, scale)
            kernels.finalize(buf.present, columns, plan.prepare_scalars, plan.flags,
                             plan.sums)
            scale = False  # the reduce pass scaled the gradients
        kernels.step(arrays, plan.scalars, columns, plan.flags, buf, multiplier, scale)

    def _reduce_pass(self, buf: FlatBuffer, plan: _Plan, arrays: tuple, multiplier,
                     scale: bool) -> None:
        """The reduce pass of a rule with global reductions: per-parameter totals into
        ``plan.sums`` (on CUDA queued; ``_update_together`` reads them back)."""
        if self._device is not None:
            self._device.reduce_pass(self, buf, plan, multiplier, scale)
        else:
            self._kernels.reduce(arrays, plan.scalars, buf.kernel_columns, plan.flags, buf,
                                 plan.sums, multiplier, scale)

    def _step_pass(self, buf: FlatBuffer, plan: _Plan, arrays: tuple) -> None:
        """The step pass of a rule with global reductions (its reduce pass scaled the
        gradients)."""
        if self._device is not None:
            self._device.step_pass(self, buf, plan)
        else:
            self._kernels.step(arrays, plan.scalars, buf.kernel_columns, plan.flags, buf,
                               plan.one, False)

    # ----------------------------------------------------------------- group state
    def before_step(self, settings: list[dict[str, Any]]) -> list[dict | None] | None:
        """New group state (``Hyperparameter(state=True)`` values) at the start of a step
        that goes ahead, before any kernel runs (the kernels read it): per group a dict of
        new values (or None), or None for no change. AdEMAMix counts its groups' steps here;
        :meth:`after_step` writes state the step itself advanced."""
        return None

    def combine(self, settings: list[dict[str, Any]], totals: np.ndarray | None):
        """A rule with global reductions (``Rule.global_reductions``, Prodigy): called twice
        per step. ``totals`` None: before the reduce pass, returns ``(scalars, None)``; then
        with ``totals[group, j]``, reduction ``j`` over every present parameter of the group,
        returns ``(scalars, changes)``: ``scalars`` per group the rule's ``Scalars`` for
        the pass that follows, ``changes`` per group new group-state values (or None)."""
        raise NotImplementedError(f"{type(self).__name__}: a rule with global reductions "
                                  "needs the optimizer's combine()")

    def _set_group_state(self, changes: list[dict | None]) -> None:
        for group, change in zip(self.param_groups, changes):
            if change:
                group.update(change)

    def _advance(self, settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``before_step``'s changes written into the groups; the settings that include
        them."""
        changes = self.before_step(settings)
        if changes is None:
            return settings
        self._set_group_state(changes)
        return self.settings()

    def _update_together(self, settings: list[dict[str, Any]], staged: list, reduce,
                         step) -> None:
        """One step of a rule with global reductions over the ``staged`` (buffer, plan, x)
        items (prepared buffers; ``x`` is the caller's: arrays, or a rank's shard):
        ``combine`` gives the reduce pass's scalars; ``reduce(*item)`` fills each
        ``plan.sums``; the totals per group are the sums of those rows, buffer by buffer (the
        per-parameter totals do not depend on the thread count or world size, nor then
        does anything added from them); ``combine`` turns them into the step pass's scalars and
        new group state; then ``step(*item)`` for every buffer. Single-process, CUDA and
        ZeRO-1 steps all come through here with their own passes."""
        rule = self.schema.rule
        self._write_scalars(staged, self.combine(settings, None)[0])
        for item in staged:
            reduce(*item)
        if self._device is not None:
            self._device.read_sums(staged)
        totals = np.zeros((len(settings), len(rule.reductions)))
        for buf, plan, _ in staged:  # rows of absent parameters are zero
            totals[buf.group] += plan.sums.sum(axis=0)
        scalars, changes = self.combine(settings, totals)
        self._write_scalars(staged, scalars)
        if changes is not None:
            self._set_group_state(changes)
        for item in staged:
            step(*item)

    def _write_scalars(self, staged: list, scalars: list) -> None:
        layout = self.schema.rule.scalars
        for buf, plan, _ in staged:
            value = scalars[buf.group]
            if type(value) is not layout:
                raise TypeError(f"{type(self).__name__}.combine gave a {type(value).__name__} "
                                f"where rule {self.schema.rule.name!r} takes its "
                                f"{layout.__name__}")
            plan.scalars[...] = value

    def _update_per_parameter(self, buf: FlatBuffer, plan: _Plan, multiplier, scale: bool):
        """A rule over whole matrices: its NumPy function per present parameter, on the
        buffer's host arrays."""
        for k in np.flatnonzero(buf.present):
            if scale:
                buf.view(buf.grads, k)[...] *= multiplier
            self.schema.rule.per_parameter(
                buf.view(buf.params, k), buf.view(buf.grads, k),
                {name: buf.state_view(name, k) for name in plan.used}, plan.settings,
                {name: column[k] for name, column in buf.columns.items()})

    def _known(self, path: Any, what: str, problems: list[str]) -> ParamInfo | None:
        """The index record of ``path``, or None after adding a message naming it."""
        info = self.index.get(path) if isinstance(path, str) else None
        if info is None:
            problems.append(f"{what} unknown parameter {path!r}{near(path, self.index.paths)}")
        return info

    def _stage_gradients(self, grads: Mapping[str, Any]) -> None:
        if not isinstance(grads, Mapping):
            raise GradientError(f"step(grads) takes a dict {{path: array}}, got "
                                f"{type(grads).__name__}")
        problems = []
        staged = []
        for path, value in grads.items():
            info = self._known(path, "gradient given for", problems)
            if info is None or value is None:
                continue
            if self._device is not None:  # checked with the device's rules below
                staged.append((info, value))
                continue
            problem = gradient_problem(info, value)
            if problem:
                problems.append(problem)
            else:
                staged.append((info, value))
        _raise(problems, GradientError)
        if self._device is not None:
            staged = self._device.sources(self, staged)
            for buf in self.buffers:
                buf.mark_missing()
            for info, value in staged:
                self._device.write_gradient(self, info, value)
                self.buffers[info.buffer].mark_present(info.slot)
            return
        # A value that is a view of the gradient buffer (opt.grads[other]) is read before
        # any gradient is written, so copying one gradient cannot change another.
        staged = [(info, value.copy() if any(np.may_share_memory(value, buf.grads)
                                             for buf in self.buffers) else value)
                  for info, value in staged]
        for buf in self.buffers:
            buf.mark_missing()
        for info, value in staged:
            self._grad_views[info.path][...] = value
            self.buffers[info.buffer].mark_present(info.slot)

    @_locked
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none=True`` marks every gradient missing (the buffer's contents are left as
        they are and ignored until marked present again); ``False`` zeroes the gradient buffer
        and leaves presence as it is, like torch, which zeroes existing gradients and leaves a
        missing (None) one missing: a present gradient then makes a real step with zeros."""
        if set_to_none:
            for buf in self.buffers:
                buf.mark_missing()
            return
        if self._device is not None:
            self._device.zero_grads(self)
        else:
            for buf in self.buffers:
                buf.grads.fill(0)
        for buf in self.buffers:
            buf.stale[:] = 0

    # ----------------------------------------------------------------- state
    def _param_state(self, buf: FlatBuffer, slot: int, copy: bool) -> dict | None:
        if self._sharding is not None:
            self._sharding.refuse("state_dict() / state_of()")
        if not self.schema.stateful({name: column[slot] for name, column in buf.columns.items()
                                     if name in self.schema.columns}):
            return None
        # .item(): a Python int for an integer column, a float for a float one (NAdam's
        # mu_product), as the schema's checks of an entry expect
        entry: dict[str, Any] = {name: buf.columns[name][slot].item()
                                 for name in self.schema.state_dict_columns}
        for name in self.schema.slots:
            view = buf.state_view(name, slot) if name in buf.state else None
            if view is not None:
                entry[name] = view.copy() if copy else view
        return entry

    def _info(self, path: Any) -> ParamInfo:
        info = self.index.get(path) if isinstance(path, str) else None
        if info is None:
            raise UnknownPathError(f"no parameter {path!r}{near(path, self.index.paths)}; "
                                   "opt.index.paths lists them")
        return info

    @_locked
    def state_of(self, path: str):
        """The live state of one parameter as a typed record of views, or None if it has none."""
        info = self._info(path)
        if self._device is not None:  # host copies: the mirror's views would go stale
            self._device.pull(self)
        entry = self._param_state(self.buffers[info.buffer], info.slot,
                                  copy=self._device is not None)
        return None if entry is None else self.schema.record(**entry)

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """A snapshot keyed by path: hyperparameters per group and per-parameter state (copies,
        in host memory whatever the device)."""
        self.host_buffers()
        state = {}
        for info in self.index:
            entry = self._param_state(self.buffers[info.buffer], info.slot, copy=True)
            if entry is not None:
                state[info.path] = entry
        return _state_dict.build(self, state)

    @_locked
    def load_state_dict(self, state_dict: Mapping[str, Any], *,
                        hyperparameters: str = "saved") -> None:
        """Load a :meth:`state_dict` snapshot, matched by path, never by position.

        Every difference (kind, paths, shapes, dtypes, state slots and values, grouping) is
        collected into one :class:`StateDictError` before anything changes.
        ``hyperparameters="saved"`` (torch's behaviour) takes each group's hyperparameters from
        the snapshot, which then needs the same grouping; ``"live"`` keeps the optimizer's own
        and loads state only. Data is copied: the snapshot and the optimizer never share memory.
        """
        if self._sharding is not None:
            self._sharding.refuse("load_state_dict()")
        state, settings = _state_dict.parse(self, state_dict, hyperparameters)
        with self._host_side():
            _restore.apply(self, state, settings, None, None)

    @_locked
    def load_torch_state_dict(self, state_dict: Mapping[str, Any], names: Any, *,
                              hyperparameters: str = "saved") -> None:
        """Continue a run made with ``torch.optim``: load its ``state_dict()`` into this
        optimizer (built with the same parameters, their current values, and groups).
        ``names`` gives the path of each of torch's parameter indices: a list (torch numbers
        parameters group by group, in order: ``names[i]`` is parameter ``i``) or a dict
        ``{index: path}``. torch's ``foreach``/``fused`` are dropped; its tensors become
        arrays, its step counts ints. Then exactly :meth:`load_state_dict`'s checks and
        ``hyperparameters`` option; on any problem a :class:`StateDictError` and nothing
        changes."""
        self.load_state_dict(_state_dict.from_torch(self, state_dict, names),
                             hyperparameters=hyperparameters)

    # ----------------------------------------------------------------- restore (load contract)
    @_locked
    def prepare_restore(self, state: Mapping[str, Any] | None = None, *,
                        settings: list[dict | None] | None = None,
                        params: Mapping[str, np.ndarray] | None = None,
                        buffers: Mapping[int, BufferState] | None = None) -> "_restore.PendingRestore":
        """Validate a :meth:`restore` without changing anything; ``.apply()`` on the result
        makes it (so a caller can do more between the two, such as loading a scheduler).
        Raises :class:`StateDictError` naming every problem."""
        if self._sharding is not None:
            self._sharding.refuse("restore()")
        state = state or {}
        _raise(_restore.restore_problems(self, state, settings, params, buffers), StateDictError)
        return _restore.PendingRestore(self, state, settings, params, buffers)

    @_locked
    def restore(self, state: Mapping[str, Any] | None = None, *,
                settings: list[dict | None] | None = None,
                params: Mapping[str, np.ndarray] | None = None,
                buffers: Mapping[int, BufferState] | None = None) -> None:
        """Replace this optimizer's state (the one path every load takes).

        ``state``: path -> entry as in :meth:`state_dict` (an entry means the parameter has
        state; parameters without one get fresh state). ``settings``: per group, new values
        (normalised dicts from :meth:`Schema.check_group`) or None to keep them. ``params``:
        path -> new parameter values. ``buffers``: buffer number -> :class:`BufferState`, whole
        buffers with the live layout (their state replaces that buffer's entirely).
        Everything is validated first; on any problem a :class:`StateDictError` names them
        all and nothing changes. Data is copied.
        """
        self.prepare_restore(state, settings=settings, params=params, buffers=buffers).apply()

    def __repr__(self) -> str:
        device = self._device_note or self._device or "cpu"
        lines = [f"{type(self).__name__} ({len(self.index)} parameters, "
                 f"{len(self.buffers)} buffers, device={device})"]
        for number, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {number}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines)
