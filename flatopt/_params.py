"""Turning the constructor's ``params`` into checked groups of (path, array) pairs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import numpy as np

from ._layout import SUPPORTED_DTYPES
from ._storage import is_half
from .errors import HyperparameterError, ParamError
from .schema import Invalid, text

try:  # numpy >= 2
    _byte_bounds = np.lib.array_utils.byte_bounds
except AttributeError:  # numpy 1.x
    _byte_bounds = np.byte_bounds


def split_groups(params: Any, problems: list[str]) -> list:
    """The constructor's ``params`` as a list of group dicts (each with a ``params`` entry)."""
    if isinstance(params, Mapping):
        if "params" in params and not isinstance(params["params"], np.ndarray):
            problems.append("params looks like one group dict; pass a list of groups "
                            "[{'params': {...}, ...}] or a plain dict {path: array}")
            return []
        return [{"params": params}]
    if isinstance(params, (set, frozenset, np.ndarray)) or not isinstance(params, Iterable):
        return [{"params": params}]  # as_pairs words the error
    items = list(params)
    if items and all(isinstance(item, Mapping) for item in items):
        return items
    return [{"params": items}]


def as_pairs(params: Any, where: str, problems: list[str]) -> list[tuple[Any, Any]]:
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


def path_problem(path: Any) -> str | None:
    """Why ``path`` cannot name a parameter, or None."""
    if isinstance(path, str) and not path:
        return "parameter path '' must be a non-empty string"
    try:
        text(path, "parameter path")
    except Invalid as exc:
        return str(exc)
    return None


def array_problem(path: str, array: Any) -> str | None:
    """Why ``array`` cannot be optimized, or None."""
    if not isinstance(array, np.ndarray):
        return f"parameter {path!r} is a {type(array).__name__}; give a numpy array"
    if isinstance(array, np.ma.MaskedArray):
        return f"parameter {path!r} is a masked array; give a plain numpy array"
    if array.dtype not in SUPPORTED_DTYPES and not is_half(array.dtype):
        return (f"parameter {path!r} has dtype {array.dtype}; flatopt optimizes float32, "
                "float64, float16 and bfloat16 (ml_dtypes.bfloat16) arrays: cast with "
                ".astype(np.float32)")
    return None


def tied_problems(arrays: list[tuple[str, np.ndarray]]) -> list[str]:
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


def torch_implementation_arguments(name: str, arguments: dict) -> None:
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


FLOAT32_MAX = float(np.finfo(np.float32).max)


def constant_columns(columns: Mapping[str, Callable[[str, tuple], Any]],
                     arrays: list[tuple[str, np.ndarray]]) -> dict[str, dict[str, float]]:
    """``Optimizer.path_columns`` evaluated for every new parameter, before anything is
    built: name -> path -> value. A function that raises, or gives no finite number, is a
    :class:`ParamError` naming the path (nothing has changed yet)."""
    table: dict[str, dict[str, float]] = {}
    problems = []
    for name, function in columns.items():
        table[name] = {}
        for path, array in arrays:
            try:
                value = float(function(path, tuple(array.shape)))
                if not abs(value) <= FLOAT32_MAX:  # NaN too; float32 columns hold it
                    raise ValueError(f"gave {value}, not a number within float32's range")
            except Exception as exc:  # a user's function: report it, typed
                problems.append(f"{path!r}: its {name!r} value: {type(exc).__name__}: {exc}")
                continue
            table[name][path] = value
    if problems:
        raise ParamError("cannot add these parameters: " + "; ".join(problems[:20]))
    return table


def check_entries(schema, group: Mapping, where: str, seen: dict[str, str], index,
                  buffers: list, problems: list[str]) -> list[tuple[str, np.ndarray]]:
    """The (path, array) entries of a new group that can be optimized: a problem for each
    other one (a bad path or array, one seen before, in ``index`` or a view of one of
    the ``buffers``) added to ``problems``."""
    entries = []
    for path, array in as_pairs(group["params"], where, problems):
        problem = path_problem(path)
        if problem is None and (path in seen or path in index):
            problem = (f"path {path!r} appears more than once (also in "
                       f"{seen.get(path, 'an existing group')}); every path must be unique")
        if problem is None:
            seen[path] = where
            array = np.asarray(array) if isinstance(array, np.generic) else array
            problem = array_problem(path, array)
        if problem is None and schema.param_problem is not None:
            reason = schema.param_problem(array.shape)
            problem = f"parameter {path!r} {reason}" if reason else None
        if problem is None and any(np.shares_memory(array, buf.params)
                                   for buf in buffers):
            problem = (f"parameter {path!r} is a view of this optimizer's own buffer (it "
                       "is already optimized under another path)")
        if problem is None:
            entries.append((path, array))
        else:
            problems.append(f"{where}: {problem}")
    return entries
