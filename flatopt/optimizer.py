"""The stateful optimizer base class: packing, groups, gradients, state dicts.

Subclasses (``SGD``, ``Adam``, ``AdamW``) declare their hyperparameters and implement four
small hooks; the arithmetic itself lives in the stateless kernels of ``flatopt.kernels``.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any, ClassVar, Iterable, Iterator

import numpy as np

from . import _hyper
from ._layout import SUPPORTED_DTYPES, FlatBuffer, ParamIndex, ParamInfo
from .errors import GradientError, HyperparameterError, ParamError, StateDictError

STATE_DICT_FORMAT = "flatopt.state_dict"
STATE_DICT_VERSION = 1
_MAX_STEP = int(np.iinfo(np.int64).max)  # step counts are stored as int64


def _near(word: str, choices: Iterable[str]) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _describe_value(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__}"


def _as_pairs(params: Any, where: str, problems: list[str]) -> list[tuple[Any, Any]]:
    """A group's parameters as (path, array) pairs, from a mapping or a list of pairs."""
    if isinstance(params, (set, frozenset)):
        problems.append(f"{where}: parameters were given as a set, whose order changes between "
                        "runs; give a dict {path: array} or a list of (path, array) pairs")
        return []
    if isinstance(params, np.ndarray):
        problems.append(f"{where}: parameters were given as one bare array; give a dict "
                        "{path: array} so every parameter has a path")
        return []
    if isinstance(params, Mapping):
        return list(params.items())
    try:
        pairs = list(params)
    except TypeError:
        problems.append(f"{where}: parameters must be a dict {{path: array}}, got "
                        f"{type(params).__name__}")
        return []
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2):
            problems.append(f"{where}: parameters must be a dict {{path: array}} or a list of "
                            f"(path, array) pairs; found an element of type {type(item).__name__}")
            return []
    return pairs


def _split_groups(params: Any, problems: list[str]) -> list[dict]:
    """The constructor's ``params`` as a list of group dicts (each with a ``params`` pair list)."""
    if isinstance(params, Mapping):
        if "params" in params and not isinstance(params["params"], np.ndarray):
            problems.append("params looks like one group dict; pass a list of groups "
                            "[{'params': {...}, ...}] or a plain dict {path: array}")
            return []
        return [{"params": params}]
    if isinstance(params, (set, frozenset, np.ndarray)) or not isinstance(params, Iterable):
        return [{"params": params}]  # _as_pairs words the error
    items = list(params)
    if items and all(isinstance(item, Mapping) for item in items):
        return items
    return [{"params": items}]


try:  # numpy >= 2
    _byte_bounds = np.lib.array_utils.byte_bounds
except AttributeError:  # numpy 1.x
    _byte_bounds = np.byte_bounds


def _tied_problems(arrays: list[tuple[str, np.ndarray]]) -> list[str]:
    """Messages for arrays given twice or sharing memory (tied weights), found by a sweep."""
    bounded = []
    for path, array in arrays:
        if array.size:
            low, high = _byte_bounds(array)
            bounded.append((low, high, path, array))
    bounded.sort(key=lambda item: item[0])
    problems = []
    open_intervals: list[tuple[int, str, np.ndarray]] = []  # (high, path, array) reaching on
    for low, high, path, array in bounded:
        open_intervals = [item for item in open_intervals if item[0] > low]
        for _, other_path, other in open_intervals:
            if np.shares_memory(array, other):
                kind = "the same array" if array is other else "arrays sharing memory"
                problems.append(
                    f"parameters {other_path!r} and {path!r} are {kind} (tied weights); "
                    "flatopt copies each parameter into its own buffer, so pass a tied weight "
                    "once, under one path, and add up its gradient contributions before step()")
        open_intervals.append((high, path, array))
    return problems


