"""The in-memory state dict (``Optimizer.state_dict`` / ``load_state_dict``): its format, and
the parsing of one into the per-path state and group settings that ``Optimizer.restore``
validates and applies, the path a checkpoint load takes too."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _codec, _lossless, _restore
from ._storage import ROUNDINGS
from .errors import StateDictError, raise_problems
from .schema import MAX_STEP, describe_group

STATE_DICT_FORMAT = "flatopt.state_dict"
STATE_DICT_VERSION = 2
"""The newest version this flatopt reads; it writes 2 only for an optimizer with
reduced-precision buffers (its ``"storage"`` list and lossless entries), 1 otherwise."""


def build(opt, state: dict) -> dict[str, Any]:
    """The snapshot: format, version, optimizer name, groups (hyperparameters deep-copied,
    params as paths) and ``state`` (path -> entry)."""
    groups = []
    for group in opt.param_groups:
        saved = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        saved["params"] = list(group["params"])
        groups.append(saved)
    out = {"format": STATE_DICT_FORMAT, "version": 1,
           "optimizer": opt.schema.name, "param_groups": groups, "state": state}
    coded = [buf for buf in opt.buffers if buf.coded]
    if coded:
        out["version"] = 2
        out["storage"] = [{"paths": list(buf.paths), **_lossless.describe(buf),
                           "draws": int(buf.draws)} for buf in coded]
    return out


def saved_entry(opt, buf, slot: int) -> dict | None:
    """``state_dict()``'s entry of parameter ``slot`` of ``buf``: lossless for a coded buffer
    (its stored arrays, see ``flatopt._lossless``; a parameter without state keeps an entry
    of its master weights or compensation where the buffer has them), else
    :func:`param_state`'s copies."""
    if not buf.coded:
        return param_state(opt, buf, slot, copy=True)
    if not opt.schema.stateful({name: column[slot] for name, column in buf.columns.items()
                                if name in opt.schema.columns}):
        return _lossless.extras_entry(buf, slot) or None
    return _lossless.path_entry(opt, buf, slot)


STORAGE_FIELDS = {"paths": list, "param": str, "grad": str, "state": str, "master": bool,
                  "rounding": str, "seed": int, "draws": int}
STORAGE_VALUES = {"param": tuple(_lossless.NUMPY_DTYPES), "grad": tuple(_lossless.NUMPY_DTYPES),
                  "state": ("float32", "float64", "bfloat16", "int8"),
                  "rounding": ROUNDINGS, "master": (True, False)}
STORAGE_RANGES = {"seed": (0, (1 << 63) - 1), "draws": (0, MAX_STEP)}
"""The integers a storage holds, bounded as the optimizer bounds them: the seed as
``Storage`` checks it; ``draws`` counts steps, bounded as step counts are (a step refuses to
go past it, see ``_stepping.check_counters``)."""


def _storage_problem(item: Any) -> str | None:
    """Why ``item`` is not one buffer storage of a ``"storage"`` list, or None."""
    if not isinstance(item, Mapping) or set(item) != set(STORAGE_FIELDS):
        return f"must be a dict with exactly {sorted(STORAGE_FIELDS)}"
    for key, kind in STORAGE_FIELDS.items():
        value = item[key]
        if kind is int:
            low, high = STORAGE_RANGES[key]
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, numbers.Integral) or not low <= value <= high:
                return f"{key} must be an integer in [{low}, {high}], got {value!r}"[:300]
        elif kind is list:
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(path, str) for path in value):
                return f"{key} must be a list of parameter paths"
        elif not isinstance(value, kind) or value not in STORAGE_VALUES[key]:
            return f"{key} must be one of {list(STORAGE_VALUES[key])}, got {value!r}"[:300]
    return None


def saved_storage(state_dict: Mapping, problems: list[str]) -> dict[str, tuple[dict, int]]:
    """A version-2 state dict's ``"storage"`` list: path -> (storage, draws), checked; the
    paths of a refused entry map to None (its problem is reported, theirs would repeat it)."""
    out: dict[str, tuple[dict, int] | None] = {}
    if "storage" not in state_dict:  # state_dict() writes version 2 only with it
        problems.append("state dict version 2 has no 'storage' list; was it made by "
                        "flatopt's state_dict()?")
        return out
    raw = state_dict["storage"]
    if not isinstance(raw, (list, tuple)):
        problems.append("state dict 'storage' must be a list of buffer storages")
        return out
    for number, item in enumerate(raw):
        problem = _storage_problem(item)
        if problem is None:
            twice = [path for path in item["paths"] if out.get(path) is not None]
            if twice:
                problem = f"names {twice[0]!r}, which an earlier entry names too"
        if problem:
            problems.append(f"state dict 'storage' entry {number} is not a buffer storage "
                            f"as state_dict() writes them: {problem}")
            paths = item.get("paths") if isinstance(item, Mapping) else None
            out.update({path: None for path in paths if isinstance(path, str)}
                       if isinstance(paths, (list, tuple)) else {})
            continue
        desc = {key: item[key] for key in STORAGE_FIELDS if key not in ("paths", "draws")}
        desc["seed"] = int(desc["seed"])
        for path in item["paths"]:
            out[path] = (desc, int(item["draws"]))
    return out


