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
from ._storage import ROUNDINGS, bfloat16, dtype_name
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
STORAGE_VALUES = {"param": _lossless.FLOAT_NAMES, "grad": _lossless.FLOAT_NAMES,
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
        settings.append(None if more else values)  # invalid values check no state
    return settings



# torch's implementation switches in its param_groups: chosen per run, not state
TORCH_IMPLEMENTATION_KEYS = ("foreach", "fused")
TORCH_REFUSED_KEYS = ("capturable", "differentiable")
TORCH_KEYS = ("state", "param_groups")
FLOAT_DTYPES = _lossless.FLOAT_NAMES


def from_torch(opt, torch_state_dict: Any, names: Any, convert: bool = False) -> dict[str, Any]:
    """A flatopt state dict (see :func:`build`) from a ``torch.optim`` optimizer's
    ``state_dict()``: torch's parameter indices become ``names[index]``, its 0-d tensors the
    schema's columns (``step`` an int), its tensors NumPy arrays (bfloat16 ones as
    ``ml_dtypes.bfloat16``). With ``convert`` (True), float state of another dtype than the
    live buffer computes in is cast to it (then ``load_state_dict(convert=True)`` encodes it
    in a reduced-precision buffer's format); without, such state and any state for a
    reduced-precision buffer is a problem that names ``convert=True``. Raises StateDictError
    naming every problem (every level of the dict is checked for its type here, the values
    against ``opt`` by ``parse``)."""
    if not isinstance(convert, (bool, np.bool_)):
        raise StateDictError(f"convert must be True or False, got {_short(convert)}")
    if not isinstance(torch_state_dict, Mapping) or not set(TORCH_KEYS) <= set(
            torch_state_dict):
        raise StateDictError("a torch optimizer's state_dict() is a dict with 'state' and "
                             f"'param_groups', got {_describe(torch_state_dict)}")
    problems: list[str] = []
    extra = [key for key in torch_state_dict if key not in TORCH_KEYS]
    if extra:
        problems.append(f"torch state dict has keys {_short(extra)} besides 'state' and "
                        "'param_groups', which torch's state_dict() does not write (a flatopt "
                        "state dict loads with load_state_dict())")
    path_of = _torch_names(opt, names, problems)
    groups = _torch_groups(opt, torch_state_dict["param_groups"], path_of, problems)
    state = _torch_state(opt, torch_state_dict["state"], path_of, convert, problems)
    raise_problems(problems, StateDictError)
    return {"format": STATE_DICT_FORMAT, "version": 1,  # float values: no storage list
            "optimizer": opt.schema.name, "param_groups": groups, "state": state}


def _torch_names(opt, names: Any, problems: list[str]) -> dict[int, str]:
    """``names`` as {torch index: path}, each a distinct parameter of ``opt``."""
    if isinstance(names, Mapping):
        items = list(names.items())
    elif isinstance(names, (list, tuple)):
        items = list(enumerate(names))
    else:
        raise StateDictError("names must be a list of paths (torch's parameter i is "
                             f"names[i]) or a dict {{index: path}}, got {_describe(names)}")
    path_of: dict[int, str] = {}
    first: dict[str, int] = {}
    for index, path in items:
        if not _is_index(index):
            problems.append(f"names: key {_short(index)} is not a parameter index (an int >= 0)")
        elif not isinstance(path, str) or path not in opt.index:
            problems.append(f"names[{index}] = {_short(path)} is not a parameter of this "
                            "optimizer")
        elif path in first:
            problems.append(f"names[{index}] = {path!r} is names[{first[path]}] too: each "
                            "parameter has one torch index")
        else:
            first[path] = int(index)
            path_of[int(index)] = path
    return path_of


def _torch_groups(opt, raw: Any, path_of: dict[int, str], problems: list[str]) -> list[dict]:
    """torch's param groups with paths for indices and its own switches dropped."""
    if not isinstance(raw, (list, tuple)):
        problems.append(f"torch 'param_groups' must be a list of dicts, got {_describe(raw)}")
        return []
    groups = []
    seen: dict[int, int] = {}
    for number, group in enumerate(raw):
        where = f"torch param group {number}"
        if not isinstance(group, Mapping) or "params" not in group:
            problems.append(f"{where} must be a dict with a 'params' list, got "
                            f"{_describe(group)}")
            continue
        converted = {}
        for key, value in group.items():
            if not isinstance(key, str):
                problems.append(f"{where}: key {_short(key)} is not a name")
            elif key == "params":
                converted["params"] = _torch_params(value, where, number, path_of, seen,
                                                    problems)
            elif key in TORCH_IMPLEMENTATION_KEYS:
                continue
            elif key not in opt.schema.hyperparameters and _fixed(opt, key, value):
                continue  # fixed by the class (torch's AdamW: decoupled_weight_decay=True)
            elif key in TORCH_REFUSED_KEYS and not _unset(value):
                problems.append(f"{where}: {key}={_short(value)} has no meaning in flatopt")
            elif key in opt.schema.hyperparameters or key in ("initial_lr", "label") \
                    or not _unset(value):
                converted[key] = value  # an unknown key set to a value is refused by parse
        groups.append(converted)
    return groups


def _torch_params(value: Any, where: str, number: int, path_of: dict[int, str],
                  seen: dict[int, int], problems: list[str]) -> list[str]:
    if not isinstance(value, (list, tuple)):
        problems.append(f"{where}: 'params' must be a list of parameter indices, got "
                        f"{_describe(value)}")
        return []
    indices = []
    for index in value:
        if not _is_index(index):
            problems.append(f"{where}: {_short(index)} in 'params' is not a parameter index "
                            "(an int >= 0)")
        elif int(index) in seen:
            problems.append(f"{where}: parameter index {index} is listed twice (also in "
                            f"torch param group {seen[int(index)]})")
        else:
            seen[int(index)] = number
            indices.append(int(index))
    missing = [i for i in indices if i not in path_of]
    if missing:
        problems.append(f"{where}: parameter indices {_short(missing)} have no name in names")
    return [path_of[i] for i in indices if i in path_of]


def _torch_state(opt, raw: Any, path_of: dict[int, str], convert: bool,
                 problems: list[str]) -> dict[str, dict]:
    """torch's per-parameter state by path, each value read as flatopt keeps it."""
    if not isinstance(raw, Mapping):
        problems.append(f"torch 'state' must be a dict {{index: {{name: tensor}}}}, got "
                        f"{_describe(raw)}")
        return {}
    state = {}
    for index, entry in raw.items():
        path = path_of.get(int(index)) if _is_index(index) else None
        if path is None:
            problems.append(f"torch state of parameter {_short(index)} has no name in names")
            continue
        where = f"torch state of parameter {index} ({path!r})"
        if not isinstance(entry, Mapping):
            problems.append(f"{where} must be a dict {{name: tensor}}, got {_describe(entry)}")
            continue
        buf = opt.buffers[opt.index[path].buffer]
        converted = {}
        for name, value in entry.items():
            if not isinstance(name, str):
                problems.append(f"{where}: key {_short(name)} is not a name")
                continue
            try:
                converted[name] = _from_tensor(opt.schema, name, value)
            except Exception as exc:  # noqa: BLE001 (anything a foreign object raises)
                problems.append(f"{where}: {name} cannot be read as an array or number "
                                f"({type(exc).__name__}: {str(exc)[:100]})")
                continue
            problem = _dtype_problem(buf, name in opt.schema.slots, converted[name], convert)
            if problem == "cast":
                problem, converted[name] = _cast(converted[name], buf.dtype)
            if problem:
                problems.append(f"{where}: {name} {problem}")
        if buf.coded and converted and not convert:
            problems.append(f"{where}: this optimizer stores it as "
                            f"{_lossless.fmt(_lossless.describe(buf))}; pass convert=True to "
                            "load_torch_state_dict() to convert torch's values into that "
                            "(through float32)")
        state[path] = converted
    return state


def _dtype_problem(buf, is_slot: bool, value: Any, convert: bool) -> str | None:
    """"cast" when a float state array is to be cast to ``buf``'s compute dtype (``convert``),
    a problem naming convert=True when it would need to be, else None (the other checks are
    ``parse``'s)."""
    if not is_slot or not isinstance(value, np.ndarray) or value.dtype.name not in FLOAT_DTYPES \
            or value.dtype == buf.dtype:
        return None
    if convert:
        return "cast"
    if buf.coded:
        return None  # the entry's own problem names convert=True
    return (f"is {dtype_name(value.dtype)}, this optimizer keeps "
            f"{buf.dtype.name} state; pass convert=True to load_torch_state_dict() to "
            "convert it")


def _cast(value: np.ndarray, dtype: np.dtype) -> tuple[str | None, np.ndarray]:
    """(problem or None, ``value`` as ``dtype``): finite values beyond its range are one."""
    with np.errstate(over="ignore"):
        cast = value.astype(dtype)
    if np.count_nonzero(np.isfinite(cast)) != np.count_nonzero(np.isfinite(value)):
        return f"holds values beyond {dtype.name}'s range", cast
    return None, cast


def _from_tensor(schema, name: str, value: Any) -> Any:
    """A torch state value as flatopt keeps it: a column's 0-d tensor as a Python number
    (``step``, a float tensor in torch, as an int), anything else as a NumPy array (None, as
    torch < 2.3 kept SGD's unused momentum buffer, as None)."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        # NumPy has no bfloat16: through float32, exactly, to ml_dtypes' bfloat16
        value = value.float().numpy().astype(bfloat16()) \
            if str(value.dtype) == "torch.bfloat16" else value.numpy()
    if name in schema.columns and np.ndim(value) == 0:
        number = np.asarray(value).item()
        if isinstance(number, (bool, np.bool_)) or not isinstance(number, numbers.Real):
            return number  # refused by the schema's checks, by name
        if isinstance(number, numbers.Integral):
            return int(number)
        is_int = np.dtype(schema.columns[name].dtype).kind in "iu"
        return int(number) if is_int and float(number).is_integer() else number
    return np.array(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) \
        and value >= 0


def _fixed(opt, key: str, value: Any) -> bool:
    """Whether ``value`` is what the class fixes ``key`` to (a plain value, compared as one)."""
    fixed = getattr(type(opt), key, None)
    return type(fixed) in (bool, int, float, str) and type(value) is type(fixed) \
        and value == fixed


def _unset(value: Any) -> bool:
    """Whether a torch group value leaves its switch off (None, False, zero, empty): such a
    key flatopt does not know is dropped, one set to anything else refused."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return not value
    if isinstance(value, numbers.Number):
        return value == 0
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) == 0
    return False


def _short(value: Any) -> str:
    return repr(value)[:80]


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:200]
