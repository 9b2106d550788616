"""``save``: an optimizer (through its public contract) into a checkpoint file, in the calling
thread or in the background.

A save gathers everything first (``Snapshot``: settings, index, texts, extra arrays, checked
against the format's limits and the schema's value checks) before the target is touched. The
file is then written with HDF5 (metadata, index, one contiguous dataset per buffer, allocated
up front) while the buffers' bytes go straight to their place in the file on several threads,
each 4 MiB block hashed (XXH3-64) just before it is copied out; the block hashes, each buffer's
digest and, last, the commit digest follow. ``files.replace_atomically`` makes it durable.

A background save (``save(..., background=True)``) copies the buffers into a snapshot kept for
the optimizer and reused by its next background save (the only time the caller waits, holding
``opt.lock``), then checks, writes, fsyncs and renames on a thread of its own and returns a
:class:`SaveHandle`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from .._version import __version__
from ..errors import CheckpointError, CheckpointOptionError, HyperparameterError
from ..optimizer import Optimizer
from ..schema import column_problems, slot_value_problems
from . import files, precision
from .extras import own_arrays
from .h5write import fragment_array, set_text, write_buffer, write_column
from .format import (BLOCK_BYTES, FORMAT, LIBVER, NEST, NESTED_FORMAT_VERSION,
                     PLAIN_FORMAT_VERSION, SHAPED_FORMAT_VERSION,
                     check_flags, checked_arrays, hashes_digest, jsonable, limits_problems,
                     manifest_digest, n_blocks, schema_columns, stored_dtype, text_dtype,
                     to_json)

ALIGN_THRESHOLD = 1 << 20   # datasets this large start on a page boundary in the file
ALIGN_INTERVAL = 4096


def _groups(opt: Optimizer) -> list[dict]:
    """Each group's hyperparameters (JSON text, with initial_lr) and label, validated now."""
    groups = []
    for number, values in enumerate(opt.settings()):  # raises before any file is created
        hyper = {key: jsonable(value) for key, value in values.items() if key != "label"}
        groups.append({"hyperparameters": to_json(hyper, f"param group {number}"),
                       "label": values.get("label")})
    return groups


def _index_columns(opt: Optimizer) -> dict[str, list]:
    columns: dict[str, list] = {name: [] for name in schema_columns(opt.schema)}
    for info in opt.index:
        buf = opt.buffers[info.buffer]
        columns["id"].append(int(info.id))
        columns["path"].append(info.path)
        columns["ndim"].append(len(info.shape))
        columns["shape"].append([int(d) for d in info.shape])
        columns["dtype"].append(info.dtype.name)
        columns["group"].append(int(info.group))
        columns["offset"].append(int(info.offset))
        columns["size"].append(int(info.size))
        for name in opt.schema.columns:
            columns[name].append(buf.columns[name][info.slot].item())
    return columns