def param_state(opt, buf, slot: int, copy: bool) -> dict | None:
    """Parameter ``slot`` of ``buf``'s state-dict entry (its persisted columns and state
    slots, views or copies), or None when it has no state."""
    if opt.sharding is not None:
        opt.sharding.refuse("state_dict() / state_of()")
    if not opt.schema.stateful({name: column[slot] for name, column in buf.columns.items()
                                 if name in opt.schema.columns}):
        return None
    # .item(): a Python int for an integer column, a float for a float one (NAdam's
    # mu_product), as the schema's checks of an entry expect
    entry: dict[str, Any] = {name: buf.columns[name][slot].item()
                             for name in opt.schema.state_dict_columns}
    for name in opt.schema.slots:
        if name in buf.state and buf.coded and buf.storage.state != buf.dtype.name:
            entry[name] = _codec.read_slot(buf, opt.schema, name, slot)  # float32 values
            continue
        view = buf.state_view(name, slot) if name in buf.state else None
        if view is not None:
            entry[name] = view.copy() if copy else view
    return entry


def parse(opt, state_dict: Any, hyperparameters: str, convert: bool = False):
    """``(state, settings, params, staged)`` for ``opt.restore`` from a snapshot: its
    structure, format, version and optimizer checked, and with ``hyperparameters="saved"``
    each live group's values taken from the saved group with exactly its parameters
    (``settings`` None with ``"live"``); ``params``: the values of plain buffers' parameters
    converted from master weights or compensation (``convert``); ``staged``: the coded
    buffers' new contents (``_lossless.stage``), whose storage must be the saved one unless
    ``convert``. Every problem, including restore's own, in one StateDictError."""
    if hyperparameters not in ("saved", "live"):
        raise ValueError("hyperparameters must be 'saved' or 'live', got "
                         f"{hyperparameters!r}")
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"state dict must be a dict, got {type(state_dict).__name__}")
    problems = [f"state dict has no {key!r} entry; was it made by flatopt's state_dict()?"
                for key in ("format", "version", "optimizer", "param_groups", "state")
                if key not in state_dict]
    raise_problems(problems, StateDictError)
    version = state_dict["version"]
    if (state_dict["format"] != STATE_DICT_FORMAT or type(version) is not int
            or not 1 <= version <= STATE_DICT_VERSION):
        raise StateDictError(
            f"state dict format {state_dict['format']!r} version {version!r} is not "
            f"{STATE_DICT_FORMAT!r} version 1..{STATE_DICT_VERSION}; a newer version needs "
            "a newer flatopt")
    if state_dict["optimizer"] != opt.schema.name:
        problems.append(f"state dict is from {state_dict['optimizer']}, this optimizer is "
                        f"{opt.schema.name}")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(state, Mapping):
        problems.append(f"state dict 'state' must be a dict {{path: {{...}}}}, got "
                        f"{type(state).__name__}")
        state = {}
    settings = None
    if hyperparameters == "saved":
        settings = _saved_settings(opt, saved_groups, problems)
    elif opt.schema.group_state:  # "live": the optimizer's per-group state is still loaded
        settings = _saved_settings(opt, saved_groups, problems, only=opt.schema.group_state)
    storage = saved_storage(state_dict, problems) if version >= 2 else {}
    saved = {}
    refused = {path for path, item in storage.items() if item is None}
    storage = {path: item for path, item in storage.items() if item is not None}
    for path, entry in state.items():
        if path in refused:
            continue
        desc, draws = storage.get(path, (None, None))
        info = opt.index.get(path) if isinstance(path, str) else None
        if desc is None and info is not None:
            desc = _lossless.plain(opt.buffers[info.buffer].dtype.name)
        extras = None
        if draws is not None:  # a coded buffer's: master weights and compensation apart
            entry, extras = _lossless.split(opt.schema, entry)
        saved[path] = _lossless.Saved(desc, entry, None, draws, extras)
    for path, (desc, draws) in storage.items():  # a coded buffer's parameters without state
        if path not in saved:
            saved[path] = _lossless.Saved(desc, None, None, draws)
    staged, state, params = _lossless.stage(opt, saved, settings, convert, problems)
    problems += _restore.restore_problems(opt, {**state, **{
        path: None for path in saved if path not in opt.index}}, settings, params, None)
    raise_problems(problems, StateDictError)
    return state, settings, params, staged