def _frozen(value: Any) -> Any:
    """A type-exact, immutable copy of a group value, to tell whether it changed since the
    last validation (a list mutated in place, or 0 replacing False, counts as a change)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return (kind, value)
    if kind in (tuple, list):
        return (kind, tuple(_frozen(item) for item in value))
    return (kind, id(value), repr(value))


def _group_snapshot(group: Mapping[str, Any]) -> tuple:
    # "params" is compared by identity: it must stay the tuple the optimizer made.
    return tuple((key, id(value) if key == "params" else _frozen(value))
                 for key, value in group.items())


class ParamViews(Mapping):
    """``opt.params``: path -> writable view into the flat parameter buffer."""

    def __init__(self, views: dict[str, np.ndarray]):
        self._views = views

    def __getitem__(self, path: str) -> np.ndarray:
        try:
            return self._views[path]
        except KeyError:
            raise KeyError(f"no parameter {path!r}{_near(path, self._views)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


class Gradients(Mapping):
    """``opt.grads``: the flat gradient buffers, seen per path, with explicit presence.

    ``opt.grads[path]`` is a writable view (write into it with ``out=`` or ``[...] =``);
    reading or writing it does not change presence. Mark which gradients exist with
    :meth:`mark_present` / :meth:`mark_missing`; ``opt.grads[path] = value`` copies and marks
    present in one go. ``opt.step()`` steps exactly the parameters marked present.
    """

    def __init__(self, optimizer: "Optimizer"):
        self._opt = optimizer

    def _locate(self, path: str) -> ParamInfo:
        info = self._opt.index.get(path)
        if info is None:
            raise GradientError(f"no parameter {path!r}{_near(path, self._opt.index.paths)}")
        return info

    def __getitem__(self, path: str) -> np.ndarray:
        return self._opt._grad_views[self._locate(path).path]

    def __setitem__(self, path: str, value: np.ndarray) -> None:
        info = self._locate(path)
        problem = _gradient_problem(info, value)
        if problem:
            raise GradientError(problem)
        self._opt._grad_views[path][...] = value
        self._opt.buffers[info.buffer].present[info.slot] = 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._opt.index.paths)

    def __len__(self) -> int:
        return len(self._opt.index)

    def _slots(self, paths):
        for path in paths:
            info = self._locate(path)
            yield self._opt.buffers[info.buffer], info.slot

    def mark_present(self, paths: Iterable[str] | None = None) -> None:
        """Mark gradients as present (all of them when ``paths`` is None)."""
        self._mark(paths, 1)

    def mark_missing(self, paths: Iterable[str] | None = None) -> None:
        """Mark gradients as missing: those parameters are skipped entirely by step()."""
        self._mark(paths, 0)

    def _mark(self, paths, value: int) -> None:
        if paths is None:
            for buf in self._opt.buffers:
                buf.present[:] = value
            return
        if isinstance(paths, str):
            paths = [paths]
        located = list(self._slots(paths))  # every path is checked before any flag changes
        for buf, slot in located:
            buf.present[slot] = value

    def is_present(self, path: str) -> bool:
        info = self._locate(path)
        return bool(self._opt.buffers[info.buffer].present[info.slot])

    def present_paths(self) -> list[str]:
        return [info.path for info in self._opt.index
                if self._opt.buffers[info.buffer].present[info.slot]]


def _gradient_problem(info: ParamInfo, value: Any) -> str | None:
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        return (f"gradient for {info.path!r} is a {type(value).__name__}; give a numpy array "
                f"of shape {info.shape} and dtype {info.dtype}")
    if value.shape != info.shape:
        return (f"gradient for {info.path!r} has shape {value.shape}, but the parameter has "
                f"shape {info.shape}")
    if value.dtype != info.dtype:
        return (f"gradient for {info.path!r} has dtype {value.dtype}, but the parameter is "
                f"{info.dtype}; cast it with .astype(np.{info.dtype})")
    return None


class Optimizer:
    """Base class: parameters packed into flat per-(group, dtype) buffers.

    Subclasses set ``hyperparameters`` (name -> (default, checker)) and implement
    ``_cross_check``, ``_init_buffer``, ``_step_buffer``, ``_param_state``,
    ``_set_param_state`` and ``_clear_param_state``.
    """

    hyperparameters: ClassVar[_hyper.Spec] = {}
    state_record: ClassVar[type]

    def __init__(self, params: Any, **defaults: Any):
        name = f"{type(self).__name__}()"
        problems = _hyper.unknown_key_problems(defaults, self.hyperparameters, name, allowed=())
        initial = {key: default for key, (default, _) in self.hyperparameters.items()}
        values, value_problems = _hyper.check_values({**initial, **defaults},
                                                     self.hyperparameters, name,
                                                     self._cross_check)
        _hyper.raise_problems(problems + value_problems)
        self.defaults: dict[str, Any] = values
        self.param_groups: list[dict[str, Any]] = []
        self.buffers: list[FlatBuffer] = []
        self.index = ParamIndex()
        self._param_views: dict[str, np.ndarray] = {}
        self._grad_views: dict[str, np.ndarray] = {}
        self._group_paths: list[tuple[str, ...]] = []
        self._validated: list[tuple[tuple, dict]] = []
        self._scalar_cache: dict[int, tuple[dict, np.ndarray]] = {}
        self.params = ParamViews(self._param_views)
        self.grads = Gradients(self)

        structure: list[str] = []
        groups = _split_groups(params, structure)
        if structure:
            raise ParamError("\n".join(structure))
        self._add_groups(groups, require_params=True)

    # ----------------------------------------------------------------- construction
    def add_param_group(self, group: Mapping[str, Any]) -> None:
        """Add a group (e.g. an unfrozen layer): new buffers; existing ones are untouched."""
        if not isinstance(group, Mapping):
            raise ParamError(f"param_group must be a dict, got {type(group).__name__}")
        self._add_groups([group])

    def _add_groups(self, groups: list[Mapping[str, Any]], require_params: bool = False) -> None:
        """Validate every group completely, then build their buffers (all or nothing)."""
        param_problems: list[str] = []
        hyper_problems: list[str] = []
        seen: dict[str, str] = {}  # new paths -> where; existing ones are in self.index
        staged = []
        all_arrays: list[tuple[str, np.ndarray]] = []
        for number, group in enumerate(groups, start=len(self.param_groups)):
            if not isinstance(group, Mapping):
                param_problems.append(f"param group {number} must be a dict, got "
                                      f"{type(group).__name__}")
                continue
            where = _hyper.describe_group(number, group)
            if "params" not in group:
                param_problems.append(f"{where}: has no 'params' entry")
                continue
            overrides = {k: v for k, v in group.items() if k != "params"}
            hyper_problems += _hyper.unknown_key_problems(overrides, self.hyperparameters, where)
            try:
                group_label = _hyper.label(overrides.get("label"))
            except _hyper.Invalid as exc:
                hyper_problems.append(f"{where}: label {exc}")
                group_label = None
            known = {k: v for k, v in overrides.items() if k in self.hyperparameters}
            values, problems = _hyper.check_values({**self.defaults, **known},
                                                   self.hyperparameters, where,
                                                   self._cross_check)
            hyper_problems += problems
            entries = []
            for path, array in _as_pairs(group["params"], where, param_problems):
                if not isinstance(path, str) or not path:
                    param_problems.append(f"{where}: parameter path {path!r} must be a "
                                          "non-empty string")
                    continue
                if path in seen or path in self.index:
                    also = seen.get(path, "an existing group")
                    param_problems.append(f"{where}: path {path!r} appears more than once "
                                          f"(also in {also}); every path must be unique")
                    continue
                seen[path] = where
                if isinstance(array, np.generic):
                    array = np.asarray(array)
                if not isinstance(array, np.ndarray):
                    param_problems.append(f"{where}: parameter {path!r} is a "
                                          f"{type(array).__name__}; give a numpy array")
                    continue
                if array.dtype not in SUPPORTED_DTYPES:
                    hint = (" (float16 is not supported yet)" if array.dtype == np.float16
                            else "")
                    param_problems.append(
                        f"{where}: parameter {path!r} has dtype {array.dtype}{hint}; flatopt "
                        "optimizes float32 and float64 arrays: cast with .astype(np.float32)")
                    continue
                for buf in self.buffers:
                    if np.shares_memory(array, buf.params):
                        param_problems.append(
                            f"{where}: parameter {path!r} is a view of this optimizer's own "
                            "buffer (it is already optimized under another path)")
                        break
                entries.append((path, array))
                all_arrays.append((path, array))
            staged.append((group, values, group_label, entries))
        param_problems += _tied_problems(all_arrays)
        if require_params and not all_arrays and not param_problems:
            param_problems.append("optimizer got an empty parameter list; give a dict "
                                  "{path: array} with at least one parameter")
        if param_problems:
            raise ParamError("\n".join(param_problems))
        _hyper.raise_problems(hyper_problems)

        infos: list[ParamInfo] = []
        next_id = len(self.index)
        for group, values, group_label, entries in staged:
            number = len(self.param_groups)
            paths = tuple(path for path, _ in entries)
            ids = {path: next_id + k for k, (path, _) in enumerate(entries)}
            next_id += len(entries)
            dtypes = list(dict.fromkeys(array.dtype for _, array in entries))
            for dtype in dtypes:
                members = [(path, array) for path, array in entries if array.dtype == dtype]
                buf = FlatBuffer(len(self.buffers), number, dtype,
                                 [ids[p] for p, _ in members], [p for p, _ in members],
                                 [a.shape for _, a in members])
                self._init_buffer(buf)
                for slot, (path, array) in enumerate(members):
                    buf.view(buf.params, slot)[...] = array
                    infos.append(ParamInfo(ids[path], path, array.shape, array.dtype, number,
                                           buf.number, slot, int(buf.offsets[slot]),
                                           int(buf.sizes[slot])))
                self.buffers.append(buf)
            entry = {"params": paths, **values}
            if group_label is not None:
                entry["label"] = group_label
            for key in ("initial_lr",):
                if key in group:
                    entry[key] = group[key]
            self.param_groups.append(entry)
            self._group_paths.append(paths)
            self._validated.append(((), {}))
        # Views are handed out in id order, as the user gave them; new ids come last.
        infos.sort(key=lambda info: info.id)
        self.index._extend(infos)
        for info in infos:
            buf = self.buffers[info.buffer]
            self._param_views[info.path] = buf.view(buf.params, info.slot)
            self._grad_views[info.path] = buf.view(buf.grads, info.slot)

    # ----------------------------------------------------------------- stepping
    def _group_settings(self) -> list[dict[str, Any]]:
        """Every group's hyperparameters, read and validated now (torch reads them each step)."""
        settings = []
        problems: list[str] = []
        for number, group in enumerate(self.param_groups):
            snapshot = _group_snapshot(group)
            cached_snapshot, cached_values = self._validated[number]
            if snapshot == cached_snapshot:
                settings.append(cached_values)
                continue
            where = _hyper.describe_group(number, group)
            if group.get("params") is not self._group_paths[number]:
                problems.append(f"{where}: 'params' cannot be changed after construction; "
                                "use add_param_group() to add parameters")
            problems += _hyper.unknown_key_problems(group, self.hyperparameters, where)
            missing = [key for key in self.hyperparameters if key not in group]
            if missing:
                problems.append(f"{where}: hyperparameters {missing} were removed from the group")
            values, value_problems = _hyper.check_values(group, self.hyperparameters, where,
                                                         self._cross_check)
            problems += value_problems
            settings.append(values)
            if not problems:
                self._validated[number] = (snapshot, values)
        _hyper.raise_problems(problems)
        return settings

    def step(self, grads: Mapping[str, np.ndarray | None] | None = None) -> None:
        """Take one optimization step.

        Without arguments, steps on the flat gradient buffer (``opt.grads``), updating exactly
        the parameters whose gradients are marked present. With ``grads`` (path -> array), the
        arrays are copied in first and define presence: an absent path, or ``None``, is a
        missing gradient. Nothing changes if any gradient or hyperparameter is invalid.
        """
        settings = self._group_settings()
        if grads is not None:
            self._stage_gradients(grads)
        for buf in self.buffers:  # a buffer with no gradient present returns at once
            self._step_buffer(buf, settings[buf.group])

    def _known(self, path: Any, what: str, problems: list[str]) -> ParamInfo | None:
        """The index record of ``path``, or None after adding a message naming it."""
        info = self.index.get(path) if isinstance(path, str) else None
        if info is None:
            problems.append(f"{what} unknown parameter {path!r}"
                            f"{_near(str(path), self.index.paths)}")
        return info

    def _stage_gradients(self, grads: Mapping[str, Any]) -> None:
        if not isinstance(grads, Mapping):
            raise GradientError(f"step(grads) takes a dict {{path: array}}, got "
                                f"{type(grads).__name__}")
        problems = []
        staged = []
        for path, value in grads.items():
            info = self._known(path, "gradient given for", problems)
            if info is None:
                continue
            if value is None:
                continue
            problem = _gradient_problem(info, value)
            if problem:
                problems.append(problem)
            else:
                staged.append((info, value))
        if problems:
            raise GradientError("\n".join(problems))
        for buf in self.buffers:
            buf.present[:] = 0
        for info, value in staged:
            self._grad_views[info.path][...] = value
            self.buffers[info.buffer].present[info.slot] = 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none=True`` marks every gradient missing (the buffer's contents are left as
        they are and ignored until marked present again); ``False`` zeroes the gradient buffer
        and leaves presence as it is, like torch, which zeroes existing gradients and leaves a
        missing (None) one missing: a present gradient then makes a real step with zeros."""
        for buf in self.buffers:
            if set_to_none:
                buf.present[:] = 0
            else:
                buf.grads.fill(0)

    # ----------------------------------------------------------------- state
    def state_of(self, path: str):
        """The live state of one parameter as a typed record of views, or None if it has none."""
        info = self.index.get(path)
        if info is None:
            raise KeyError(f"no parameter {path!r}{_near(path, self.index.paths)}")
        entry = self._param_state(self.buffers[info.buffer], info.slot, copy=False)
        return None if entry is None else self.state_record(**entry)

    def state_dict(self) -> dict[str, Any]:
        """A snapshot keyed by path: hyperparameters per group and per-parameter state (copies)."""
        state = {}
        for info in self.index:
            entry = self._param_state(self.buffers[info.buffer], info.slot, copy=True)
            if entry is not None:
                state[info.path] = entry
        groups = []
        for group in self.param_groups:
            saved = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
            saved["params"] = list(group["params"])
            groups.append(saved)
        return {"format": STATE_DICT_FORMAT, "version": STATE_DICT_VERSION,
                "optimizer": type(self).__name__, "param_groups": groups, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any], *,
                        hyperparameters: str = "saved") -> None:
        """Load a :meth:`state_dict` snapshot, matched by path, never by position.

        Every difference (kind, paths, shapes, dtypes, state slots, grouping) is collected into
        one :class:`StateDictError` before anything changes. ``hyperparameters="saved"``
        (torch's behaviour) takes each group's hyperparameters from the snapshot, which then
        needs the same grouping; ``"live"`` keeps the optimizer's own and loads state only.
        Data is copied: the snapshot and the optimizer never share memory.
        """
        if hyperparameters not in ("saved", "live"):
            raise ValueError("hyperparameters must be 'saved' or 'live', got "
                             f"{hyperparameters!r}")
        problems = []
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"state dict must be a dict, got {type(state_dict).__name__}")
        for key in ("format", "version", "optimizer", "param_groups", "state"):
            if key not in state_dict:
                problems.append(f"state dict has no {key!r} entry; was it made by "
                                "flatopt's state_dict()?")
        if problems:
            raise StateDictError("\n".join(problems))
        version = state_dict["version"]
        if (state_dict["format"] != STATE_DICT_FORMAT or not isinstance(version, int)
                or version > STATE_DICT_VERSION):
            raise StateDictError(
                f"state dict format {state_dict['format']!r} version {state_dict['version']} "
                f"is not {STATE_DICT_FORMAT!r} version <= {STATE_DICT_VERSION}; upgrade flatopt")
        if state_dict["optimizer"] != type(self).__name__:
            problems.append(f"state dict is from {state_dict['optimizer']}, this optimizer is "
                            f"{type(self).__name__}")
        saved_groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(state, Mapping):
            problems.append(f"state dict 'state' must be a dict {{path: {{...}}}}, got "
                            f"{type(state).__name__}")
            state = {}
        if not isinstance(saved_groups, (list, tuple)) or not all(
                isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple))
                and all(isinstance(path, str) for path in group["params"])
                for group in saved_groups):
            problems.append("state dict 'param_groups' must be a list of dicts, each with a "
                            "'params' list of paths")
            saved_groups = []

        new_settings: list[dict[str, Any] | None] = [None] * len(self.param_groups)
        if hyperparameters == "saved":
            saved_by_paths = {}
            for number, group in enumerate(saved_groups):
                saved_by_paths[frozenset(group.get("params", ()))] = (number, group)
            for number, paths in enumerate(self._group_paths):
                where = _hyper.describe_group(number, self.param_groups[number])
                match = saved_by_paths.get(frozenset(paths))
                if match is None:
                    problems.append(f"{where}: no saved group holds exactly its parameters; the "
                                    "grouping changed, load with hyperparameters='live' to keep "
                                    "this optimizer's hyperparameters and load state by path")
                    continue
                saved_where = f"saved {_hyper.describe_group(match[0], match[1])}"
                problems += _hyper.unknown_key_problems(match[1], self.hyperparameters,
                                                        saved_where)
                values, value_problems = _hyper.check_values(
                    {**self.param_groups[number], **match[1]}, self.hyperparameters,
                    saved_where, self._cross_check)
                problems += value_problems
                new_settings[number] = {**values, **{key: match[1][key] for key in
                                                     ("label", "initial_lr") if key in match[1]}}

        for path, entry in state.items():
            info = self._known(path, "state given for", problems)
            if info is None:
                continue
            settings = new_settings[info.group] or self.param_groups[info.group]
            problems += self._state_problems(info, entry, settings)
        if problems:
            raise StateDictError("\n".join(problems))

        for number, values in enumerate(new_settings):
            if values is not None:
                self.param_groups[number].update(values)
        for buf in self.buffers:
            self._clear_param_state(buf)
        for path, entry in state.items():
            info = self.index[path]
            self._set_param_state(self.buffers[info.buffer], info.slot, entry)

    def _state_problems(self, info: ParamInfo, entry: Any, settings: Mapping) -> list[str]:
        """Problems with one parameter's saved state: slot names, shapes, dtypes."""
        if not isinstance(entry, Mapping):
            return [f"state for {info.path!r} must be a dict, got {type(entry).__name__}"]
        expected = self._state_slots(settings)
        problems = []
        for key in entry:
            if key not in expected:
                problems.append(f"state for {info.path!r} has unexpected entry {key!r} "
                                f"(a {type(self).__name__} expects {sorted(expected)})")
        for key, kind in expected.items():
            value = entry.get(key)
            if value is None:
                if kind == "required":
                    problems.append(f"state for {info.path!r} lacks {key!r}")
                continue
            if key == "step":
                if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                        or not 0 <= value <= _MAX_STEP):
                    problems.append(f"state for {info.path!r}: step must be an integer in "
                                    f"[0, {_MAX_STEP}], got {value!r}")
                continue
            if not isinstance(value, np.ndarray):
                problems.append(f"state for {info.path!r}: {key} is a {type(value).__name__}, "
                                "not a numpy array")
            elif value.shape != info.shape or value.dtype != info.dtype:
                problems.append(f"state for {info.path!r}: {key} has shape {value.shape} and "
                                f"dtype {value.dtype}, the parameter has shape {info.shape} "
                                f"and dtype {info.dtype}")
        return problems

    # ----------------------------------------------------------------- hooks
    @staticmethod
    def _cross_check(values: dict[str, Any]) -> list[str]:
        return []

    def _init_buffer(self, buf: FlatBuffer) -> None:
        raise NotImplementedError

    def _kernel_scalars(self, buf: FlatBuffer, settings: dict[str, Any]) -> np.ndarray:
        """The group's scalars for the kernel, in the buffer's dtype. Rebuilt only when the
        group's settings change: an unchanged group yields the same validated dict object."""
        cached = self._scalar_cache.get(buf.number)
        if cached is None or cached[0] is not settings:
            scalars = np.array(self._scalars(settings, buf.dtype), dtype=buf.dtype)
            cached = self._scalar_cache[buf.number] = (settings, scalars)
        return cached[1]

    def _scalars(self, settings: dict[str, Any], dtype: np.dtype) -> list[float]:
        """The kernel's ``hyper`` argument, as float64 values (rounded once to the dtype)."""
        raise NotImplementedError

    def _step_buffer(self, buf: FlatBuffer, settings: dict[str, Any]) -> None:
        """Step the parameters of ``buf`` marked present; called for every buffer at every
        step, so it must return without any change (or allocation) when none is present."""
        raise NotImplementedError

    def _state_slots(self, settings: Mapping) -> dict[str, str]:
        """Names of per-parameter state entries -> "required" or "optional"."""
        raise NotImplementedError

    def _param_state(self, buf: FlatBuffer, slot: int, copy: bool) -> dict | None:
        raise NotImplementedError

    def _set_param_state(self, buf: FlatBuffer, slot: int, entry: Mapping) -> None:
        raise NotImplementedError

    def _clear_param_state(self, buf: FlatBuffer) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ({len(self.index)} parameters, "
                 f"{len(self.buffers)} buffers)"]
        for number, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {number}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines)
