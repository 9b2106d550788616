"""Checkpoints of a sharded optimizer (``comm=`` with more than one rank, flatopt.distributed).

``flatopt.save(path, opt)`` and ``flatopt.load(path, opt)`` come here for a sharded optimizer;
both are collective (every rank calls them with the same arguments), and an error on any rank
raises on every rank, with nothing changed. The ranks first agree on their input: the same
directory to save (after resolving symlinks), the same checkpoint to load (its commit digest,
whatever path each rank reaches it by).

A save writes the directory ``path`` (see ``manifest``): every rank checks its range of the
state with the one value check a file's state gets, writes its part file (its range of the
parameters and of every state slot, atomically), and rank 0 then commits the save by writing
the manifest, the index, settings, metadata, scheduler state and extra arrays (rank 0's) with
every rank's fragment ranges and digests. Nobody gathers the state: each rank writes what it
holds. A rank killed during the save leaves the previous manifest, and the part files it
names, in place.

A load, from a sharded checkpoint saved at any world size or from a single file, compares the
file with the optimizer as a plain load does (every option applies). When each live buffer
has the saved layout (the usual resume), every rank reads and verifies only its range: its
range of the parameters, then all-gathered, and its range of each state slot (a replicated
rule's state whole); only the blocks holding those ranges are read. Anything else (a
partial, renamed or regrouped load) loads the file into a plain copy of the optimizer on
every rank, which keeps its range.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np

from .. import distributed
from .._layout import RangeLayout
from ..distributed._common import error_record, raise_collected
from ..errors import CheckpointError
from ..schema import column_problems, slot_value_problems
from . import files, manifest
from .loader import (LoadResult, checked_plan, guarded, load_scheduler, parse, saved_columns,
                     whole_matches)
from .loader import load as load_plain
from .writer import Snapshot
from .writer import save as save_file


def _collectively(comm, action, where: str, root: int | None = None):
    """``action()`` on every rank (or on ``root`` only); any rank's failure raises on every
    rank. Returns the action's value (``root``'s, broadcast, when only it acts)."""
    record = failure = value = None
    if root is None or comm.Get_rank() == root:
        try:
            value = action()
        except Exception as error:  # every rank must hear of it before raising
            record, failure = error_record(error), error
    records = comm.allgather(record)
    if failure is not None:
        raise failure
    raise_collected(records, where)
    return value if root is None else comm.bcast(value, root=root)


def _agree(comm, value: str, shown: str, what: str, where: str, path: str) -> None:
    """Every rank's ``value`` the same, or CheckpointError on every rank naming each rank's
    (``shown``): a collective save or load takes one input, and ranks given different ones
    would write one save into several directories, or load one optimizer from several
    checkpoints."""
    values = comm.allgather((value, shown))
    if any(mine != values[0][0] for mine, _ in values):
        listed = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in enumerate(values))
        raise CheckpointError(f"{where}: the ranks were given different {what} ({listed[:2000]})"
                              "; a sharded save or load is collective: give every rank the same "
                              "one. Nothing was changed", path=path)


# ------------------------------------------------------------------------ save
def own_pieces(opt, rank: int, size: int) -> list[tuple]:
    """What rank ``rank`` saves: (buffer, slot, start, stop, values) for its range of the
    parameters and of every state slot it holds. A replicated rule's state (every rank holds
    it whole) is cut evenly over the ranks, each slot over its own length."""
    pieces = []
    for shard, buf in zip(opt.sharding.shards, opt.buffers):
        lo, hi = shard.reduce_lo, shard.reduce_hi
        pieces.append((buf, "params", lo, hi, buf.params[lo:hi]))
        for name in opt.schema.slots:
            flat = shard.state.get(name)
            if flat is None:
                continue
            if shard.replicated:
                start, stop = flat.size * rank // size, flat.size * (rank + 1) // size
                pieces.append((buf, name, start, stop, flat[start:stop]))
            else:
                pieces.append((buf, name, shard.lo, shard.hi, flat))
    return pieces


def piece_problems(schema, layout, name: str, start: int, stop: int, values: np.ndarray,
                   stateful: np.ndarray, paths) -> list[str]:
    """A range of one slot laid out as ``layout`` checked as a whole slot is
    (``slot_value_problems``; parameters have no value check)."""
    if name == "params":
        return []
    return slot_value_problems(schema, name, values, RangeLayout(layout, start, stop),
                               stateful, paths)


def _undone_on_failure(scheduler, action):
    """``action()``; when it raises, ``scheduler`` gets back the state it had (a load that
    fails on another rank must not leave this rank's scheduler loaded)."""
    keep = callable(getattr(scheduler, "state_dict", None))
    previous = copy.deepcopy(scheduler.state_dict()) if keep else None
    try:
        return action()
    except BaseException:
        if keep:
            try:
                scheduler.load_state_dict(previous)
            except Exception:  # the load's own error is the one to report
                pass
        raise


def save(path, opt, *, scheduler: Any = None, metadata: Any = None,
         arrays: dict | None = None, background: bool = False) -> str:
    """flatopt.save for a sharded optimizer: one file per rank and a manifest (see above).
    Returns the directory's absolute path."""
    comm = opt.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if background:
        raise distributed.DistributedError(
            f"flatopt.save(..., background=True) is not available for {type(opt).__name__} "
            "sharded over ranks: save in the foreground (every rank writes its own file)")
    where = f"flatopt.save({str(path)[:200]!r})"
    with opt.lock:
        opt.sharding.sync_shards()  # buffers added by add_param_group since the last step

        def prepare():
            directory = manifest.target_directory(path, create=False)
            pieces = own_pieces(opt, rank, size)
            problems = []
            for buf in opt.buffers:
                what = f"param group {buf.group} {buf.dtype} buffer"
                problems += column_problems(opt.schema, buf.columns, len(buf.paths), what)
                stateful = opt.schema.stateful(buf.columns)
                problems += [f"{what}: {problem}"
                             for piece_buf, name, start, stop, values in pieces
                             if piece_buf is buf
                             for problem in piece_problems(opt.schema, buf.layout(name), name,
                                                           start, stop, values, stateful,
                                                           buf.paths)]
            if problems:
                raise CheckpointError("cannot save this optimizer (nothing was written): "
                                      + "; ".join(problems[:20]), path=directory)
            snapshot = (Snapshot(opt, metadata, scheduler, arrays, check=False, buffers=False)
                        if rank == 0 else None)
            return directory, pieces, snapshot

        directory, pieces, snapshot = _collectively(comm, prepare, where)
        # resolved, so that one directory reached through a symlink on some ranks agrees
        real = os.path.realpath(directory)
        _agree(comm, real, real, "checkpoint directories", where, directory)
        # every rank's checks passed: only now is the target touched
        _collectively(comm, lambda: manifest.target_directory(path, create=True), where, root=0)
        save_id = comm.bcast(manifest.new_save_id() if rank == 0 else None, root=0)
        rows = _collectively(comm, lambda: manifest.write_part(
            directory, save_id, rank, size,
            [(buf.group, buf.dtype.name, name, start, stop, values)
             for buf, name, start, stop, values in pieces]), where)
        everyone = comm.gather(rows, root=0)
        _collectively(comm, lambda: manifest.commit(
            directory, snapshot, save_id, size, [row for part in everyone for row in part]),
            where, root=0)
    return directory


def save_consolidated(path, opt, *, scheduler: Any = None, metadata: Any = None,
                      arrays: dict | None = None, background: bool = False) -> str:
    """flatopt.save for a sharded optimizer with reduced-precision buffers: the ranks' ranges
    of the stored state, block scales, master weights and compensation are gathered on rank
    0 (``distributed.consolidated``), which writes ONE file (format version 5, lossless) at
    ``path``. Collective; an error on any rank raises on every rank, with nothing written.
    The parts-and-manifest directory holds float32 ranges only, so these buffers go whole
    through rank 0 (it holds the full state for the duration of the save)."""
    comm = opt.comm
    if background:
        raise distributed.DistributedError(
            f"flatopt.save(..., background=True) is not available for {type(opt).__name__} "
            "sharded over ranks: save in the foreground")
    where = f"flatopt.save({str(path)[:200]!r})"
    with opt.lock:
        real = os.path.realpath(os.fspath(path))
        _agree(comm, real, real, "checkpoint paths", where, str(path))
        twin = distributed.consolidated(opt, root=0)   # collective
        return _collectively(comm, lambda: save_file(path, twin, scheduler=scheduler,
                                                     metadata=metadata, arrays=arrays),
                             where, root=0)


# ------------------------------------------------------------------------ load
def load(source, opt, **options: Any):
    """flatopt.load for a sharded optimizer (see above)."""
    comm = opt.comm
    where = f"flatopt.load({str(source)[:200]!r})"
    with opt.lock:
        opt.sharding.sync_shards()
        opened = []

        def plan():
            ck = parse(source)
            opened.append(ck)
            planned = checked_plan(ck, opt, **{k: v for k, v in options.items()
                                                if k != "staging"})
            matched = whole_matches(ck, opt, planned[0])
            return planned, matched, len(matched) == len(opt.buffers)

        try:
            planned, matched, whole = _collectively(comm, plan, where)
            ck = opened[0]  # the same contents (commit digest) on every rank, whatever the path
            _agree(comm, ck.digest, f"{ck.name} ({ck.digest})", "checkpoints", where, ck.name)
            if all(comm.allgather(whole)):
                return _load_ranges(opened[0], opt, planned, matched, options, where)
        finally:
            for ck in opened:
                ck.close()
        return _load_whole(source, opt, options, where)


def load_whole(source, opt, **options: Any):
    """flatopt.load for a sharded optimizer with reduced-precision buffers: every rank loads
    the checkpoint (one file, or a sharded directory of a float32 optimizer) into a
    single-process copy of the optimizer, storage and all, and keeps its range; the
    lossless and converting paths of a plain load apply (``convert=``)."""
    with opt.lock:
        opt.sharding.sync_shards()
        return _load_whole(source, opt, options, f"flatopt.load({str(source)[:200]!r})")


def _load_whole(source, opt, options: dict, where: str):
    """Every rank loads the file into a plain copy of the optimizer and keeps its range."""
    # live state never survives a load (state comes from the file or is reset), so the copy
    # needs this optimizer's parameter values and settings only, not its state
    twin = distributed.plain_copy(opt)
    result = _undone_on_failure(options.get("scheduler"), lambda: _collectively(
        opt.comm, lambda: load_plain(source, twin, **options), where))
    distributed.take_from(opt, twin)
    return result


def _load_ranges(ck, opt, planned, matched: dict, options: dict, where: str):
    """Each rank reads and verifies its ranges; once every rank has, the scheduler state is
    loaded, the parameters all-gathered and everything taken in."""
    plan, relaxed, settings = planned
    sharding, schema = opt.sharding, ck.schema

    rank, size = opt.comm.Get_rank(), opt.comm.Get_size()

    def read_mine():
        def checked(key, slot: str, start: int, stop: int) -> np.ndarray:
            saved = ck.buffers[key]
            values = guarded(ck, lambda: ck.read_range(key, slot, start, stop, workers))
            problems = piece_problems(
                schema, saved.layouts[slot], slot, start, stop, values,
                np.array([schema.stateful(e.columns) for e in saved.members], bool),
                [e.path for e in saved.members])
            if problems:
                raise ck.corrupt("; ".join(problems), buffer=saved.datasets[slot].name)
            return values

        taken = []
        with files.pool() as workers:
            for shard, buf in zip(sharding.shards, opt.buffers):
                key, ordered = matched[buf.number]
                saved = ck.buffers[key]
                state = {slot: checked(key, slot, *((0, saved.lengths[slot]) if shard.replicated
                                                    else (shard.lo, shard.hi)))
                         for slot in saved.datasets if slot != "params"}
                taken.append((checked(key, "params", shard.reduce_lo, shard.reduce_hi), state,
                              saved_columns(ck, buf, ordered)))
            # the file's other buffers (a partial load's unused ones) are verified as a
            # plain load verifies them, each rank its share
            used = {key for key, _ in matched.values()}
            for key in sorted(set(ck.buffers) - used):
                for slot, length in ck.buffers[key].lengths.items():
                    checked(key, slot, length * rank // size, length * (rank + 1) // size)
        return taken, guarded(ck, ck.read_arrays)

    taken, arrays = _collectively(opt.comm, read_mine, where)
    scheduler = options.get("scheduler")
    _undone_on_failure(scheduler, lambda: _collectively(
        opt.comm, lambda: load_scheduler(ck, scheduler), where))
    # nothing below can fail: the optimizer changes only now
    for number, values in enumerate(settings):
        if values is not None:
            opt.param_groups[number].update(values)
    live = opt.settings() if schema.eager else None
    for (params, state, columns), shard, buf in zip(taken, sharding.shards, opt.buffers):
        buf.params[shard.reduce_lo:shard.reduce_hi] = params
        sharding.gather(shard, buf.params)
        for name, column in columns.items():
            buf.columns[name][...] = column
        for name in shard.state:
            if name not in state and live is not None:  # fresh state of an eager schema
                state[name] = np.full_like(shard.state[name],
                                           schema.initial_value(name, live[buf.group]))
        shard.state.clear()
        shard.state.update(state)
        shard.arrays = shard.arrays_plan = None
    opt.invalidate_plans()
    return LoadResult.of(ck, opt, plan, relaxed, arrays)