@dataclass
class _Buffer:
    """One flat buffer as saved: its place, layout and arrays (live ones, or snapshot copies)."""

    number: int
    group: int
    dtype: np.dtype
    length: int
    offsets: np.ndarray
    sizes: np.ndarray
    paths: list
    columns: dict[str, np.ndarray]
    layouts: dict[str, Any]
    """Each array's packing (``FlatBuffer.layout``: a shaped slot has its own)."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)   # "params" and state slots


def _scheduler_state(scheduler: Any) -> Any:
    if not callable(getattr(scheduler, "state_dict", None)):
        raise CheckpointError(f"scheduler must have a state_dict() method, got "
                              f"{type(scheduler).__name__}")
    try:
        return scheduler.state_dict()
    except HyperparameterError as exc:   # built before the optimizer's last add_param_group
        raise CheckpointOptionError(f"scheduler=: {exc}") from None


class Snapshot:
    """What save writes, gathered and checked before the target is touched.

    ``memory`` (a dict kept by a background saver) makes it a copy: the buffers and extra
    arrays are copied into arrays kept there and reused by the next snapshot; otherwise the
    live arrays are written (the caller holds ``opt.lock`` until the write ends). ``check``
    runs the schema's value checks now (a background save runs them on its copy, on its
    thread, with :meth:`value_problems`)."""

    def __init__(self, opt: Optimizer, metadata: Any, scheduler: Any, arrays: Any = None, *,
                 ema: Any = None, scaler: Any = None, lookahead: Any = None,
                 memory: dict | None = None,
                 check: bool = True, buffers: bool = True):
        self.schema = opt.schema
        self.fragments: dict[tuple[int, str], tuple[int, list]] | None = None
        """A sharded checkpoint's manifest (``buffers=False``): (buffer number, slot) ->
        (the slot's length, its fragment rows [rank, start, stop, digest]), written in place
        of the data (see ``manifest``)."""
        self.groups = _groups(opt)
        self.columns = _index_columns(opt)
        own = own_arrays(opt, ema, scaler, lookahead)
        coded = precision.coded(opt)
        if coded:  # reduced precision: the stored arrays beside the float32 view
            opt.host_buffers()  # CUDA: the host mirror first
            texts, stored = precision.storage_texts_and_arrays(opt)
            own.update(stored)
            for number, text in texts.items():
                self.groups[number]["storage"] = text
        self.arrays = checked_arrays(arrays, own)
        version = (precision.PRECISION_FORMAT_VERSION if coded else
                   NESTED_FORMAT_VERSION if any(NEST in name for name in self.arrays) else
                   SHAPED_FORMAT_VERSION if self.schema.shaped_slots else PLAIN_FORMAT_VERSION)
        self.header = {"format": FORMAT, "format_version": version,
                       "flatopt_version": __version__, "h5py_version": h5py.version.version,
                       "hdf5_version": h5py.version.hdf5_version, "optimizer": self.schema.name}
        if self.schema.version != 1:
            self.header["schema_version"] = self.schema.version
        self.header["metadata"] = to_json(metadata, "metadata")
        if scheduler is not None:
            self.header["scheduler"] = to_json(_scheduler_state(scheduler),
                                               "scheduler.state_dict()")
        texts = {"metadata": self.header["metadata"],
                 **({"scheduler state": self.header["scheduler"]}
                    if "scheduler" in self.header else {}),
                 **{f"param group {n} hyperparameters": g["hyperparameters"]
                    for n, g in enumerate(self.groups)}}
        problems = limits_problems(self.schema, len(self.groups),
                                   [info.shape for info in opt.index], texts)
        if problems:
            raise CheckpointError("cannot save this optimizer (nothing was written): "
                                  + "; ".join(problems[:20]))
        self.buffers = []
        self.copy_seconds = 0.0
        if coded:
            self.buffers, offsets = precision.view_buffers(opt, _Buffer)
            self.columns["offset"] = [offsets[path] for path in self.columns["path"]]
            self.columns["dtype"] = [opt.buffers[info.buffer].dtype.name for info in opt.index]
        for buf in () if coded else opt.host_buffers():  # CUDA: the host mirror first
            saved = _Buffer(buf.number, buf.group, buf.dtype, int(buf.length), buf.offsets,
                            buf.sizes, buf.paths,
                            {name: column.copy() for name, column in buf.columns.items()},
                            {slot: buf.layout(slot) for slot in ("params", *self.schema.slots)})
            for slot in ("params", *self.schema.slots) if buffers else ():
                flat = buf.params if slot == "params" else buf.state.get(slot)
                if flat is not None:
                    saved.arrays[slot] = flat
            self.buffers.append(saved)
        if memory is not None:
            self.copy_seconds = self._copy(memory)
        if check:
            problems = self.value_problems()
            if problems:
                raise CheckpointError("cannot save this optimizer (nothing was written): "
                                      + "; ".join(problems[:20]))

    def _copy(self, memory: dict) -> float:
        """Copy every buffer and extra array into ``memory`` (reusing what is there); returns
        the seconds the copies took."""
        pairs = []
        keep = set()
        for saved in self.buffers:
            for slot, flat in saved.arrays.items():
                key = ("buffer", saved.number, slot)
                pairs.append((key, flat))
        for name, value in self.arrays.items():
            pairs.append((("array", name), value))
        targets = []
        for key, value in pairs:
            keep.add(key)
            target = memory.get(key)
            if target is None or target.shape != value.shape or target.dtype != value.dtype:
                target = memory[key] = np.empty(value.shape, value.dtype)
            targets.append((target, value))
        for key in list(memory):
            if key not in keep:
                del memory[key]
        start = time.perf_counter()
        _parallel_copy(targets)
        seconds = time.perf_counter() - start
        for saved in self.buffers:
            saved.arrays = {slot: memory["buffer", saved.number, slot] for slot in saved.arrays}
        self.arrays = {name: memory["array", name] for name in self.arrays}
        return seconds

    def value_problems(self) -> list[str]:
        """The saved state checked as load will check it (``flatopt.schema``'s one check)."""
        problems = []
        for saved in self.buffers:
            where = f"param group {saved.group} {saved.dtype} buffer"
            found = column_problems(self.schema, saved.columns, len(saved.paths), where)
            stateful = self.schema.stateful(saved.columns)
            for name, flat in saved.arrays.items():
                if name != "params":
                    found += [f"{where}: {problem}" for problem in slot_value_problems(
                        self.schema, name, flat, saved.layouts[name], stateful,
                        saved.paths)]
            problems += found
        return problems

    def _datasets(self) -> list[np.ndarray]:
        return [flat for saved in self.buffers for flat in saved.arrays.values()] + list(
            self.arrays.values())

    def estimate_bytes(self) -> int:
        """An upper bound for the file size: buffers and extra arrays (each aligned, with its
        block hashes), the index (strings stored at the longest one's width), the JSON texts,
        and HDF5's object headers (generously, per object). The property test checks it."""
        data, objects = 0, 8 + 2 * len(self.columns)
        for array in self._datasets():
            objects += 1
            data += array.nbytes + 8 * n_blocks(array.nbytes) + 2 * ALIGN_INTERVAL + 64
        objects += len(self.buffers)
        rows = len(self.columns["id"])
        longest = max((len(p.encode()) for p in self.columns["path"]), default=1)
        width = max((len(s) for s in self.columns["shape"]), default=1)
        index = rows * (longest + 8 * (width + len(self.columns)))
        texts = sum(len(v.encode()) for k, v in self.header.items() if isinstance(v, str))
        for group in self.groups:
            objects += 1
            texts += len(group["hyperparameters"].encode()) + len((group["label"] or "").encode())
        for name, array in self.arrays.items():
            texts += len(name.encode()) + 8 * (array.ndim + 4)
        return data + 2 * (index + texts) + 4096 * objects + data // 50 + (1 << 20)

    def write(self, target, *, stop_before_digest: bool = False,
              threads: int | None = None) -> None:
        """Write the file ``target`` (a path). ``threads``: how many threads write and hash the
        blocks (default: ``files.io_threads()``)."""
        buffer_table: dict[str, list] = {}
        array_table: dict[str, list] = {}
        with h5py.File(target, "w", libver=LIBVER, alignment_threshold=ALIGN_THRESHOLD,
                       alignment_interval=ALIGN_INTERVAL) as f:
            files.reserve(target, self.estimate_bytes())
            for key, value in self.header.items():
                if key in ("metadata", "scheduler"):  # may be long: a scalar string dataset
                    raw = value.encode("utf-8")
                    f.create_dataset(key, data=np.array(raw, dtype=text_dtype(raw)))
                elif isinstance(value, str):
                    set_text(f, key, value)
                else:
                    f.attrs[key] = value
            index = f.create_group("index")
            for name, dtype in schema_columns(self.schema).items():
                write_column(index, name, self.columns[name], dtype)
            pending = self._create_groups(f.create_group("groups"))
            named = []
            if self.arrays:
                arrays = f.create_group("arrays")
                for number, (name, value) in enumerate(self.arrays.items()):
                    ds, data = write_buffer(arrays, str(number), value)
                    set_text(ds, "name", name)
                    set_text(ds, "dtype", value.dtype.str)
                    pending.append((ds, data))
                    named.append((ds, name, value))
            buffer_table.update(self._write_fragment_tables(f["groups"]))
            hashes = self._write_data(target, pending, threads)
            for (ds, _), values in zip(pending, hashes):
                ds.attrs.create("checksums", data=values.astype("<u8"))
                digest = hashes_digest(values)
                set_text(ds, "digest", digest)
                if ds.parent.name != "/arrays":
                    buffer_table[ds.name] = [ds.dtype.name, int(ds.shape[0]), digest]
            for ds, name, value in named:
                array_table[ds.name] = [name, value.dtype.str, list(value.shape),
                                        ds.attrs["digest"].decode()]
            if stop_before_digest:
                return
            set_text(f, "digest", manifest_digest(self.header, self.groups, self.columns,
                                                   buffer_table, array_table))

    @staticmethod
    def _write_data(target: str, pending: list, threads: int | None) -> list[np.ndarray]:
        """Every dataset's bytes at its offset in the file, written and hashed block by block
        on several threads; returns each dataset's block hashes."""
        fd = os.open(target, os.O_WRONLY | getattr(os, "O_BINARY", 0))
        try:
            with files.pool(threads) as workers:
                out = []
                for ds, array in pending:
                    data = files.byte_view(np.ascontiguousarray(array,
                                                                stored_dtype(array.dtype)))
                    if not len(data):
                        out.append(np.zeros(0, np.uint64))
                        continue
                    offset = ds.id.get_offset()
                    out.append(files.write_hashed(fd, offset, data, workers))
                return out
        finally:
            os.close(fd)

    def _write_fragment_tables(self, root: h5py.Group) -> dict[str, list]:
        """A manifest's fragment tables (one per buffer slot: int64 rows rank, start, stop,
        digest as the 64 bits of its XXH3 value; attr length); returns their entries of the
        table the commit digest covers."""
        table = {}
        for (number, slot), (length, rows) in sorted((self.fragments or {}).items()):
            saved = self.buffers[number]
            ds = root[str(saved.group)][saved.dtype.name].create_dataset(
                slot, data=fragment_array(rows))
            ds.attrs["length"] = int(length)
            table[ds.name] = [saved.dtype.name, int(length), [list(row) for row in rows]]
        return table

    def _create_groups(self, root: h5py.Group) -> list:
        pending = []
        for number, group in enumerate(self.groups):
            g = root.create_group(str(number))
            set_text(g, "hyperparameters", group["hyperparameters"])
            if group["label"] is not None:
                set_text(g, "label", group["label"])
            if "storage" in group:
                set_text(g, "storage", group["storage"])
            for saved in self.buffers:
                if saved.group != number:
                    continue
                b = g.create_group(saved.dtype.name)
                b.attrs["length"] = int(saved.length)
                for slot in ("params", *self.schema.slots):
                    flat = saved.arrays.get(slot)
                    if flat is not None:
                        pending.append(write_buffer(b, slot, flat))
        return pending


def _parallel_copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(target, source)`` for every pair, the large ones split over threads (NumPy
    releases the GIL while it copies) where there are 4 cores or more: on 2 cores one thread
    already copies at the memory's speed and a second only adds overhead (measured on the
    2-core VM: 23 ms per 256 MB with one thread, 41 ms with two)."""
    pieces = []
    for target, source in pairs:
        if target.ndim == 1 and target.nbytes > 2 * BLOCK_BYTES:
            step = max(1, BLOCK_BYTES // target.itemsize * 4)
            pieces += [(target[k:k + step], source[k:k + step])
                       for k in range(0, target.size, step)]
        else:
            pieces.append((target, source))
    threads = files.io_threads() if (os.cpu_count() or 1) >= 4 else 1
    if threads > 1 and len(pieces) > 1:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda pair: np.copyto(*pair), pieces))
    else:
        for target, source in pieces:
            np.copyto(target, source)


def _checked_target(path, opt) -> str:
    if not isinstance(opt, Optimizer):
        raise CheckpointError(f"save() takes a flatopt optimizer, got {type(opt).__name__}")
    return files.target_path(path)


def _snapshot_error(final: str, exc: OSError) -> CheckpointError:
    # e.g. Numba's cache on a full disk, compiling a check
    return CheckpointError(f"could not save checkpoint {final}{files.full_hint(exc)}: {exc}; "
                           "nothing was written and any previous checkpoint at that path is "
                           "untouched", path=final)


def save(path: str | os.PathLike, opt: Optimizer, *, scheduler: Any = None,
         metadata: Any = None, arrays: dict[str, Any] | None = None,
         ema: Any = None, scaler: Any = None, lookahead: Any = None,
         background: bool = False) -> "str | SaveHandle":
    """Save ``opt`` (parameters, state, hyperparameters, index) to the HDF5 file ``path``.

    The file is written to a temporary file in the same directory, fsynced, renamed over
    ``path`` and the directory fsynced: a crash at any moment leaves either the previous
    checkpoint or the new one, never a mix. ``metadata`` (JSON-serializable),
    ``scheduler.state_dict()`` and ``arrays`` (``{name: ndarray}``, or nested dicts of them:
    running statistics, data-loader positions; bool, integer or float data of any shape) are
    stored in the same file, and so are an :class:`~flatopt.EMA` of ``opt`` (``ema=``) and a
    :class:`~flatopt.GradScaler` (``scaler=``), which ``load(..., ema=, scaler=)`` restore
    (see ``flatopt.checkpoint.extras``). Everything
    a load would refuse is refused here, before the target is touched. Returns the absolute
    path.

    ``background=True`` copies the buffers into a snapshot (kept for the optimizer and reused
    by its next background save) while holding ``opt.lock`` (the only time the caller waits),
    then checks, writes and commits the file on another thread, and returns a
    :class:`SaveHandle` (``wait()``, ``done()``, ``exception()``). A background save of the same
    optimizer still running is waited for first; so is one that a plain save would overtake.
    At exit, the interpreter waits for a running background save and says so on stderr. A
    process forked during one does not wait for it (its thread, and the commit, stay in the
    parent): there the handle's ``wait()`` raises CheckpointError saying so.

    For an optimizer sharded over several ranks (``comm=``), ``save`` is collective: every
    rank calls it, and ``path`` becomes a directory holding one file per rank and a
    ``manifest.h5`` that commits them (see ``flatopt.checkpoint.sharded``); it returns the
    directory's absolute path. One with reduced-precision buffers is gathered on rank 0 and
    saved as one file instead (``sharded.save_consolidated``).
    """
    check_flags(background=background)
    if isinstance(opt, Optimizer) and opt.sharding is not None:
        raise CheckpointOptionError("writer.save() saves an optimizer that holds all of its "
                                    "state; flatopt.save sends a sharded one to sharded.save")
    final = _checked_target(path, opt)
    saver = _Saver.of(opt, create=background)
    if saver is not None:
        saver.wait_previous()  # saves of one optimizer commit in the order they were asked for
    if background:
        return saver.save(final, opt, metadata=metadata, scheduler=scheduler, arrays=arrays,
                          ema=ema, scaler=scaler, lookahead=lookahead)
    with opt.lock:  # no step can change the buffers while they are written
        try:
            snapshot = Snapshot(opt, metadata, scheduler, arrays, ema=ema, scaler=scaler,
                                lookahead=lookahead)
        except OSError as exc:
            raise _snapshot_error(final, exc) from exc
        files.replace_atomically(final, snapshot.write)
    return final


# ----------------------------------------------------------------------------- background
class SaveHandle:
    """A background save (:func:`save` with ``background=True``).

    ``wait(timeout=None)`` blocks until the file is committed and returns its path, or raises
    the save's error (``CheckpointError``; the previous checkpoint is then untouched);
    ``done()`` says whether it finished; ``exception()`` returns the error or None.
    ``snapshot_seconds`` is how long the caller waited (holding ``opt.lock``): the copy into the
    snapshot and the gathering of settings and index; ``copy_seconds`` the copy alone."""

    def __init__(self, path: str, snapshot_seconds: float, copy_seconds: float):
        self.path = path
        self.snapshot_seconds = snapshot_seconds
        self.copy_seconds = copy_seconds
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._seen = False

    def wait(self, timeout: float | None = None) -> str:
        self._seen = True
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._seen = True
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = ("running" if not self.done() else
                 "failed" if self._future.exception() else "committed")
        return f"<SaveHandle {self.path} {state}>"


_PENDING: set = set()
_PENDING_LOCK = threading.Lock()


class _Saver:
    """Background saves of one optimizer: the snapshot memory they reuse, the save running."""

    _savers: "weakref.WeakKeyDictionary[Optimizer, _Saver]" = weakref.WeakKeyDictionary()
    _savers_lock = threading.Lock()

    def __init__(self):
        self.memory: dict = {}
        self.running: SaveHandle | None = None
        self.lock = threading.Lock()

    @classmethod
    def of(cls, opt: Optimizer, create: bool) -> "_Saver | None":
        with cls._savers_lock:
            saver = cls._savers.get(opt)
            if saver is None and create:
                saver = cls._savers[opt] = cls()
            return saver

    def wait_previous(self) -> None:
        previous = self.running
        if previous is None:
            return
        try:
            previous._future.exception()  # wait, without marking the error as seen
        finally:
            if previous._future.exception() is not None and not previous._seen:
                warnings.warn(f"an earlier background save of {previous.path} failed and "
                              f"nobody asked: {previous._future.exception()}", RuntimeWarning,
                              stacklevel=3)
                previous._seen = True

    def save(self, final: str, opt: Optimizer, **what) -> SaveHandle:
        with self.lock:
            self.wait_previous()
            start = time.perf_counter()
            with opt.lock:
                try:
                    snapshot = Snapshot(opt, what["metadata"], what["scheduler"],
                                         what["arrays"], ema=what["ema"],
                                         scaler=what["scaler"],
                                         lookahead=what["lookahead"], memory=self.memory,
                                         check=False)
                except OSError as exc:
                    raise _snapshot_error(final, exc) from exc
            handle = SaveHandle(final, time.perf_counter() - start, snapshot.copy_seconds)
            self.running = handle
            with _PENDING_LOCK:
                _PENDING.add(handle)
            thread = threading.Thread(target=self._run, args=(snapshot, handle), daemon=True,
                                      name=f"flatopt-save {os.path.basename(final)}")
            thread.start()
            return handle

    @staticmethod
    def _run(snapshot: Snapshot, handle: SaveHandle) -> None:
        try:
            try:
                problems = snapshot.value_problems()
            except OSError as exc:
                raise _snapshot_error(handle.path, exc) from exc
            if problems:
                raise CheckpointError("cannot save this optimizer (nothing was written): "
                                      + "; ".join(problems[:20]), path=handle.path)
            files.replace_atomically(handle.path, lambda tmp: snapshot.write(tmp, threads=1))
        except BaseException as exc:  # delivered by wait()
            handle._future.set_exception(exc)
        else:
            handle._future.set_result(handle.path)
        finally:
            with _PENDING_LOCK:
                _PENDING.discard(handle)


def _forget_saves_after_fork() -> None:
    """In a child forked during a background save: the save's thread stayed in the parent,
    which commits the file. The child's handles say so instead of waiting for ever, and
    neither its next save nor its exit waits for it; the locks a parent's thread may have
    held at the fork are new ones."""
    global _PENDING_LOCK
    _PENDING_LOCK = threading.Lock()
    for handle in _PENDING:
        handle._future = concurrent.futures.Future()  # the parent's may be locked
        handle._future.set_exception(CheckpointError(
            f"the background save of {handle.path} runs in the parent process, which was "
            "saving when this process was forked from it: wait for it there", path=handle.path))
        handle._seen = True
    _PENDING.clear()
    _Saver._savers_lock = threading.Lock()
    for saver in _Saver._savers.values():
        saver.lock = threading.Lock()
        saver.running = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_saves_after_fork)


@atexit.register
def _wait_at_exit() -> None:
    with _PENDING_LOCK:
        handles = [handle for handle in _PENDING if not handle.done()]
    for handle in handles:
        print(f"flatopt: waiting for the background save of {handle.path} to finish ...",
              file=sys.stderr, flush=True)
        error = handle._future.exception()
        if error is not None:
            print(f"flatopt: the background save of {handle.path} FAILED: {error}",
                  file=sys.stderr, flush=True)
        else:
            print(f"flatopt: background save of {handle.path} committed", file=sys.stderr,
                  flush=True)
