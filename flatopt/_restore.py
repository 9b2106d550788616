"""Replacing an optimizer's state: the validation and the copy behind
:meth:`Optimizer.restore`, which ``load_state_dict`` and checkpoint ``load`` both go through.
Everything is checked before the first change; memory is allocated before it too.

Whole buffers may also arrive as :class:`Fill` sources (a checkpoint's data read straight into
place, so that a load needs no second copy of the state): ``apply`` runs them first, into the
optimizer's own arrays (or the slots it allocates), checks what they wrote with the same value
checks, and on any failure puts back every array it changed, from an undo copy kept within a
memory budget and beyond it in a temporary file; only then does it change anything else."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._io import pwrite_all
from ._views import gradient_problem
from .errors import StateDictError
from .kernels.checks import count_negative_or_nonfinite
from .schema import array_problem, column_problems, slot_value_problems


class Fill:
    """Values of a whole flat buffer (``params`` or a state slot of a :class:`BufferState`)
    that arrive while the restore is applied: ``fill(out)`` writes ``length`` values of
    ``dtype`` into ``out`` (the optimizer's own array, or a slot it allocates) and raises if
    they turn out wrong (a checksum); the restore then checks them as it checks arrays
    (``slot_value_problems``) and, on any failure, puts back everything it changed."""

    def __init__(self, length: int, dtype: np.dtype, fill: Callable[..., None],
                 what: str = "", blockwise: bool = False):
        self.length = int(length)
        self.dtype = np.dtype(dtype)
        self.fill = fill
        self.what = what
        self.blockwise = blockwise
        """``fill(out, keep, landed)`` calls ``keep(start, stop)`` (when not None; from any
        thread) before it overwrites bytes ``[start, stop)`` of ``out`` and ``landed(start,
        stop)`` once they hold the new values, for ranges on element boundaries that cover
        ``out`` once: the undo copy of the optimizer's own array is made, and the values are
        checked, piece by piece as the data lands (in the cache, on the reading threads)
        instead of in passes of their own."""

    def __repr__(self) -> str:
        return f"Fill({self.what or 'values'}, {self.length} x {self.dtype})"


@dataclass
class BufferState:
    """Whole-buffer contents for :meth:`Optimizer.restore` when a saved buffer has exactly
    the live buffer's layout: ``params`` and each ``state`` slot flat (the buffer's length;
    an array or a :class:`Fill`), ``columns`` one value per parameter for each persisted
    column of the schema."""

    params: np.ndarray | Fill
    state: dict[str, np.ndarray | Fill] = field(default_factory=dict)
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
        info = opt.find(path, "state given for", problems)
        if info is not None and not _all_none(entry):
            problems += opt.schema.state_problems(info.path, entry, info.shape, info.dtype,
                                                   effective[info.group])
    for path, value in (params or {}).items():
        info = opt.find(path, "values given for", problems)
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
        length = buf.layout(name).length
        if isinstance(flat, Fill):
            if flat.length != length or flat.dtype != buf.dtype:
                problems.append(f"{where}: {name} has {flat.length} values of {flat.dtype}, "
                                f"the buffer {length} of {buf.dtype}")
            continue
        problem = array_problem(flat, (length,), buf.dtype)
        if problem:
            problems.append(f"{where}: {name} {problem}")
    problems += column_problems(opt.schema, contents.columns, len(buf), where)
    if problems:
        return problems
    stateful = opt.schema.stateful(contents.columns)
    for name, flat in contents.state.items():
        if not isinstance(flat, Fill):  # a Fill is checked the same way once it has filled
            problems += [f"{where}: {problem}" for problem in slot_value_problems(
                opt.schema, name, flat, buf.layout(name), stateful, buf.paths)]
    return problems


def apply(opt, state, settings, params, buffers, *, staging: int | None = None,
          spill_dir: str | None = None, before_commit: Callable[[], None] | None = None) -> None:
    """Copy validated values in. Memory is allocated (and sources that alias this
    optimizer's own buffers copied) before the first change. :class:`Fill` sources run first
    (see :func:`_run_fills`); ``before_commit`` runs after them (its error undoes them too);
    the rest cannot fail."""
    owned = [flat for buf in opt.buffers for flat in (buf.params, *buf.state.values())]

    def detached(value):
        if isinstance(value, Fill):
            return value
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
    allocated = {key: opt.new_slot(opt.buffers[key[0]], key[1])
                 for key in needed if key[1] not in opt.buffers[key[0]].state}
    _run_fills(opt, buffers, allocated, staging, spill_dir, before_commit)
    for number, values in enumerate(settings or ()):
        if values is not None:
            opt.param_groups[number].update(values)
    for (number, name), flat in allocated.items():
        opt.buffers[number].state[name] = flat
    live = opt.settings() if opt.schema.eager else None  # values taken in above
    opt.invalidate_plans()
    for buf in opt.buffers:
        contents = buffers.get(buf.number)
        for name, column in buf.columns.items():
            if name in opt.path_columns:
                continue  # constants of the parameter, not state
            column[...] = contents.columns[name] if contents and \
                name in contents.columns else 0
        for name, flat in buf.state.items():
            if contents and name in contents.state:
                if not isinstance(contents.state[name], Fill):  # a Fill is in place already
                    np.copyto(flat, contents.state[name])
            else:  # fresh state: zeros, or an eager schema's initial values
                flat.fill(opt.schema.initial_value(name, live[buf.group]) if live else 0)
        if contents is not None and not isinstance(contents.params, Fill):
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
                buf.state_view(key, info.slot)[...] = value
    for path, value in params.items():
        opt.params[path][...] = value


def _run_fills(opt, buffers, allocated, staging, spill_dir, before_commit) -> None:
    """Run every :class:`Fill` into its array: a slot allocated for it (nothing to undo) or
    the optimizer's own (an undo copy kept first), then check what it wrote with the value
    checks arrays get in ``restore_problems``; then ``before_commit``. On any error, put every
    array back and re-raise: nothing of the optimizer has changed."""
    fills = []
    for number, contents in buffers.items():
        buf = opt.buffers[number]
        for name, source in (("params", contents.params), *contents.state.items()):
            if isinstance(source, Fill):
                new = allocated.get((number, name))
                target = new if new is not None else (
                    buf.params if name == "params" else buf.state[name])
                fills.append((new is None, number, name, source, target, contents))
    if not fills and before_commit is None:
        return
    fills.sort(key=lambda item: item[0])  # fresh arrays first: failing there undoes nothing
    undo = _Undo(staging, spill_dir)
    try:
        for live, number, name, source, target, contents in fills:
            bad = None
            if source.blockwise:
                counts: list[int] = []
                landed = None
                if name != "params" and opt.schema.slots[name].nonnegative:
                    landed = _counter(target, counts)
                try:
                    source.fill(target, undo.keeper(target) if live else None, landed)
                except Exception:
                    # the undo copy failed on a reading thread (a full disk): that, not the
                    # reader's report of it, is the error
                    if undo.failure is not None:
                        raise undo.failure from None
                    raise
                bad = sum(counts) if landed is not None else None
            else:
                if live:
                    undo.keep(target)
                source.fill(target)
            if name != "params":
                buf = opt.buffers[number]
                where = f"buffer {number} (group {buf.group}, {buf.dtype})"
                problems = [f"{where}: {problem}" for problem in slot_value_problems(
                    opt.schema, name, target, buf.layout(name),
                    opt.schema.stateful(contents.columns), buf.paths, bad)]
                if problems:
                    raise StateDictError("; ".join(problems))
        if before_commit is not None:
            before_commit()
    except BaseException:
        undo.restore()
        raise
    finally:
        undo.close()


def _counter(target: np.ndarray, counts: list) -> Callable[[int, int], None]:
    """``landed(start, stop)`` for a blockwise fill of ``target``: counts the negative or
    non-finite values of bytes ``[start, stop)`` into ``counts`` (on the reading thread,
    while they are in the cache; the kernel releases the GIL)."""
    flat = target.reshape(-1)
    item = flat.dtype.itemsize

    def landed(start: int, stop: int) -> None:
        counts.append(int(count_negative_or_nonfinite(flat[start // item:stop // item])))
    return landed


class _Undo:
    """Copies of arrays about to be overwritten, to put them back: in memory up to ``budget``
    bytes (None: no limit), the rest in an unnamed temporary file in ``directory``. A copy is
    made whole (:meth:`keep`) or piece by piece from several threads (:meth:`keeper`); only
    the pieces kept are put back, so a target overwritten only in part is restored exactly."""

    def __init__(self, budget: int | None, directory: str | None):
        self.budget = budget
        self.directory = directory
        self.used = 0
        self.kept: list[tuple[np.ndarray, Any, list]] = []
        self.file = None
        self.spilled = 0
        self.failure: BaseException | None = None
        """The first error of a piece's copy (an OSError of a full disk), kept because it
        happens on a reading thread, whose caller reports errors as a damaged file."""

    def keep(self, target: np.ndarray) -> None:
        self.keeper(target)(0, target.nbytes)

    def keeper(self, target: np.ndarray) -> Callable[[int, int], None]:
        """``keep(start, stop)``: bytes ``[start, stop)`` of ``target`` (C-contiguous) copied
        aside; safe to call from several threads for disjoint ranges."""
        nbytes = target.nbytes
        raw = target.reshape(-1).view(np.uint8)
        if self.budget is None or self.used + nbytes <= self.budget:
            copy = np.empty(nbytes, np.uint8)
            self.used += nbytes

            def hold(start: int, stop: int) -> None:
                np.copyto(copy[start:stop], raw[start:stop])
            return self._kept(target, copy, hold)
        if self.file is None:
            self.file = tempfile.TemporaryFile(dir=self.directory)
        fd, base = self.file.fileno(), self.spilled
        self.spilled += nbytes
        view = memoryview(raw)

        def spill(start: int, stop: int) -> None:
            for low in range(start, stop, _SPILL_PIECE):
                high = min(stop, low + _SPILL_PIECE)
                pwrite_all(fd, view[low:high], base + low)
        return self._kept(target, base, spill)

    def _kept(self, target: np.ndarray, saved: Any,
              put_aside: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """The keeper of ``target`` whose ``put_aside(start, stop)`` copies its bytes to ``saved``
        (an array, or an offset in the file): the ranges copied are recorded for
        :meth:`restore`, and the first error is kept in ``failure`` before it propagates."""
        ranges: list[tuple[int, int]] = []

        def keep(start: int, stop: int) -> None:
            try:
                put_aside(start, stop)
            except BaseException as exc:
                self.failure = self.failure or exc
                raise
            ranges.append((start, stop))
        self.kept.append((target, saved, ranges))
        return keep

    def restore(self) -> None:
        for target, saved, ranges in reversed(self.kept):
            raw = target.reshape(-1).view(np.uint8)
            for start, stop in ranges:
                if isinstance(saved, np.ndarray):
                    np.copyto(raw[start:stop], saved[start:stop])
                    continue
                view = memoryview(raw)[start:stop]
                self.file.seek(saved + start)
                done = 0
                while done < len(view):
                    got = self.file.readinto(view[done:])
                    if not got:
                        raise OSError("the undo file of a failed restore is short")
                    done += got
        self.kept = []

    def close(self) -> None:
        self.kept = []
        if self.file is not None:
            self.file.close()
            self.file = None


_SPILL_PIECE = 64 << 20




class PendingRestore:
    """A validated :meth:`Optimizer.restore <flatopt.Optimizer.restore>`, made by
    :meth:`apply` (once)."""

    def __init__(self, optimizer, state, settings, params, buffers):
        self._args = (optimizer, state, settings, params, buffers)

    def apply(self, *, staging: int | None = None, spill_dir: str | None = None,
              before_commit: Callable[[], None] | None = None) -> None:
        """Make the restore. With :class:`Fill` sources, the copies kept to undo them use at
        most ``staging`` bytes of memory (None: no limit), the rest a temporary file in
        ``spill_dir``; ``before_commit`` runs once they have filled (an error there undoes
        them). If a Fill or ``before_commit`` fails, nothing has changed and its error
        propagates; the restore can then not be applied again."""
        if self._args is None:
            raise RuntimeError("this restore was applied already")
        optimizer, state, settings, params, buffers = self._args
        self._args = None
        with optimizer.lock, optimizer.host_side():  # CUDA: the device gets the result
            apply(optimizer, state, settings, params, buffers, staging=staging,
                  spill_dir=spill_dir, before_commit=before_commit)


def _all_none(entry: Any) -> bool:
    """torch < 2.3 saved ``{"momentum_buffer": None}`` for SGD without momentum: no state."""
    return isinstance(entry, Mapping) and all(value is None for value in entry.values())
