"""The stateful optimizer base class: packing, groups, stepping, state, state dicts.

A subclass declares a :class:`~flatopt.schema.Schema` (hyperparameters, per-parameter columns,
state slots, its kernel rule) and three small methods that turn a group's settings into its
kernel arguments (:meth:`Optimizer.kernel_scalars`, :meth:`Optimizer.kernel_flags`,
:meth:`Optimizer.prepare_scalars`). Everything else is here, written once from the schema: state
get/set/reset, ``state_dict``/``load_state_dict``, and the contract checkpoints use
(:meth:`Optimizer.settings`, ``opt.buffers`` and :meth:`Optimizer.restore`).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import numpy as np

from . import (_codec, _device, _lossless, _params, _restore, _state_dict, _stepping, _storage,
               distributed)
from ._layout import FlatBuffer, ParamIndex, ParamInfo
from ._plan import Plan, make_plan, update_all
from ._restore import BufferState
from ._stepping import StepResult
from ._validated import Validated, validate_groups
from ._views import Gradients, ParamViews
from .errors import GradientError, HyperparameterError, NonFiniteGradientWarning, ParamError, \
    StateDictError, UnknownPathError
from .errors import raise_problems as _raise
from .kernels.threads import check_policy
from .schema import Schema, describe_group, near


def _locked(method):
    """Run ``method`` holding the optimizer's lock (see ``Optimizer.lock``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return wrapper


