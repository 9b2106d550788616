"""HDF5 checkpoints: verified before they load, atomic on disk, refusing hostile files.

``save(path, opt)`` writes the optimizer's flat buffers (parameters and every state slot) as
chunked, fletcher32-checksummed datasets, one per buffer and slot, plus a readable index and
each group's hyperparameters, into a temporary file that is fsynced and renamed over ``path``;
a digest of everything is the last thing written. ``load(path, opt)`` checks the whole file
(structure, sizes, digests, every buffer's CRC) and compares it with the live optimizer by path
before a single byte of the optimizer changes.

File layout (format ``flatopt.checkpoint`` version 1); every string is fixed-length UTF-8::

    /                     attrs: format, format_version, flatopt_version, h5py_version,
                                 hdf5_version, optimizer, digest (sha256 over every attribute,
                                 the whole index and every buffer CRC; written last)
    /metadata             user metadata as JSON text (scalar string dataset)
    /scheduler            scheduler.state_dict() as JSON text (only when saved with one)
    /index/<column>       one row per parameter in id order: id, path, ndim, shape (2-D, padded
                          with -1), dtype, group, offset, size and the optimizer's per-parameter
                          state (Adam: step; SGD: momentum_initialized)
    /groups/<g>           attrs: hyperparameters (JSON), [label]
    /groups/<g>/<dtype>   attrs: length (elements, with alignment padding)
    /groups/<g>/<dtype>/<slot>   params, exp_avg, exp_avg_sq, max_exp_avg_sq or momentum_buffer:
                          1-D, chunked (1 MiB), fletcher32; attr digest = "crc32:<hex>"
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import io
import json
import math
import os
import re
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import h5py
import numpy as np

from . import _hyper
from ._layout import aligned_offsets, aligned_zeros
from .adam import Adam, AdamW
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch
from .optimizer import Optimizer
from .sgd import SGD

FORMAT = "flatopt.checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20
LIBVER = ("v110", "latest")  # superblock v3: checksummed metadata

_DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_MAX_ATTRS = 32
_MAX_MEMBERS = 4096
_MAX_NDIM = 32
_MAX_JSON = 16 << 20
_FLETCHER32 = h5py.h5z.FILTER_FLETCHER32


@dataclass(frozen=True)
class _Kind:
    name: str
    cls: type
    per_param: dict[str, np.dtype]  # persistent per-parameter arrays (index columns)
    slots: tuple[str, ...]          # state buffers, besides "params"


_KINDS = {
    "SGD": _Kind("SGD", SGD, {"momentum_initialized": np.dtype("u1")}, ("momentum_buffer",)),
    "Adam": _Kind("Adam", Adam, {"step": np.dtype("<i8")},
                  ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "AdamW": _Kind("AdamW", AdamW, {"step": np.dtype("<i8")},
                   ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
}
# Index columns. Strings are fixed-length UTF-8 and shapes a padded 2-D array: nothing in a
# checkpoint lives in HDF5's global heap, whose unchecksummed records can make HDF5 spin on a
# single flipped bit. "ndim" is stored alongside "shape" (padded with -1).
_BASE_COLUMNS = {"id": np.dtype("<i8"), "path": "str", "ndim": np.dtype("<i8"),
                 "shape": "shape", "dtype": "str", "group": np.dtype("<i8"),
                 "offset": np.dtype("<i8"), "size": np.dtype("<i8")}


def _kind_of(opt: Optimizer) -> _Kind:
    for cls in type(opt).__mro__:
        kind = _KINDS.get(cls.__name__)
        if kind is not None and cls is kind.cls:
            return kind
    raise CheckpointError(f"flatopt checkpoints support SGD, Adam and AdamW; got "
                          f"{type(opt).__name__}")


# --------------------------------------------------------------------------- differences
@dataclass(frozen=True)
class Difference:
    """One way a checkpoint differs from the optimizer it is loaded into."""

    kind: str
    """format, optimizer, missing, unexpected, shape, dtype, id, group, groups, hyperparameter,
    flag, rename, scheduler"""
    where: str
    """The parameter path, the group, or "file"."""
    saved: Any = None
    live: Any = None
    relaxed_by: str | None = None
    """The load option that accepts this difference, or None if nothing does."""
    note: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "saved": _jsonable(self.saved),
                "live": _jsonable(self.live), "relaxed_by": self.relaxed_by, "note": self.note}

    def __str__(self) -> str:
        text = f"{self.kind:<14} {self.where}: "
        if self.kind == "missing":
            text += "in the optimizer, not in the checkpoint"
        elif self.kind == "unexpected":
            text += "in the checkpoint, not in the optimizer"
        else:
            text += f"saved {_show(self.saved)}, live {_show(self.live)}"
        if self.note:
            text += f" ({self.note})"
        if self.relaxed_by:
            text += f"  [{self.relaxed_by}]"
        return text


def _show(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, (int, np.integer)) for v in value):
        return str(tuple(int(v) for v in value))
    return repr(value) if isinstance(value, str) else str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype):
        return value.name
    return value


@dataclass
class LoadResult:
    """What :func:`load` did."""

    path: str
    loaded: list[str]
    """Live paths whose parameter and state came from the checkpoint."""
    fresh: list[str]
    """Live paths absent from the checkpoint (strict=False): their state was reset, their
    parameter values kept."""
    unused: list[str]
    """Saved paths (after renaming) that match no live parameter (strict=False)."""
    differences: list[Difference]
    """Differences the chosen options accepted."""
    metadata: Any
    scheduler_state: Any
    info: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- JSON helpers
def _json_default(value: Any) -> Any:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, default=_json_default, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} must be JSON-serializable (dicts with string keys, lists, strings, numbers, "
            f"booleans, None; numpy scalars are converted): {exc}. flatopt checkpoints never "
            "pickle; store arrays as lists or in a separate file") from None


# --------------------------------------------------------------------------- digests
def _crc(array: np.ndarray) -> str:
    return f"crc32:{zlib.crc32(memoryview(np.ascontiguousarray(array)).cast('B')):08x}"


def _manifest_digest(header: Mapping, groups: list, index: Mapping, buffers: Mapping) -> str:
    """sha256 over every attribute, the whole index and every buffer's CRC, canonically."""
    text = json.dumps({"header": dict(header), "groups": groups, "index": dict(index),
                       "buffers": dict(buffers)}, sort_keys=True, default=_json_default,
                      allow_nan=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- save
def _group_hyperparameters(opt: Optimizer) -> list[dict]:
    settings = opt._group_settings()  # validated now; raises before any file is created
    groups = []
    for number, group in enumerate(opt.param_groups):
        values = {key: _jsonable(value) for key, value in settings[number].items()}
        if "initial_lr" in group:
            values["initial_lr"] = group["initial_lr"]
        groups.append({"hyperparameters": _to_json(values, f"param group {number}"),
                       "label": group.get("label")})
    return groups


def _index_columns(opt: Optimizer, kind: _Kind) -> dict[str, list]:
    columns: dict[str, list] = {name: [] for name in (*_BASE_COLUMNS, *kind.per_param)}
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
        for name in kind.per_param:
            columns[name].append(int(buf.per_param[name][info.slot]))
    return columns


def _text_dtype(raw: bytes | list[bytes]) -> np.dtype:
    longest = max((len(r) for r in raw), default=0) if isinstance(raw, list) else len(raw)
    return h5py.string_dtype("utf-8", max(1, longest))


def _set_text(obj, name: str, text: str) -> None:
    """A fixed-length UTF-8 string attribute (stored inside the checksummed object header)."""
    raw = text.encode("utf-8")
    obj.attrs.create(name, data=np.array(raw, dtype=_text_dtype(raw)))


def _write_column(parent: h5py.Group, name: str, values: list, dtype) -> None:
    if dtype == "str":
        raw = [v.encode("utf-8") for v in values]
        parent.create_dataset(name, data=np.array(raw, dtype=_text_dtype(raw)),
                              shape=(len(values),))
    elif dtype == "shape":
        width = max([1] + [len(shape) for shape in values])
        data = np.full((len(values), width), -1, dtype=np.int64)
        for k, shape in enumerate(values):
            data[k, :len(shape)] = shape
        parent.create_dataset(name, data=data)
    else:
        parent.create_dataset(name, data=np.asarray(values, dtype=dtype).reshape(-1))


def _write_buffer(parent: h5py.Group, name: str, flat: np.ndarray, pool) -> tuple:
    """Create one buffer dataset; its CRC is computed on another thread during the write."""
    future = pool.submit(_crc, flat)
    if flat.size:
        chunk = max(1, min(flat.size, CHUNK_BYTES // flat.itemsize))
        ds = parent.create_dataset(name, shape=flat.shape, dtype=flat.dtype, chunks=(chunk,),
                                   fletcher32=True)
        ds.write_direct(flat)
    else:
        ds = parent.create_dataset(name, shape=(0,), dtype=flat.dtype)
    return ds, future


def _write(target, opt: Optimizer, kind: _Kind, groups: list[dict], meta_json: str,
           sched_json: str | None, *, stop_before_digest: bool = False) -> None:
    from . import __version__
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "flatopt_version": __version__,
              "h5py_version": h5py.version.version, "hdf5_version": h5py.version.hdf5_version,
              "optimizer": kind.name, "metadata": meta_json}
    if sched_json is not None:
        header["scheduler"] = sched_json
    columns = _index_columns(opt, kind)
    buffer_table: dict[str, list] = {}
    with h5py.File(target, "w", libver=LIBVER) as f, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        if isinstance(target, str):
            _reserve(target, _estimate_bytes(opt, columns))
        for key, value in header.items():
            if key in ("metadata", "scheduler"):  # may be long: a scalar string dataset
                raw = value.encode("utf-8")
                f.create_dataset(key, data=np.array(raw, dtype=_text_dtype(raw)))
            elif isinstance(value, str):
                _set_text(f, key, value)
            else:
                f.attrs[key] = value
        index = f.create_group("index")
        for name, dtype in (*_BASE_COLUMNS.items(), *kind.per_param.items()):
            _write_column(index, name, columns[name], dtype)
        root = f.create_group("groups")
        pending = []
        for number, group in enumerate(groups):
            g = root.create_group(str(number))
            _set_text(g, "hyperparameters", group["hyperparameters"])
            if group["label"] is not None:
                _set_text(g, "label", group["label"])
            for buf in opt.buffers:
                if buf.group != number:
                    continue
                b = g.create_group(buf.dtype.name)
                b.attrs["length"] = int(buf.length)
                for slot in ("params", *kind.slots):
                    flat = buf.params if slot == "params" else buf.state.get(slot)
                    if flat is None:
                        continue
                    ds, future = _write_buffer(b, slot, flat, pool)
                    pending.append((ds, future))
        for ds, future in pending:
            digest = future.result()
            _set_text(ds, "digest", digest)
            buffer_table[ds.name] = [ds.dtype.name, int(ds.shape[0]), digest]
        if stop_before_digest:
            return
        _set_text(f, "digest", _manifest_digest(header, groups, columns, buffer_table))


def _estimate_bytes(opt: Optimizer, columns: dict[str, list]) -> int:
    """An upper bound for the file size: buffers, fletcher32 sums, index and metadata."""
    data = 0
    for buf in opt.buffers:
        for flat in (buf.params, *buf.state.values()):
            chunks = -(-flat.nbytes // CHUNK_BYTES)
            data += flat.nbytes + 64 * chunks
    index = sum(len(path.encode()) + 128 for path in columns["path"])
    return data + 2 * index + data // 50 + (1 << 20)


def _reserve(path: str, nbytes: int) -> None:
    """Allocate the file's disk space up front, so a full disk fails here, cleanly, before
    HDF5 writes any chunk (HDF5 2.0 crashes on close after a failed chunked write)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL,
                         getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            return  # the filesystem cannot reserve space; write without the reservation
        raise
    finally:
        os.close(fd)


def _trim(path: str) -> None:
    """Cut the file to the end of HDF5's data (recorded in superblock v2/v3), dropping the
    unused tail of the reservation."""
    with open(path, "r+b") as handle:
        head = handle.read(48)
        if (len(head) < 48 or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (2, 3)
                or head[9] != 8):
            return
        end = int.from_bytes(head[28:36], "little")
        handle.seek(0, os.SEEK_END)
        if 0 < end < handle.tell():
            handle.truncate(end)


def _fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


def _clean_stale_temps(directory: str, name: str) -> None:
    """Remove temporary files that a killed save of ``name`` left behind."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        match = _TEMP.match(entry)
        if not match or match["name"] != name:
            continue
        pid = int(match["pid"])
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # that saver is still running
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError, OSError):
                continue
        else:
            continue  # our own temp files are removed by save itself
        try:
            os.unlink(os.path.join(directory, entry))
        except OSError:
            pass


def save(path: str | os.PathLike, opt: Optimizer, *, scheduler: Any = None,
         metadata: Any = None) -> str:
    """Save ``opt`` (parameters, state, hyperparameters, index) to the HDF5 file ``path``.

    The file is written to a temporary file in the same directory, fsynced, renamed over
    ``path`` and the directory fsynced: a crash at any moment leaves either the previous
    checkpoint or the new one, never a mix. ``metadata`` (JSON-serializable) and
    ``scheduler.state_dict()`` are stored in the same file. Returns the absolute path.
    """
    kind = _kind_of(opt)
    groups = _group_hyperparameters(opt)
    for text in [*opt.index.paths, *(g["label"] or "" for g in groups)]:
        if "\x00" in text:
            raise CheckpointError(f"cannot save a path or label containing a NUL character: "
                                  f"{text!r}")
    meta_json = _to_json(metadata, "metadata")
    sched_json = None
    if scheduler is not None:
        if not callable(getattr(scheduler, "state_dict", None)):
            raise CheckpointError(f"scheduler must have a state_dict() method, got "
                                  f"{type(scheduler).__name__}")
        sched_json = _to_json(scheduler.state_dict(), "scheduler.state_dict()")
    final = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(final)
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot save checkpoint {final}: directory {directory} does not "
                              "exist", path=final)
    if os.path.isdir(final):
        raise CheckpointError(f"cannot save checkpoint {final}: it is a directory", path=final)
    _clean_stale_temps(directory, name)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.{os.getpid()}.",
                                   suffix=".tmp")
    except OSError as exc:
        raise CheckpointError(f"cannot save checkpoint {final}: cannot create a temporary file "
                              f"in {directory}: {exc}", path=final) from exc
    os.close(fd)
    try:
        _write(tmp, opt, kind, groups, meta_json, sched_json)
        _trim(tmp)
        _fsync_path(tmp)
        try:
            mode = os.stat(final).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, final)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            text = str(exc)
            full = any(marker in text for marker in ("No space left", "Disk quota",
                                                      "File too large"))
            full = full or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT,
                                                          errno.EFBIG)
            hint = " (the disk is full or a file size limit was hit)" if full else ""
            raise CheckpointError(f"could not save checkpoint {final}{hint}: {text}; the "
                                  "temporary file was removed and any previous checkpoint at "
                                  "that path is untouched", path=final) from exc
        raise
    _fsync_path(directory, directory=True)
    return final


