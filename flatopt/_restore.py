"""Replacing an optimizer's state: the validation and the copy behind
:meth:`Optimizer.restore`, which ``load_state_dict`` and checkpoint ``load`` both go through.
Everything is checked before the first change; memory is allocated before it too."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._views import gradient_problem
from .schema import array_problem, column_problems, slot_value_problems


@dataclass
class BufferState:
    """Whole-buffer contents for :meth:`Optimizer.restore` when a saved buffer has exactly
    the live buffer's layout: ``params`` and each ``state`` slot flat (the buffer's length),
    ``columns`` one value per parameter for each persisted column of the schema."""

    params: np.ndarray
    state: dict[str, np.ndarray] = field(default_factory=dict)
    columns: dict[str, np.ndarray] = field(default_factory=dict)


def restore_problems(opt, state, settings, params, buffers) -> list[str]:
    """Every reason ``opt.restore`` would refuse these values (empty: it will not)."""
    problems: list[str] = []
    live = opt.settings()
    if settings is not None and len(settings) != len(live):
        problems.append(f"{len(settings)} group settings for {len(live)} groups")
        settings = None
    effective = [new if new is not None else old
                 for new, old in zip(settings or [None] * len(live), live)]
    for path, entry in state.items():
        info = opt._known(path, "state given for", problems)
        if info is not None and not _all_none(entry):
            problems += opt.schema.state_problems(info.path, entry, info.shape, info.dtype,
                                                   effective[info.group])
    for path, value in (params or {}).items():
        info = opt._known(path, "values given for", problems)
        if info is not None:
            problem = gradient_problem(info, value)
            if problem:
                problems.append(problem.replace("gradient", "parameter value", 1))
    for number, contents in (buffers or {}).items():
        problems += _buffer_problems(opt, number, contents)
    return problems


def _buffer_problems(opt, number: int, contents: BufferState) -> list[str]:
    if not 0 <= number < len(opt.buffers):
        return [f"no buffer {number}"]
    buf = opt.buffers[number]
    where = f"buffer {number} (group {buf.group}, {buf.dtype})"
    problems = []
    for name, flat in (("params", contents.params), *contents.state.items()):
        if name != "params" and name not in opt.schema.slots:
            problems.append(f"{where}: unknown state slot {name!r}")
            continue
        problem = array_problem(flat, (buf.length,), buf.dtype)
        if problem:
            problems.append(f"{where}: {name} {problem}")
    problems += column_problems(opt.schema, contents.columns, len(buf), where)
    if problems:
        return problems
    stateful = opt.schema.stateful(contents.columns)
    for name, flat in contents.state.items():
        problems += [f"{where}: {problem}" for problem in slot_value_problems(
            opt.schema, name, flat, buf.offsets, buf.sizes, stateful, buf.paths)]
    return problems


def apply(opt, state, settings, params, buffers) -> None:
    """Copy validated values in. Memory is allocated (and sources that alias this
    optimizer's own buffers copied) before the first change."""
    owned = [flat for buf in opt.buffers for flat in (buf.params, *buf.state.values())]

    def detached(value):
        return value.copy() if any(np.may_share_memory(value, flat)
                                   for flat in owned) else value
    state = {path: {key: detached(value) if isinstance(value, np.ndarray) else value
                    for key, value in entry.items()}
             for path, entry in state.items() if not _all_none(entry)}
    params = {path: detached(value) for path, value in (params or {}).items()}
    buffers = {number: BufferState(detached(c.params),
                                   {k: detached(v) for k, v in c.state.items()},
                                   dict(c.columns))
               for number, c in (buffers or {}).items()}
    needed = {(opt.index[path].buffer, key) for path, entry in state.items()
              for key in entry if key in opt.schema.slots}
    needed |= {(number, key) for number, c in buffers.items() for key in c.state}
    allocated = {key: opt._backend.zeros(opt.buffers[key[0]].length,
                                          opt.buffers[key[0]].dtype)
                 for key in needed if key[1] not in opt.buffers[key[0]].state}
    for number, values in enumerate(settings or ()):
        if values is not None:
            opt.param_groups[number].update(values)
    for (number, name), flat in allocated.items():
        opt.buffers[number].state[name] = flat
    live = opt.settings() if opt.schema.eager else None  # values taken in above
    for buf in opt.buffers:
        opt._plans[buf.number] = None
        contents = buffers.get(buf.number)
        for name, column in buf.columns.items():
            column[...] = contents.columns[name] if contents and \
                name in contents.columns else 0
        for name, flat in buf.state.items():
            if contents and name in contents.state:
                np.copyto(flat, contents.state[name])
            else:  # fresh state: zeros, or an eager schema's initial values
                flat.fill(opt.schema.initial_value(name, live[buf.group]) if live else 0)
        if contents is not None:
            np.copyto(buf.params, contents.params)
    for path, entry in state.items():
        info = opt.index[path]
        buf = opt.buffers[info.buffer]
        if opt.schema.marker is not None:
            buf.columns[opt.schema.marker][info.slot] = 1
        for key, value in entry.items():
            if key in buf.columns:
                buf.columns[key][info.slot] = value
            else:
                buf.view(buf.state[key], info.slot)[...] = value
    for path, value in params.items():
        opt._param_views[path][...] = value


class PendingRestore:
    """A validated :meth:`Optimizer.restore <flatopt.Optimizer.restore>`, made by :meth:`apply` (once)."""

    def __init__(self, optimizer, state, settings, params, buffers):
        self._args = (optimizer, state, settings, params, buffers)

    def apply(self) -> None:
        if self._args is None:
            raise RuntimeError("this restore was applied already")
        optimizer, state, settings, params, buffers = self._args
        self._args = None
        with optimizer.lock:
            apply(optimizer, state, settings, params, buffers)


def _all_none(entry: Any) -> bool:
    """torch < 2.3 saved ``{"momentum_buffer": None}`` for SGD without momentum: no state."""
    return isinstance(entry, Mapping) and all(value is None for value in entry.values())