class Optimizer:
    """Base class: parameters packed into flat per-(group, dtype) buffers.

    Subclasses set ``schema`` and implement ``kernel_scalars``, ``kernel_flags`` and (when
    the rule's prepare step takes scalars) ``prepare_scalars``; register them with
    :func:`flatopt.registry.register` so checkpoints and tools find them."""

    schema: ClassVar[Schema]
    path_columns: ClassVar[Mapping[str, Callable[[str, tuple], float]]] = {}  # _params

    def __init__(self, params: Any, **defaults: Any):
        # comm= (an mpi4py communicator): data-parallel ZeRO-1, see flatopt.distributed
        comm = defaults.pop("comm", None)
        self._sharding = None
        if comm is None:
            self._build(params, defaults)
        else:
            self._sharding = distributed.build_together(
                self, comm, lambda: self._build(params, defaults))
        self.comm = comm

    def _build(self, params: Any, defaults: dict[str, Any]) -> None:
        name = f"{type(self).__name__}()"
        _params.torch_implementation_arguments(name, defaults)
        # where the buffers live (flatopt._device): "cpu" (default), "cuda", or "auto"
        device, stream = defaults.pop("device", "cpu"), defaults.pop("stream", None)
        bit_exact = defaults.pop("bit_exact", False)
        # master_weights, rounding, state_dtype, grad_dtype, seed: fixed per group
        self._base_storage = _storage.checked(self.schema, _storage.take(defaults),
                                              _storage.Storage(), name)
        self._storage: list[_storage.Storage] = []
        values, problems = self.schema.check_group(self.schema.defaults(**defaults), name,
                                                   extras=())
        _raise(problems, HyperparameterError)
        self.defaults: dict[str, Any] = values
        self.param_groups: list[dict[str, Any]] = []
        self.buffers: list[FlatBuffer] = []
        self.index = ParamIndex()
        self._group_paths: list[tuple[str, ...]] = []
        self._validated: list[Validated | None] = []
        self._plans: list[Plan | None] = []
        self._warned: set[type[Warning]] = set()
        self._group_checks: list[weakref.WeakMethod] = []
        self.lock = threading.RLock()
        """Held by step, zero_grad, add_param_group, state_dict, load_state_dict, restore and
        by flatopt.save / flatopt.load for the whole save or load: one optimizer is safe to
        use from several threads (what the caller writes into ``opt.params``/``opt.grads``
        views is the caller's to order)."""
        # where the buffers live and the kernels run, chosen once: a HostDevice or CudaDevice
        self._device, self._device_note = _device.resolve(device, stream, bit_exact,
                                                          self.schema.rule, name)
        self.params = ParamViews(self, self._device.param_views)
        self.grads = Gradients(self, self._device.grad_views)
        structure: list[str] = []
        groups = _params.split_groups(params, structure)
        _raise(structure, ParamError)
        self._add_groups(groups, require_params=True)

    @property
    def storage(self) -> tuple:
        """Each group's storage settings (a ``flatopt._storage.Storage``: master_weights,
        rounding, state_dtype, grad_dtype, seed), fixed at construction."""
        return tuple(self._storage)

    def memory(self) -> dict[str, int]:
        """Bytes this optimizer holds, by kind: ``params``, ``grads``, ``master`` (float32
        master weights and Kahan compensation), ``state`` (with 8-bit block scales), and
        ``total``. State is counted once it is allocated (at the first step); sharded, this
        rank's part of the state and master weights."""
        return _codec.memory(self.buffers if self._sharding is None else self._sharding.shards)

    @property
    def sharding(self):
        """The ZeRO-1 sharding of the state over the ranks of ``comm=`` (a
        ``flatopt.distributed.Sharding``), or None for an optimizer that holds all of it."""
        return self._sharding

    @property
    def device(self) -> str:
        """Where the buffers live and the kernels run: "cpu" or "cuda"."""
        return self._device.name

    def host_buffers(self) -> list[FlatBuffer]:
        """``opt.buffers`` with their parameter and state arrays holding the current values in
        host memory (for checkpoint saves). On the CPU these are the live buffers; on CUDA
        the host mirror, refreshed from the device now (it waits for queued steps)."""
        self._device.pull()
        return self.buffers

    def _set_backend(self, name: str) -> None:
        """Run the kernels of backend ``name`` ("cpu" or "cuda") from the next step on, on
        host buffers: with the CUDA backend this works only under the simulator
        (tests/test_cuda_kernels.py uses this); ``device="cuda"`` is the real thing."""
        self._device.use_backend(name)
        self.invalidate_plans()

    # ----------------------------------------------------------------- construction
    @_locked
    def add_param_group(self, group: Mapping[str, Any]) -> None:
        """Add a group (e.g. an unfrozen layer): new buffers; existing ones are untouched."""
        if not isinstance(group, Mapping):
            raise ParamError(f"param_group must be a dict, got {type(group).__name__}")
        self.settings()  # the existing groups must be intact before more are added
        self._add_groups([group])

    def check_added_groups(self, check) -> None:
        """Have ``check(number, paths, storages)`` (a bound method, held weakly) vet every
        group :meth:`add_param_group` adds, before anything changes: a wrapper that cannot
        serve some groups (``Lookahead``: reduced precision) raises to refuse one."""
        self._group_checks.append(weakref.WeakMethod(check))

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
            storage = _storage.checked(self.schema, _storage.take(overrides),
                                       self._base_storage, where)
            values, problems = self.schema.check_group({**self.defaults, **overrides}, where)
            hyper_problems += problems
            staged.append((values, storage, _params.check_entries(
                self.schema, group, where, seen, self.index, self.buffers, param_problems)))
        all_arrays = [entry for _, _, entries in staged for entry in entries]
        param_problems += _params.tied_problems(all_arrays)
        if require_params and not all_arrays and not param_problems:
            param_problems.append("optimizer got an empty parameter list; give a dict "
                                  "{path: array} with at least one parameter")
        _raise(param_problems, ParamError)
        _raise(hyper_problems, HyperparameterError)
        constants = _params.constant_columns(self.path_columns, all_arrays)  # ParamError
        infos, next_id = [], len(self.index)
        resolved = [_storage.resolve_group(self.schema, storage, entries, len(self.param_groups) + n)
                    for n, (_, storage, entries) in enumerate(staged)]
        for n, ((_, _, entries), storages) in enumerate(zip(staged, resolved)):
            for check in filter(None, (ref() for ref in self._group_checks)):
                check(len(self.param_groups) + n, [p for p, _ in entries], storages)
        for (values, storage, entries), storages in zip(staged, resolved):
            ids = {path: next_id + k for k, (path, _) in enumerate(entries)}
            next_id += len(entries)
            infos += self._build_buffers(len(self.param_groups), entries, ids, values,
                                         storages, constants)
            paths = tuple(path for path, _ in entries)
            self.param_groups.append({"params": paths, **values})
            self._storage.append(storage)
            self._group_paths.append(paths)
            self._validated.append(None)
        # Views are handed out in id order, as the user gave them; new ids come last.
        infos.sort(key=lambda info: info.id)
        self.index._extend(infos)
        self._device.attach(self.buffers[len(self._device.hosts):])
        self._device.add_views(infos)

    def _build_buffers(self, group: int, entries: list, ids: dict, settings: Mapping[str, Any],
                       storages: list, constants: dict) -> list[ParamInfo]:
        """One buffer per dtype and storage of the group's entries, filled with their values
        (and, for an eager schema, the state its settings use, at its initial values)."""
        rule = self.schema.rule
        infos = []
        for storage in dict.fromkeys(storages):
            members = [(path, array) for (path, array), s in zip(entries, storages)
                       if s == storage]
            columns = {name: rule.column_dtype(name, storage.compute) for name in rule.columns}
            buf = FlatBuffer(len(self.buffers), group, storage.compute,
                             [ids[p] for p, _ in members], [p for p, _ in members],
                             [a.shape for _, a in members], columns,
                             self.schema.shaped_slots, storage, constants)
            for slot, (path, array) in enumerate(members):
                buf.view(buf.params, slot)[...] = array
                _codec.reset_parameter(buf, slot)
                infos.append(ParamInfo(ids[path], path, array.shape, array.dtype, group,
                                       buf.number, slot, int(buf.offsets[slot]),
                                       int(buf.sizes[slot])))
            if self.schema.eager:
                for name in self.schema.used_slots(settings):
                    buf.state[name] = self.new_slot(buf, name, settings)
            self.buffers.append(buf)
            self._plans.append(None)
        return infos

    def new_slot(self, buf: FlatBuffer, name: str, settings: Mapping[str, Any] | None = None):
        """A host state buffer for ``buf``'s slot ``name`` holding fresh state: the slot's
        initial value for ``settings``, zeros without them."""
        initial = 0.0 if settings is None else self.schema.initial_value(name, settings)
        if buf.coded:
            return _codec.new_slot(buf, self.schema, name, initial)
        return self._device.new_slot(buf, name, initial)

    # ----------------------------------------------------------------- settings
    def settings(self) -> list[dict[str, Any]]:
        """Every group's values (hyperparameters, and label and initial_lr when set), read
        from ``param_groups`` and validated now, as torch reads them at every step. Raises
        :class:`HyperparameterError` naming every problem; the returned dicts are shared,
        never modify them."""
        return validate_groups(self.schema, self.param_groups, self._group_paths,
                               self._validated)

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
        check_policy()  # before the first buffer changes
        if self._sharding is not None:
            self._sharding.map_state(rule, slots, arguments)
            return
        for buf in self.buffers:
            args = arguments(buf)
            if args is None or any(name not in buf.state for name in slots):
                continue
            scalars, flags = args
            present = np.asarray(self.schema.stateful(buf.columns), np.uint8)
            self._device.map_state(buf, rule, slots, scalars, flags, present)

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

        Returns a :class:`StepResult` (``skipped``, ``grad_norm``, ``nonfinite``); a NaN that
        a clipped step goes ahead with warns once (``NonFiniteGradientWarning``).
        With ``comm=``, every rank calls ``step`` (see :mod:`flatopt.distributed`).
        """
        check_policy()  # FLATOPT_PARALLEL: refused before anything changes
        if self._sharding is not None:
            return self._sharding.step(grads, max_grad_norm=max_grad_norm, norm_type=norm_type,
                                       grad_scale=grad_scale, skip_nonfinite=skip_nonfinite,
                                       error_if_nonfinite=error_if_nonfinite)
        settings = self.settings()
        self.check_step(settings)
        if grads is not None:
            self.stage_gradients(grads)
        _stepping.check_counters(self, settings)
        multiplier, result = _stepping.gradient_multiplier(
            self._device.reduce_present, max_grad_norm=max_grad_norm, norm_type=norm_type,
            grad_scale=grad_scale, skip_nonfinite=skip_nonfinite,
            error_if_nonfinite=error_if_nonfinite)
        if result.skipped:
            return result
        settings = self.advance(settings)
        stepped = self.update_buffers(settings, multiplier)
        self.after_step(settings)
        if result.nonfinite:
            self.warn_once(_stepping.NONFINITE_WARNING, 4, NonFiniteGradientWarning)
        if not stepped:
            self.warn_once("no gradient is marked present, so nothing was updated. Gradients "
                           "written into opt.grads[path] (with out= or [...] =) must be marked "
                           "with opt.grads.mark_present(); opt.grads[path] = value and "
                           "step(grads) mark them for you. (Said once per optimizer.)", 4)
        return result

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

    # ----------------------------------------------------------------- internal interface
    # What flatopt's own layers (restore, state dicts, the device, ZeRO-1, checkpoints,
    # training tools) use; nothing outside this module touches the attributes behind them.

    @property
    def buffer_device(self):
        """Where the buffers live and the kernels run: the ``flatopt._host.HostDevice`` or
        ``flatopt._device.CudaDevice`` chosen at construction."""
        return self._device

    @property
    def group_paths(self) -> tuple[tuple[str, ...], ...]:
        """The parameter paths of each group, as built (``param_groups`` may be edited)."""
        return tuple(self._group_paths)

    def find(self, path: Any, what: str, problems: list[str]) -> ParamInfo | None:
        """The index record of ``path``, or None after adding a message naming it."""
        info = self.index.get(path) if isinstance(path, str) else None
        if info is None:
            problems.append(f"{what} unknown parameter {path!r}{near(path, self.index.paths)}")
        return info

    def stage_gradients(self, grads: Mapping[str, Any]) -> None:
        """Check every gradient of ``grads`` (path -> array or None), then copy them into the
        gradient buffers, which they define presence for; nothing changes on a problem."""
        if not isinstance(grads, Mapping):
            raise GradientError(f"step(grads) takes a dict {{path: array}}, got "
                                f"{type(grads).__name__}")
        problems = []
        staged = []
        for path, value in grads.items():
            info = self.find(path, "gradient given for", problems)
            if info is None or value is None:
                continue
            problem = self._device.gradient_problem(info, value)
            if problem:
                problems.append(problem)
            else:
                staged.append((info, value))
        _raise(problems, GradientError)
        # A value that is a view of the gradient buffer (opt.grads[other]) is read before
        # any gradient is written, so copying one gradient cannot change another.
        staged = self._device.sources(staged)
        for buf in self.buffers:
            buf.mark_missing()
        for info, source in staged:
            self._device.write_gradient(info, source)
            self.buffers[info.buffer].mark_present(info.slot)

    def gradient_totals(self, mode: int, power: float) -> tuple[float, int]:
        """(sum or max, non-finite count) of the present gradients (``flatopt.kernels``'
        reduction ``mode``), wherever they live."""
        return self._device.reduce_present(mode, power)

    def plan(self, buf: FlatBuffer, settings: dict) -> Plan:
        """The kernel arguments of ``buf`` for ``settings`` (a group's validated values):
        cached until they change (a scheduler's new ``lr`` costs a new plan once per buffer
        and step, a few microseconds) or :meth:`invalidate_plans`."""
        plan = self._plans[buf.number]
        if plan is None or plan.settings is not settings:
            plan = self._plans[buf.number] = make_plan(self, buf, settings, plan)
        return plan

    def invalidate_plans(self) -> None:
        """Forget every buffer's plan (after state or settings were replaced)."""
        self._plans = [None] * len(self.buffers)

    def advance(self, settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``before_step``'s changes written into the groups; the settings that include
        them."""
        changes = self.before_step(settings)
        if changes is None:
            return settings
        self.set_group_state(changes)
        return self.settings()

    def update_buffers(self, settings: list[dict[str, Any]], multiplier: float,
                       layer=None) -> bool:
        """The update of every buffer with a gradient: its plan, its arrays, the rule's
        prepare, then the update (with gradient ``multiplier``), through ``layer``: the
        device, or a ZeRO-1 ``Sharding``, which runs the same update over its rank's range of
        each buffer. Whether some parameter was stepped."""
        return update_all(self, settings, multiplier,
                          self._device if layer is None else layer)

    def warn_once(self, message: str, stacklevel: int,
                  category: type[Warning] = UserWarning) -> None:
        """Warn from a step, once per optimizer and ``category``: UserWarning that a step
        updated nothing, ``NonFiniteGradientWarning`` that one went ahead with NaN."""
        if category not in self._warned:
            self._warned.add(category)
            warnings.warn(f"{type(self).__name__}.step(): {message}", category,
                          stacklevel=stacklevel)

    def warned(self, category: type[Warning]) -> bool:
        """Whether :meth:`warn_once` has given a warning of ``category``."""
        return category in self._warned

    def host_side(self):
        """A context in which host code may rewrite the buffers' host arrays and
        ``opt.params`` views (a restore); on CUDA the device gets the result at its end."""
        return self._device.host_side()

    def set_group_state(self, changes: list[dict | None]) -> None:
        """Write new group-state values (per group a dict, or None) into ``param_groups``."""
        for group, change in zip(self.param_groups, changes):
            if change:
                group.update(change)

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
        self._device.zero_grads()
        for buf in self.buffers:
            buf.stale[:] = 0

    # ----------------------------------------------------------------- state
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
        self._device.pull()  # on CUDA host copies: the mirror's views would go stale
        entry = _state_dict.param_state(self, self.buffers[info.buffer], info.slot,
                                        copy=not self._device.live_on_host)
        return None if entry is None else self.schema.record(**entry)

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """A snapshot keyed by path: hyperparameters per group and per-parameter state (copies,
        in host memory whatever the device)."""
        self.host_buffers()
        state = {}
        for info in self.index:
            entry = _state_dict.saved_entry(self, self.buffers[info.buffer], info.slot)
            if entry is not None:
                state[info.path] = entry
        return _state_dict.build(self, state)

    @_locked
    def load_state_dict(self, state_dict: Mapping[str, Any], *,
                        hyperparameters: str = "saved", convert: bool = False) -> None:
        """Load a :meth:`state_dict` snapshot, matched by path, never by position.

        Every difference (kind, paths, shapes, dtypes, state slots and values, grouping) is
        collected into one :class:`StateDictError` before anything changes.
        ``hyperparameters="saved"`` (torch's behaviour) takes each group's hyperparameters from
        the snapshot, which then needs the same grouping; ``"live"`` keeps the optimizer's own
        and loads state only. Data is copied: the snapshot and the optimizer never share memory.
        Reduced-precision buffers load losslessly (stored arrays, master weights,
        compensation, the rounding stream's draws); a saved storage other than the live one
        is refused by path unless ``convert=True`` (through float32 values; a snapshot holds
        no parameters, but a converted one's master weights, or the live value plus its saved
        Kahan compensation, become its value).
        """
        if self._sharding is not None:
            self._sharding.refuse("load_state_dict()")
        if not isinstance(convert, (bool, np.bool_)):
            raise StateDictError(f"convert must be True or False, got {convert!r}")
        self._device.pull()  # CUDA: what the load keeps is staged from the mirror
        state, settings, params, staged = _state_dict.parse(self, state_dict,
                                                            hyperparameters, convert)
        with self.host_side():
            _restore.apply(self, state, settings, params, None)
            _lossless.commit(self, staged)

    @_locked
    def load_torch_state_dict(self, state_dict: Mapping[str, Any], names: Any, *,
                              hyperparameters: str = "saved", convert: bool = False) -> None:
        """Continue a run made with ``torch.optim``: load its ``state_dict()`` into this
        optimizer (built with the same parameters, their current values, and groups).
        ``names`` gives the path of each of torch's parameter indices: a list (torch numbers
        parameters group by group, in order: ``names[i]`` is parameter ``i``) or a dict
        ``{index: path}``. torch's ``foreach``/``fused`` are dropped; its tensors become
        arrays, its step counts ints. Then exactly :meth:`load_state_dict`'s checks and
        ``hyperparameters`` option; on any problem a :class:`StateDictError` and nothing
        changes. ``convert=True`` loads into reduced-precision buffers (and state of another
        float dtype than the parameter's) through float32 values, as ``load_state_dict``."""
        self.load_state_dict(_state_dict.from_torch(self, state_dict, names, convert),
                             hyperparameters=hyperparameters, convert=convert)

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
        device = self._device_note or self._device
        lines = [f"{type(self).__name__} ({len(self.index)} parameters, "
                 f"{len(self.buffers)} buffers, device={device})"]
        for number, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {number}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines)