# --------------------------------------------------------------------------- reading
@dataclass
class _SavedParam:
    row: int
    id: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    group: int
    offset: int
    size: int
    per_param: dict[str, int]


@dataclass
class _SavedBuffer:
    group: int
    dtype: str
    length: int
    datasets: dict[str, Any]   # slot -> h5py.Dataset
    digests: dict[str, str]
    members: list[_SavedParam] = field(default_factory=list)  # in offset order


class _Contents:
    """A checkpoint whose structure, sizes and digest have been checked (data not yet read)."""

    def __init__(self, name: str, file: h5py.File, size: int):
        self.name = name
        self.file = file
        self.size = size
        self.header: dict[str, Any] = {}
        self.kind: _Kind | None = None
        self.groups: list[dict] = []     # {"hyperparameters": normalised, "raw": dict, "label"}
        self.params: list[_SavedParam] = []
        self.by_path: dict[str, _SavedParam] = {}
        self.buffers: dict[tuple[int, str], _SavedBuffer] = {}
        self.metadata: Any = None
        self.scheduler_state: Any = None

    def corrupt(self, message: str, buffer: str | None = None) -> CheckpointCorrupt:
        where = f" (buffer {buffer})" if buffer else ""
        return CheckpointCorrupt(f"checkpoint {self.name} is damaged or not a valid flatopt "
                                 f"checkpoint{where}: {message}", path=self.name, buffer=buffer)

    def _raw(self, key: tuple[int, str], slot: str) -> np.ndarray:
        """One buffer as a fresh aligned array; HDF5 verifies its fletcher32 chunk sums."""
        saved = self.buffers[key]
        ds = saved.datasets[slot]
        out = aligned_zeros(saved.length, _DTYPES[saved.dtype])
        try:
            if saved.length:
                ds.read_direct(out)
        except Exception as exc:  # h5py reports a failed fletcher32 check as a bare OSError
            raise self.corrupt(f"reading failed ({type(exc).__name__}: {exc}); a fletcher32 "
                               "checksum mismatch means the data was damaged: use another "
                               "copy or an earlier checkpoint", buffer=ds.name) from exc
        return out

    def read(self, key: tuple[int, str], slot: str) -> np.ndarray:
        """One buffer as a fresh aligned array, its fletcher32 chunks and CRC verified."""
        saved = self.buffers[key]
        out = self._raw(key, slot)
        if _crc(out) != saved.digests[slot]:
            raise self.corrupt(f"CRC mismatch: stored {saved.digests[slot]}, data {_crc(out)}; "
                               "the data was damaged: use another copy or an earlier checkpoint",
                               buffer=saved.datasets[slot].name)
        return out

    def read_all(self, keys) -> dict[tuple[tuple[int, str], str], np.ndarray]:
        """Read and verify every slot of the given buffers; CRCs overlap the next read."""
        staged = {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = []
            for key in keys:
                saved = self.buffers[key]
                for slot, ds in saved.datasets.items():
                    out = self._raw(key, slot)
                    pending.append((key, slot, ds.name, out, pool.submit(_crc, out)))
            for key, slot, name, out, future in pending:
                digest = future.result()
                if digest != self.buffers[key].digests[slot]:
                    raise self.corrupt(f"CRC mismatch: stored {self.buffers[key].digests[slot]},"
                                       f" data {digest}; the data was damaged: use another copy "
                                       "or an earlier checkpoint", buffer=name)
                staged[key, slot] = out
        return staged


def _open(source) -> tuple[h5py.File, str, int]:
    """Open a checkpoint read-only: a path, bytes, or a binary file object."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    if hasattr(source, "read") and hasattr(source, "seek"):
        name = str(getattr(source, "name", "<in-memory checkpoint>"))
        try:
            source.seek(0, os.SEEK_END)
            size = source.tell()
            source.seek(0)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
        target = source
    else:
        try:
            name = os.fspath(source)
        except TypeError:
            raise CheckpointError(f"a checkpoint is a path, bytes or a binary file object, got "
                                  f"{type(source).__name__}") from None
        if isinstance(name, bytes):
            name = os.fsdecode(name)
        try:
            st = os.stat(name)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint at {name}: the file does not exist",
                                  path=name) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
        if not os.path.isfile(name):
            raise CheckpointError(f"cannot read checkpoint {name}: not a regular file",
                                  path=name)
        size = st.st_size
        target = name
    if size < 8:
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt checkpoint:"
                                f" it is {size} bytes long, not an HDF5 file", path=name)
    try:
        file = h5py.File(target, "r")
    except BlockingIOError as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: it is locked by another process "
                              f"that is writing it ({exc})", path=name) from exc
    except PermissionError as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    except Exception as exc:
        text = str(exc)
        if "signature not found" in text:
            why = "not an HDF5 file"
        elif "truncated file" in text:
            why = "truncated (incomplete copy or interrupted write)"
        elif "already open for write" in text:
            why = ("it was never closed by its writer (a crashed save; a file flatopt saved "
                   "would have been renamed into place only when complete; h5clear -s clears "
                   "the flag, but the data may be incomplete)")
        else:
            why = "the HDF5 library cannot open it"
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt checkpoint:"
                                f" {why} ({type(exc).__name__}: {text})", path=name) from exc
    return file, name, size


def _member(ck: _Contents, parent: h5py.Group, name: str, want: str):
    """A hard-linked child that is a group or a plain, local dataset; nothing else."""
    where = f"{parent.name.rstrip('/')}/{name}"
    link = parent.get(name, getlink=True)
    if isinstance(link, h5py.SoftLink):
        raise ck.corrupt(f"{where} is a soft link to {link.path!r}; checkpoints hold no links")
    if isinstance(link, h5py.ExternalLink):
        raise ck.corrupt(f"{where} is an external link to {link.filename!r}; checkpoints never "
                         "read other files")
    if not isinstance(link, h5py.HardLink):
        raise ck.corrupt(f"{where} is an unknown kind of link")
    obj = parent[name]
    if len(obj.attrs) > _MAX_ATTRS:
        raise ck.corrupt(f"{where} has {len(obj.attrs)} attributes (at most {_MAX_ATTRS})")
    if want == "group":
        if not isinstance(obj, h5py.Group):
            raise ck.corrupt(f"{where} should be a group")
        if len(obj) > _MAX_MEMBERS:
            raise ck.corrupt(f"{where} has {len(obj)} members (at most {_MAX_MEMBERS})")
        return obj
    if not isinstance(obj, h5py.Dataset):
        raise ck.corrupt(f"{where} should be a dataset")
    if obj.is_virtual:
        raise ck.corrupt(f"{where} is a virtual dataset; checkpoints never read other files",
                         buffer=where)
    if obj.external:
        raise ck.corrupt(f"{where} uses external storage {obj.external!r}; checkpoints never "
                         "read other files", buffer=where)
    plist = obj.id.get_create_plist()
    for k in range(plist.get_nfilters()):
        filter_id = plist.get_filter(k)[0]
        if filter_id != _FLETCHER32:
            raise ck.corrupt(f"{where} uses HDF5 filter {filter_id}; only fletcher32 is allowed",
                             buffer=where)
    return obj


def _attr(ck: _Contents, obj, name: str, kind: type, *, required: bool = True):
    where = f"{obj.name}" if obj.name != "/" else "the root"
    if name not in obj.attrs:
        if required:
            raise ck.corrupt(f"attribute {name!r} is missing from {where}")
        return None
    # Check the stored type before reading: variable-length data is never read.
    aid = obj.attrs.get_id(name)
    dtype = aid.dtype
    if aid.shape != ():
        raise ck.corrupt(f"attribute {name!r} of {where} should be a scalar")
    if kind is str:
        if dtype.kind != "S":
            raise ck.corrupt(f"attribute {name!r} of {where} should be a fixed-length string, "
                             f"is {dtype}")
        if dtype.itemsize > _MAX_JSON:
            raise ck.corrupt(f"attribute {name!r} of {where} is too long")
        value = obj.attrs[name]
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ck.corrupt(f"attribute {name!r} of {where} is not UTF-8") from None
    if dtype.kind not in "iu" or dtype.itemsize > 8:
        raise ck.corrupt(f"attribute {name!r} of {where} should be an integer, is {dtype}")
    return int(obj.attrs[name])


def _read_column(ck: _Contents, ds: h5py.Dataset, dtype, rows: int | None) -> list:
    where = ds.name
    if dtype == "shape":
        if (ds.ndim != 2 or ds.dtype != np.dtype("<i8") or not 1 <= ds.shape[1] <= _MAX_NDIM
                or ds.shape[0] != rows or ds.shape[0] * ds.shape[1] * 8 > ck.size):
            raise ck.corrupt(f"index column {where} should be an int64 array of {rows} rows and "
                             f"at most {_MAX_NDIM} columns, is {ds.dtype} {ds.shape}")
        return [[int(d) for d in row] for row in ds[...]]
    if ds.ndim != 1:
        raise ck.corrupt(f"index column {where} should be 1-D, has shape {ds.shape}")
    n = ds.shape[0]
    if rows is not None and n != rows:
        raise ck.corrupt(f"index column {where} has {n} rows, other columns have {rows}")
    if n * 8 > ck.size:
        raise ck.corrupt(f"index column {where} declares {n} rows, more than a file of "
                         f"{ck.size} bytes can hold")
    if dtype == "str":
        if ds.dtype.kind != "S" or n * ds.dtype.itemsize > ck.size:
            raise ck.corrupt(f"index column {where} should hold fixed-length strings, holds "
                             f"{ds.dtype}")
        values = []
        for item in ds[...]:
            try:
                values.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError:
                raise ck.corrupt(f"index column {where} holds a string that is not "
                                 "UTF-8") from None
        return values
    if ds.dtype != dtype:
        raise ck.corrupt(f"index column {where} should be {np.dtype(dtype)}, is {ds.dtype}")
    return [int(v) for v in ds[...]]


def _text_dataset(ck: _Contents, parent, name: str) -> str:
    if name not in parent:
        raise ck.corrupt(f"{name} is missing")
    ds = _member(ck, parent, name, "dataset")
    if ds.shape != () or ds.dtype.kind != "S" or ds.dtype.itemsize > min(_MAX_JSON, ck.size):
        raise ck.corrupt(f"/{name} should be a fixed-length string, is {ds.dtype} {ds.shape}")
    try:
        return bytes(ds[()]).decode("utf-8")
    except UnicodeDecodeError:
        raise ck.corrupt(f"/{name} is not UTF-8") from None


def _parse(file: h5py.File, name: str, size: int) -> _Contents:
    ck = _Contents(name, file, size)
    root = file
    if len(root.attrs) > _MAX_ATTRS:
        raise ck.corrupt(f"the root has {len(root.attrs)} attributes (at most {_MAX_ATTRS})")
    fmt = _attr(ck, root, "format", str, required=False)
    if fmt != FORMAT:
        raise ck.corrupt(f"format is {fmt!r}, not {FORMAT!r}: not a flatopt checkpoint")
    version = _attr(ck, root, "format_version", int)
    if version > FORMAT_VERSION:
        difference = Difference("format", "file", saved=version, live=FORMAT_VERSION,
                                note="the file is newer than this flatopt; upgrade flatopt")
        raise CheckpointMismatch(
            f"checkpoint {name} has format version {version}, but this flatopt reads format "
            f"versions up to {FORMAT_VERSION}: upgrade flatopt to load it",
            path=name, differences=[difference])
    if version < 1:
        raise ck.corrupt(f"format_version {version} is not a valid version")
    digest = _attr(ck, root, "digest", str, required=False)
    if digest is None:
        raise ck.corrupt("it has no commit digest, so the save that wrote it did not finish "
                         "(an interrupted or crashed save); the previous checkpoint, if any, "
                         "is the one to use")
    header: dict[str, Any] = {}
    for key in ("flatopt_version", "h5py_version", "hdf5_version", "optimizer"):
        header[key] = _attr(ck, root, key, str)
    header["format"] = fmt
    header["format_version"] = version
    for key in ("metadata", "scheduler"):
        if key in root or key == "metadata":
            header[key] = _text_dataset(ck, root, key)
    known_attrs = {"format", "format_version", "digest", "flatopt_version",
                   "h5py_version", "hdf5_version", "optimizer"}
    extra = sorted(set(root.attrs) - known_attrs)
    if extra:
        raise ck.corrupt(f"unexpected root attributes {extra}")
    ck.header = header
    kind = _KINDS.get(header["optimizer"])
    if kind is None:
        raise ck.corrupt(f"unknown optimizer kind {header['optimizer']!r} (this flatopt knows "
                         f"{', '.join(_KINDS)})")
    ck.kind = kind
    members = set(root)
    if members - {"scheduler"} != {"index", "groups", "metadata"}:
        raise ck.corrupt(f"the root should hold 'index', 'groups', 'metadata' and maybe "
                         f"'scheduler', holds {sorted(members)[:10]}")

    # ---- index columns (small), read completely
    index = _member(ck, root, "index", "group")
    expected = {**_BASE_COLUMNS, **kind.per_param}
    if set(index) != set(expected):
        raise ck.corrupt(f"index columns are {sorted(index)[:20]}, expected {sorted(expected)}")
    columns: dict[str, list] = {}
    rows = None
    for column, dtype in expected.items():
        ds = _member(ck, index, column, "dataset")
        columns[column] = _read_column(ck, ds, dtype, rows)
        rows = len(columns[column])
    shapes = []
    for row, (ndim, padded) in enumerate(zip(columns["ndim"], columns["shape"])):
        if not 0 <= ndim <= len(padded) or any(d != -1 for d in padded[ndim:]):
            raise ck.corrupt(f"index row {row}: ndim {ndim} disagrees with its padded shape")
        shapes.append(tuple(padded[:ndim]))
    columns["shape"] = shapes

    # ---- groups and buffer datasets (attributes only; no data read yet)
    groups_obj = _member(ck, root, "groups", "group")
    n_groups = len(groups_obj)
    if set(groups_obj) != {str(k) for k in range(n_groups)}:
        raise ck.corrupt(f"groups are named {sorted(groups_obj)[:10]}, expected 0..{n_groups - 1}")
    raw_groups = []
    buffer_table: dict[str, list] = {}
    declared_bytes = 0
    for number in range(n_groups):
        g = _member(ck, groups_obj, str(number), "group")
        hyper_text = _attr(ck, g, "hyperparameters", str)
        label = _attr(ck, g, "label", str, required=False)
        if set(g.attrs) - {"hyperparameters", "label"}:
            raise ck.corrupt(f"{g.name} has unexpected attributes")
        raw_groups.append({"hyperparameters": hyper_text, "label": label})
        for dtype_name in g:
            if dtype_name not in _DTYPES:
                raise ck.corrupt(f"{g.name}/{dtype_name}: buffers are float32 or float64")
            b = _member(ck, g, dtype_name, "group")
            length = _attr(ck, b, "length", int)
            if set(b.attrs) != {"length"}:
                raise ck.corrupt(f"{b.name} has unexpected attributes")
            if length < 0:
                raise ck.corrupt(f"{b.name} declares a negative length {length}")
            datasets, digests = {}, {}
            for slot in b:
                if slot not in ("params", *kind.slots):
                    raise ck.corrupt(f"{b.name}/{slot} is not a {kind.name} buffer (expected "
                                     f"params, {', '.join(kind.slots)})")
                ds = _member(ck, b, slot, "dataset")
                where = ds.name
                if ds.dtype != _DTYPES[dtype_name]:
                    raise ck.corrupt(f"dtype {ds.dtype} is not {dtype_name}", buffer=where)
                if ds.shape != (length,):
                    raise ck.corrupt(f"shape {ds.shape} disagrees with the declared length "
                                     f"{length}", buffer=where)
                nbytes = length * _DTYPES[dtype_name].itemsize
                declared_bytes += nbytes
                if declared_bytes > size:
                    raise ck.corrupt(f"declares {declared_bytes} bytes of buffers, more than the "
                                     f"file's {size} bytes", buffer=where)
                if length and ds.id.get_storage_size() < nbytes:
                    raise ck.corrupt(f"only {ds.id.get_storage_size()} of {nbytes} bytes are "
                                     "stored (an incomplete write)", buffer=where)
                digest_attr = _attr(ck, ds, "digest", str)
                if set(ds.attrs) != {"digest"} or not re.fullmatch(r"crc32:[0-9a-f]{8}",
                                                                    digest_attr):
                    raise ck.corrupt(f"bad digest attribute {digest_attr!r}", buffer=where)
                datasets[slot] = ds
                digests[slot] = digest_attr
                buffer_table[where] = [ds.dtype.name, int(length), digest_attr]
            if "params" not in datasets:
                raise ck.corrupt(f"{b.name} has no params dataset")
            ck.buffers[number, dtype_name] = _SavedBuffer(number, dtype_name, length, datasets,
                                                          digests)

    # ---- the commit digest covers every attribute, the whole index and every buffer CRC
    if _manifest_digest(header, raw_groups, columns, buffer_table) != digest:
        raise ck.corrupt("its metadata digest does not match (attributes or index were modified "
                         "or damaged)")

    # ---- semantic checks, all before any buffer data is read
    _check_semantics(ck, columns, raw_groups)
    return ck


def _check_semantics(ck: _Contents, columns: dict[str, list], raw_groups: list[dict]) -> None:
    kind = ck.kind
    for number, raw in enumerate(raw_groups):
        try:
            values = json.loads(raw["hyperparameters"])
        except ValueError as exc:
            raise ck.corrupt(f"group {number} hyperparameters are not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ck.corrupt(f"group {number} hyperparameters are not a dict")
        where = f"saved param group {number}"
        problems = _hyper.unknown_key_problems(values, kind.cls.hyperparameters, where,
                                               allowed=("initial_lr",))
        missing = [key for key in kind.cls.hyperparameters if key not in values]
        if missing:
            problems.append(f"{where}: hyperparameters {missing} are missing")
        normal, value_problems = _hyper.check_values(values, kind.cls.hyperparameters, where,
                                                     kind.cls._cross_check)
        problems += value_problems
        if "initial_lr" in values:
            try:
                normal["initial_lr"] = _hyper.non_negative(values["initial_lr"])
            except _hyper.Invalid as exc:
                problems.append(f"{where}: initial_lr {exc}")
        if problems:
            raise ck.corrupt("; ".join(problems))
        ck.groups.append({"hyperparameters": normal, "label": raw["label"]})
    for key in ("metadata", "scheduler"):
        if key in ck.header:
            try:
                value = json.loads(ck.header[key])
            except ValueError as exc:
                raise ck.corrupt(f"{key} is not valid JSON: {exc}") from None
            setattr(ck, "scheduler_state" if key == "scheduler" else "metadata", value)

    n = len(columns["id"])
    ids = set()
    for row in range(n):
        path = columns["path"][row]
        shape = columns["shape"][row]
        size = columns["size"][row]
        entry = _SavedParam(row, columns["id"][row], path, shape, columns["dtype"][row],
                            columns["group"][row], columns["offset"][row], size,
                            {name: columns[name][row] for name in kind.per_param})
        what = f"index row {row} ({path!r})"
        if not path:
            raise ck.corrupt(f"index row {row} has an empty path")
        if path in ck.by_path:
            raise ck.corrupt(f"path {path!r} appears twice in the index")
        if entry.id < 0 or entry.id in ids:
            raise ck.corrupt(f"{what}: id {entry.id} is negative or duplicated")
        ids.add(entry.id)
        if any(d < 0 for d in shape):
            raise ck.corrupt(f"{what}: shape {shape} has a negative dimension")
        if math.prod(shape) != size:
            raise ck.corrupt(f"{what}: size {size} is not the product of shape {shape}")
        if entry.dtype not in _DTYPES:
            raise ck.corrupt(f"{what}: dtype {entry.dtype!r} is not float32 or float64")
        buffer = ck.buffers.get((entry.group, entry.dtype))
        if buffer is None:
            raise ck.corrupt(f"{what}: group {entry.group} has no {entry.dtype} buffer")
        if entry.offset < 0 or entry.offset + size > buffer.length:
            raise ck.corrupt(f"{what}: elements [{entry.offset}, {entry.offset + size}) lie "
                             f"outside its buffer of {buffer.length}")
        for name, value in entry.per_param.items():
            if value < 0 or (kind.per_param[name] == np.dtype("u1") and value > 1):
                raise ck.corrupt(f"{what}: {name} = {value} is invalid")
        ck.params.append(entry)
        ck.by_path[path] = entry
        buffer.members.append(entry)
    for key, buffer in ck.buffers.items():
        if not buffer.members:
            raise ck.corrupt(f"group {key[0]} has a {key[1]} buffer that no index entry uses")
        buffer.members.sort(key=lambda e: (e.offset, e.size))
        end = 0
        for entry in buffer.members:
            if entry.offset < end:
                raise ck.corrupt(f"{entry.path!r} overlaps the previous parameter in its buffer")
            end = entry.offset + entry.size
        # flatopt's packing is canonical: aligned, in order, no gaps, nothing after the end
        offsets, length = aligned_offsets([e.size for e in buffer.members], _DTYPES[key[1]])
        if length != buffer.length or any(int(o) != e.offset
                                           for o, e in zip(offsets, buffer.members)):
            raise ck.corrupt(f"group {key[0]} {key[1]}: offsets or length do not follow "
                             "flatopt's aligned packing (gaps or a wrong length)")
        has_state = any(any(v for v in e.per_param.values()) for e in buffer.members)
        if has_state:
            needed = (("exp_avg", "exp_avg_sq") if kind.name != "SGD" else ("momentum_buffer",))
            if kind.name != "SGD" and ck.groups[key[0]]["hyperparameters"]["amsgrad"]:
                needed += ("max_exp_avg_sq",)
            lacking = [slot for slot in needed if slot not in buffer.datasets]
            if lacking:
                raise ck.corrupt(f"group {key[0]} {key[1]}: parameters have state but the "
                                 f"buffers {lacking} are missing")


def _parse_source(source) -> _Contents:
    file, name, size = _open(source)
    try:
        return _parse(file, name, size)
    except CheckpointError:
        file.close()
        raise
    except Exception as exc:  # anything h5py or numpy raise on a damaged file
        file.close()
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt "
                                f"checkpoint: {type(exc).__name__}: {exc}", path=name) from exc


class open_checkpoint:
    """Context manager: a checked, parsed checkpoint (for tools); data read on demand."""

    def __init__(self, source):
        self.contents = _parse_source(source)

    def __enter__(self) -> _Contents:
        return self.contents

    def __exit__(self, *exc) -> None:
        try:
            self.contents.file.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- compare
_FLAGS = ("amsgrad", "maximize", "nesterov")


def _compare(ck: _Contents, opt: Optimizer, kind: _Kind, *, strict: bool, rename,
             hyperparameters: str | None, regroup: bool, scheduler) -> tuple[list, dict]:
    diffs: list[Difference] = []
    if ck.kind.name != kind.name:
        diffs.append(Difference("optimizer", "file", ck.kind.name, kind.name,
                                note="state of one optimizer kind cannot be loaded into another"))
    # ---- rename saved paths
    mapped: dict[str, _SavedParam] = {}
    used_keys = set()
    for entry in ck.params:
        new = entry.path
        if rename is not None:
            if callable(rename):
                new = rename(entry.path)
            elif entry.path in rename:
                new = rename[entry.path]
                used_keys.add(entry.path)
            if new is None:
                continue  # dropped on purpose
            if not isinstance(new, str) or not new:
                diffs.append(Difference("rename", entry.path, entry.path, new,
                                        note="rename must give a non-empty string or None"))
                continue
        if new in mapped:
            diffs.append(Difference("rename", new, [mapped[new].path, entry.path], new,
                                    note="two saved paths map to the same path"))
            continue
        mapped[new] = entry
    if rename is not None and not callable(rename):
        for key in rename:
            if key not in used_keys:
                diffs.append(Difference("rename", str(key), None, rename[key],
                                        note="this rename entry matches no saved path"))
    # ---- paths
    matches: list[tuple[Any, _SavedParam]] = []
    partial_hint = "strict=False"
    for info in opt.index:
        entry = mapped.get(info.path)
        if entry is None:
            diffs.append(Difference("missing", info.path, None, info.shape,
                                    relaxed_by=partial_hint))
            continue
        bad = False
        if entry.shape != info.shape:
            diffs.append(Difference("shape", info.path, entry.shape, info.shape))
            bad = True
        if entry.dtype != info.dtype.name:
            diffs.append(Difference("dtype", info.path, entry.dtype, info.dtype.name))
            bad = True
        if entry.group != info.group:
            diffs.append(Difference("group", info.path, entry.group, info.group,
                                    note="the parameter moved group",
                                    relaxed_by="regroup=True"))
        elif entry.id != info.id:
            # The cross-check: reported, never blocking, since state follows the path.
            diffs.append(Difference("id", info.path, entry.id, info.id,
                                    note="built in a different order or a parameter was added "
                                         "or removed; state follows the path",
                                    relaxed_by="path matching"))
        if not bad:
            matches.append((info, entry))
    live_paths = set(opt.index.paths)
    unused = [path for path in mapped if path not in live_paths]
    for path in unused:
        diffs.append(Difference("unexpected", path, mapped[path].shape, None,
                                relaxed_by=partial_hint))
    if len(ck.groups) != len(opt.param_groups):
        diffs.append(Difference("groups", "file", len(ck.groups), len(opt.param_groups),
                                note="number of param groups", relaxed_by="regroup=True"))
    # ---- hyperparameters, per live group, against every saved group its parameters came from
    contributors: list[set[int]] = [set() for _ in opt.param_groups]
    for info, entry in matches:
        contributors[info.group].add(entry.group)
    if not regroup:
        for number in range(min(len(ck.groups), len(opt.param_groups))):
            contributors[number].add(number)
    live_settings = opt._group_settings()
    new_settings: list[dict | None] = [None] * len(opt.param_groups)
    hyper_hint = "hyperparameters='saved' or 'live'"
    for number, group in enumerate(opt.param_groups):
        where = _hyper.describe_group(number, group)
        live = dict(live_settings[number])
        if "initial_lr" in group:
            live["initial_lr"] = group["initial_lr"]
        chosen: dict[str, Any] = {}
        for saved_number in sorted(contributors[number]):
            saved = ck.groups[saved_number]["hyperparameters"]
            label = (f" (saved group {saved_number})"
                     if saved_number != number or regroup else "")
            for key in sorted(set(saved) | set(live)):
                if kind.name != ck.kind.name and key not in kind.cls.hyperparameters:
                    continue
                s, l = saved.get(key), live.get(key)
                if s != l:
                    diffs.append(Difference("flag" if key in _FLAGS else "hyperparameter",
                                            f"{where} {key}{label}", s, l,
                                            relaxed_by=hyper_hint))
                if hyperparameters == "saved" and key in saved:
                    if key in chosen and chosen[key] != s:
                        diffs.append(Difference(
                            "hyperparameter", f"{where} {key}", chosen[key], s,
                            note="its parameters come from saved groups that disagree; use "
                                 "hyperparameters='live'"))
                    chosen[key] = s
        if hyperparameters == "saved" and chosen:
            new_settings[number] = chosen
    # ---- scheduler
    if scheduler is not None and ck.scheduler_state is None:
        diffs.append(Difference("scheduler", "file", None, type(scheduler).__name__,
                                note="the checkpoint holds no scheduler state",
                                relaxed_by="strict=False"))
    plan = {"matches": matches, "unused": unused, "new_settings": new_settings}
    return diffs, plan


def _is_relaxed(diff: Difference, *, strict: bool, hyperparameters, regroup: bool) -> bool:
    if diff.relaxed_by == "path matching":
        return True
    if diff.relaxed_by == "strict=False":
        return not strict
    if diff.relaxed_by == "regroup=True":
        return regroup
    if diff.relaxed_by and diff.relaxed_by.startswith("hyperparameters="):
        return hyperparameters in ("saved", "live")
    return False


def _mismatch_message(name: str, opt: Optimizer, blocking: list, relaxed: list) -> str:
    lines = [f"checkpoint {name} does not match this {type(opt).__name__} optimizer: "
             f"{len(blocking)} difference{'s' if len(blocking) != 1 else ''}; nothing was "
             "loaded, the optimizer is unchanged"]
    limit = 200
    for diff in blocking[:limit]:
        lines.append(f"  {diff}")
    if len(blocking) > limit:
        lines.append(f"  ... and {len(blocking) - limit} more (see .differences)")
    if relaxed:
        lines.append(f"accepted by the options given: {len(relaxed)} more")
    hints = sorted({d.relaxed_by for d in blocking
                    if d.relaxed_by and d.relaxed_by != "path matching"})
    if hints:
        lines.append("options that accept some of these: " + "; ".join(hints) +
                     "; rename={old: new} (or a function) maps refactored paths")
    return "\n".join(lines)


# --------------------------------------------------------------------------- load
def load(source, opt: Optimizer, *, strict: bool = True,
         rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
         hyperparameters: str | None = None, regroup: bool = False,
         scheduler: Any = None) -> LoadResult:
    """Load a checkpoint into ``opt`` in place, matched by path, never by position.

    The whole file is verified (structure, sizes, digests, every buffer's CRC) and compared
    with ``opt`` first; every difference is reported in one :class:`CheckpointMismatch`, and
    on any error ``opt`` is left exactly as it was. Options, each accepting only its own kind of
    difference:

    - ``strict=False``: partial loading; parameters missing from the file keep their values
      and get fresh state, saved parameters the optimizer lacks are ignored (see the result),
      and parameter ids are not cross-checked.
    - ``rename``: ``{saved_path: new_path}`` or a function ``saved_path -> new_path | None``
      (None drops that saved parameter) for refactored models.
    - ``hyperparameters``: None (default) reports differing hyperparameters as mismatches;
      ``"saved"`` takes them from the file (torch's behaviour), ``"live"`` keeps the
      optimizer's own.
    - ``regroup=True``: the optimizer may group parameters differently; state follows the path.

    ``source`` is a path, bytes or a binary file object. With ``scheduler``, its
    ``load_state_dict`` receives the saved scheduler state. Returns a :class:`LoadResult`.
    """
    if hyperparameters not in (None, "saved", "live"):
        raise ValueError(f"hyperparameters must be None, 'saved' or 'live', got "
                         f"{hyperparameters!r}")
    if rename is not None and not callable(rename) and not isinstance(rename, Mapping):
        raise TypeError(f"rename must be a dict or a function, got {type(rename).__name__}")
    kind = _kind_of(opt)
    with open_checkpoint(source) as ck:
        diffs, plan = _compare(ck, opt, kind, strict=strict, rename=rename,
                               hyperparameters=hyperparameters, regroup=regroup,
                               scheduler=scheduler)
        relaxed, blocking = [], []
        for diff in diffs:
            accepted = _is_relaxed(diff, strict=strict, hyperparameters=hyperparameters,
                                   regroup=regroup)
            (relaxed if accepted else blocking).append(diff)
        if blocking:
            raise CheckpointMismatch(_mismatch_message(ck.name, opt, blocking, relaxed),
                                     path=ck.name, differences=diffs)
        matches = plan["matches"]
        new_settings = plan["new_settings"]
        checked: list[dict | None] = [None] * len(new_settings)
        problems = []
        for number, values in enumerate(new_settings):
            if values:
                where = _hyper.describe_group(number, opt.param_groups[number])
                merged = {**opt.param_groups[number], **values}
                normal, value_problems = _hyper.check_values(merged, kind.cls.hyperparameters,
                                                             where, kind.cls._cross_check)
                problems += value_problems
                if "initial_lr" in values:
                    normal["initial_lr"] = values["initial_lr"]
                checked[number] = normal
        if problems:
            raise CheckpointMismatch("\n".join(problems), path=ck.name)
        needed = sorted({(entry.group, entry.dtype) for _, entry in matches})
        try:
            staged = ck.read_all(needed)
        except CheckpointError:
            raise
        except Exception as exc:
            raise ck.corrupt(f"{type(exc).__name__}: {exc}") from exc
        if scheduler is not None and ck.scheduler_state is not None:
            try:
                scheduler.load_state_dict(ck.scheduler_state)
            except Exception as exc:
                raise CheckpointError(f"checkpoint {ck.name}: scheduler.load_state_dict() "
                                      f"failed: {exc}; the optimizer is unchanged",
                                      path=ck.name) from exc
        _apply(opt, kind, ck, matches, staged, checked)
        loaded = {info.path for info, _ in matches}
        return LoadResult(path=ck.name, loaded=[p for p in opt.index.paths if p in loaded],
                          fresh=[p for p in opt.index.paths if p not in loaded],
                          unused=plan["unused"], differences=relaxed, metadata=ck.metadata,
                          scheduler_state=ck.scheduler_state, info=dict(ck.header))


def _apply(opt: Optimizer, kind: _Kind, ck: _Contents, matches, staged, settings) -> None:
    """Copy verified data into the optimizer. Everything that can fail has been done."""
    by_buffer: dict[int, list] = {}
    for info, entry in matches:
        by_buffer.setdefault(info.buffer, []).append((info, entry))
    # Allocate every state buffer first, so nothing changes if memory runs out.
    allocations: dict[tuple[int, str], np.ndarray] = {}
    for number, pairs in by_buffer.items():
        buf = opt.buffers[number]
        for _, entry in pairs:
            for slot in ck.buffers[entry.group, entry.dtype].datasets:
                if slot != "params" and slot not in buf.state and (number, slot) not in allocations:
                    allocations[number, slot] = aligned_zeros(buf.length, buf.dtype)
    for number, values in enumerate(settings):
        if values:
            opt.param_groups[number].update(values)
    for (number, slot), flat in allocations.items():
        opt.buffers[number].state[slot] = flat
    for buf in opt.buffers:
        pairs = by_buffer.get(buf.number, [])
        saved_keys = {(entry.group, entry.dtype) for _, entry in pairs}
        if len(saved_keys) == 1 and len(pairs) == len(buf):
            key = next(iter(saved_keys))
            saved = ck.buffers[key]
            ordered = sorted(pairs, key=lambda pair: pair[0].slot)
            same = (saved.length == buf.length and len(saved.members) == len(buf)
                    and all(info.slot == k and info.offset == entry.offset
                            and saved.members[k] is entry
                            for k, (info, entry) in enumerate(ordered)))
            if same:  # identical layout: whole-buffer copies
                np.copyto(buf.params, staged[key, "params"])
                for slot, flat in buf.state.items():
                    if (key, slot) in staged:
                        np.copyto(flat, staged[key, slot])
                    else:
                        flat.fill(0)
                for name in kind.per_param:
                    column = buf.per_param[name]
                    for info, entry in pairs:
                        column[info.slot] = entry.per_param[name]
                continue
        opt._clear_param_state(buf)
        for flat in buf.state.values():
            flat.fill(0)
        for info, entry in pairs:
            key = (entry.group, entry.dtype)
            s, n = entry.offset, entry.size
            d = info.offset
            buf.params[d:d + n] = staged[key, "params"][s:s + n]
            for slot, flat in buf.state.items():
                if (key, slot) in staged:
                    flat[d:d + n] = staged[key, slot][s:s + n]
            for name in kind.per_param:
                buf.per_param[name][info.slot] = entry.per_param[name]