def _saved_settings(opt, saved_groups: Any, problems: list[str],
                    only: tuple[str, ...] | None = None) -> list[dict | None]:
    """Each live group's values from the saved group holding exactly its parameters (with
    ``only``, those keys of it and the live group's other values)."""
    if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple))
            and all(isinstance(path, str) for path in group["params"])
            for group in saved_groups):
        problems.append("state dict 'param_groups' must be a list of dicts, each with a "
                        "'params' list of paths")
        return [None] * len(opt.param_groups)
    by_paths = {frozenset(group["params"]): (number, group)
                for number, group in enumerate(saved_groups)}
    settings: list[dict | None] = []
    for number, paths in enumerate(opt.group_paths):
        match = by_paths.get(frozenset(paths))
        if match is None:
            where = describe_group(number, opt.param_groups[number])
            if only is None:
                problems.append(f"{where}: no saved group holds exactly its parameters; the "
                                "grouping changed, load with hyperparameters='live' to keep "
                                "this optimizer's hyperparameters and load state by path")
            else:
                problems.append(f"{where}: no saved group holds exactly its parameters, so "
                                f"its per-group state ({', '.join(only)}) cannot be loaded")
            settings.append(None)
            continue
        saved = match[1] if only is None else {key: match[1][key] for key in only
                                               if key in match[1]}
        merged = {**opt.param_groups[number], **saved}
        values, more = opt.schema.check_group(
            merged, f"saved {describe_group(match[0], match[1])}")
        problems += more
        settings.append(values)
    return settings



# torch's implementation switches in its param_groups: chosen per run, not state
TORCH_IMPLEMENTATION_KEYS = ("foreach", "fused")
TORCH_REFUSED_KEYS = ("capturable", "differentiable")


def from_torch(opt, torch_state_dict: Any, names: Any) -> dict[str, Any]:
    """A flatopt state dict (see :func:`build`) from a ``torch.optim`` optimizer's
    ``state_dict()``: torch's parameter indices become ``names[index]``, its 0-d tensors the
    schema's columns (``step`` an int), its tensors NumPy arrays. Raises StateDictError naming
    every problem; nothing is checked against ``opt`` here but the names (``parse`` does)."""
    problems: list[str] = []
    if not isinstance(torch_state_dict, Mapping) or not {"state", "param_groups"} <= set(
            torch_state_dict):
        raise StateDictError("a torch optimizer's state_dict() is a dict with 'state' and "
                             f"'param_groups', got {_describe(torch_state_dict)}")
    if isinstance(names, Mapping):
        path_of = dict(names)
    elif isinstance(names, (list, tuple)):
        path_of = dict(enumerate(names))
    else:
        raise StateDictError("names must be a list of paths (torch's parameter i is "
                             f"names[i]) or a dict {{index: path}}, got {_describe(names)}")
    for index, path in path_of.items():
        if path not in opt.index:
            problems.append(f"names[{index}] = {path!r} is not a parameter of this optimizer")
    groups = []
    for number, group in enumerate(torch_state_dict["param_groups"]):
        converted = {}
        for key, value in group.items():
            if key == "params":
                missing = [i for i in value if i not in path_of]
                if missing:
                    problems.append(f"torch param group {number}: parameter indices {missing} "
                                    "have no name in names")
                converted["params"] = [path_of.get(i) for i in value]
            elif key in TORCH_IMPLEMENTATION_KEYS:
                continue
            elif key not in opt.schema.hyperparameters and getattr(opt, key, None) == value:
                continue  # fixed by the class (torch's AdamW: decoupled_weight_decay=True)
            elif key in TORCH_REFUSED_KEYS and value:
                problems.append(f"torch param group {number}: {key}=True has no meaning in "
                                "flatopt")
            elif key in opt.schema.hyperparameters or key in ("initial_lr", "label") \
                    or value:
                converted[key] = value  # an unknown key set to a value is refused by parse
        groups.append(converted)
    state = {}
    for index, entry in torch_state_dict["state"].items():
        path = path_of.get(index)
        if path is None:
            problems.append(f"torch state of parameter {index} has no name in names")
            continue
        state[path] = {name: _from_tensor(opt.schema, name, value)
                       for name, value in entry.items()}
    raise_problems(problems, StateDictError)
    return {"format": STATE_DICT_FORMAT, "version": 1,  # float32 values: no storage list
            "optimizer": opt.schema.name, "param_groups": groups, "state": state}


def _from_tensor(schema, name: str, value: Any) -> Any:
    """A torch state value as flatopt keeps it: a column's 0-d tensor as a Python number
    (``step``, a float tensor in torch, as an int), anything else as a NumPy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if name in schema.columns and np.ndim(value) == 0:
        number = np.asarray(value).item()
        is_int = np.dtype(schema.columns[name].dtype).kind in "iu"
        return int(number) if is_int and float(number).is_integer() else number
    return np.array(value)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:200]
