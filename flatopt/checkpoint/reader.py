"""Opening a checkpoint and reading its structure, refusing hostile files before anything is
allocated: external storage, links, virtual datasets, unknown filters, variable-length data,
sizes the file cannot hold. The commit digest is checked before the contents are interpreted
(``validate``), so a sound file from a newer flatopt is told apart from a damaged one."""

from __future__ import annotations

import concurrent.futures
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from .._layout import aligned_zeros
from ..errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch
from ..schema import Schema
from .files import file_name
from .format import (BASE_COLUMNS, DTYPES, FLETCHER32, FORMAT, FORMAT_VERSION, MAX_ATTRS,
                     MAX_JSON, MAX_MEMBERS, MAX_NDIM, ROOT_ATTRS, crc, manifest_digest)


@dataclass
class SavedParam:
    row: int
    id: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    group: int
    offset: int
    size: int
    columns: dict[str, int]
    """The schema's persisted per-parameter columns (Adam: step)."""


@dataclass
class SavedBuffer:
    group: int
    dtype: str
    length: int
    datasets: dict[str, Any]   # slot -> h5py.Dataset
    digests: dict[str, str]
    members: list[SavedParam] = field(default_factory=list)  # in offset order


class Contents:
    """A checkpoint whose structure, sizes, digest and meaning have been checked; buffer data
    is read on demand (:meth:`read`, :meth:`read_all`), its checksums verified as it is."""

    def __init__(self, name: str, file: h5py.File, size: int):
        self.name = name
        self.file = file
        self.size = size
        self.header: dict[str, Any] = {}
        self.schema: Schema | None = None
        self.groups: list[dict] = []     # {"hyperparameters": normalised values, "label"}
        self.params: list[SavedParam] = []
        self.by_path: dict[str, SavedParam] = {}
        self.buffers: dict[tuple[int, str], SavedBuffer] = {}
        self.metadata: Any = None
        self.scheduler_state: Any = None
        self.raw_columns: dict[str, list] = {}
        self.raw_groups: list[dict] = []

    def corrupt(self, message: str, buffer: str | None = None) -> CheckpointCorrupt:
        where = f" (buffer {buffer})" if buffer else ""
        return CheckpointCorrupt(f"checkpoint {self.name} is damaged or not a valid flatopt "
                                 f"checkpoint{where}: {message}", path=self.name, buffer=buffer)

    def newer(self, what: str) -> CheckpointMismatch:
        """A sound file (its digest matches) holding something this flatopt does not know."""
        from .compare import Difference
        version = self.header.get("flatopt_version", "?")
        return CheckpointMismatch(
            f"checkpoint {self.name} was written by flatopt {version} and holds {what}, which "
            "this flatopt does not know: upgrade flatopt to load it (or register the optimizer "
            "that wrote it)", path=self.name,
            differences=[Difference("format", "file", saved=what, live=None,
                                    note="written by a newer flatopt; upgrade flatopt")])

    def _raw(self, key: tuple[int, str], slot: str) -> np.ndarray:
        """One buffer as a fresh aligned array; HDF5 verifies its fletcher32 chunk sums."""
        saved = self.buffers[key]
        ds = saved.datasets[slot]
        out = aligned_zeros(saved.length, DTYPES[saved.dtype])
        try:
            if saved.length:
                ds.read_direct(out)
        except Exception as exc:  # h5py reports a failed fletcher32 check as a bare OSError
            raise self.corrupt(f"reading failed ({type(exc).__name__}: {exc}); a fletcher32 "
                               "checksum mismatch means the data was damaged: use another "
                               "copy or an earlier checkpoint", buffer=ds.name) from exc
        return out

    def _check_crc(self, key, slot: str, digest: str) -> None:
        saved = self.buffers[key]
        if digest != saved.digests[slot]:
            raise self.corrupt(f"CRC mismatch: stored {saved.digests[slot]}, data {digest}; "
                               "the data was damaged: use another copy or an earlier checkpoint",
                               buffer=saved.datasets[slot].name)

    def read(self, key: tuple[int, str], slot: str) -> np.ndarray:
        """One buffer as a fresh aligned array, its fletcher32 chunks and CRC verified."""
        out = self._raw(key, slot)
        self._check_crc(key, slot, crc(out))
        return out

    def read_all(self, keys=None) -> dict[tuple[tuple[int, str], str], np.ndarray]:
        """Read and verify every slot of the given buffers (all by default); CRCs overlap the
        next read."""
        staged = {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = []
            for key in sorted(self.buffers) if keys is None else keys:
                for slot in self.buffers[key].datasets:
                    out = self._raw(key, slot)
                    pending.append((key, slot, out, pool.submit(crc, out)))
            for key, slot, out, future in pending:
                self._check_crc(key, slot, future.result())
                staged[key, slot] = out
        return staged


def open_file(source) -> tuple[h5py.File, str, int]:
    """Open a checkpoint read-only: a path, bytes, or a binary file object."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    if hasattr(source, "read") and hasattr(source, "seek"):
        return _open_object(source)
    name = file_name(source, "a checkpoint is a path, bytes or a binary file object")
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {name}: the file does not exist",
                              path=name) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {name!r}: {exc}", path=name) from exc
    if not os.path.isfile(name):
        raise CheckpointError(f"cannot read checkpoint {name}: not a regular file", path=name)
    return _h5_open(name, name, st.st_size)


def _open_object(source) -> tuple[h5py.File, str, int]:
    name = str(getattr(source, "name", "<in-memory checkpoint>"))
    if isinstance(source, io.TextIOBase) or "b" not in getattr(source, "mode", "b"):
        raise CheckpointError(f"cannot read checkpoint {name}: it was opened in text mode; "
                              "open it with open(path, 'rb')", path=name)
    try:
        source.seek(0, os.SEEK_END)
        size = source.tell()
        source.seek(0)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    return _h5_open(source, name, size)


def _h5_open(target, name: str, size: int) -> tuple[h5py.File, str, int]:
    if size < 8:
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt checkpoint:"
                                f" it is {size} bytes long, not an HDF5 file", path=name)
    try:
        return h5py.File(target, "r"), name, size
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


def member(ck: Contents, parent: h5py.Group, name: str, want: str):
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
    if len(obj.attrs) > MAX_ATTRS:
        raise ck.corrupt(f"{where} has {len(obj.attrs)} attributes (at most {MAX_ATTRS})")
    if want == "group":
        if not isinstance(obj, h5py.Group):
            raise ck.corrupt(f"{where} should be a group")
        if len(obj) > MAX_MEMBERS:
            raise ck.corrupt(f"{where} has {len(obj)} members (at most {MAX_MEMBERS})")
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
        if filter_id != FLETCHER32:
            raise ck.corrupt(f"{where} uses HDF5 filter {filter_id}; only fletcher32 is allowed",
                             buffer=where)
    return obj


def attr(ck: Contents, obj, name: str, kind: type, *, required: bool = True):
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
        if dtype.itemsize > MAX_JSON:
            raise ck.corrupt(f"attribute {name!r} of {where} is too long")
        try:
            return bytes(obj.attrs[name]).decode("utf-8")
        except UnicodeDecodeError:
            raise ck.corrupt(f"attribute {name!r} of {where} is not UTF-8") from None
    if dtype.kind not in "iu" or dtype.itemsize > 8:
        raise ck.corrupt(f"attribute {name!r} of {where} should be an integer, is {dtype}")
    return int(obj.attrs[name])


def read_column(ck: Contents, ds: h5py.Dataset, dtype, rows: int | None) -> list:
    """One index column: a padded int64 shape array, fixed-length strings, or numbers of
    ``dtype`` (``None``: a persisted column, integers or floats of at most 8 bytes, checked
    against the optimizer's schema later)."""
    where = ds.name
    if dtype == "shape":
        if (ds.ndim != 2 or ds.dtype != np.dtype("<i8") or not 1 <= ds.shape[1] <= MAX_NDIM
                or ds.shape[0] != rows or ds.shape[0] * ds.shape[1] * 8 > ck.size):
            raise ck.corrupt(f"index column {where} should be an int64 array of {rows} rows and "
                             f"at most {MAX_NDIM} columns, is {ds.dtype} {ds.shape}")
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
        try:
            return [bytes(item).decode("utf-8") for item in ds[...]]
        except UnicodeDecodeError:
            raise ck.corrupt(f"index column {where} holds a string that is not UTF-8") from None
    if (ds.dtype != dtype) if dtype is not None else (ds.dtype.kind not in "iuf"
                                                     or ds.dtype.itemsize > 8):
        raise ck.corrupt(f"index column {where} should be {dtype or 'numbers'}, is {ds.dtype}")
    return [v.item() for v in ds[...]]


def text_dataset(ck: Contents, parent, name: str) -> str:
    if name not in parent:
        raise ck.corrupt(f"{name} is missing")
    ds = member(ck, parent, name, "dataset")
    if ds.shape != () or ds.dtype.kind != "S" or ds.dtype.itemsize > min(MAX_JSON, ck.size):
        raise ck.corrupt(f"/{name} should be a fixed-length string, is {ds.dtype} {ds.shape}")
    try:
        return bytes(ds[()]).decode("utf-8")
    except UnicodeDecodeError:
        raise ck.corrupt(f"/{name} is not UTF-8") from None


def read_header(ck: Contents) -> str:
    """The root: format, version, library versions, optimizer; returns the commit digest."""
    root = ck.file
    if len(root.attrs) > MAX_ATTRS:
        raise ck.corrupt(f"the root has {len(root.attrs)} attributes (at most {MAX_ATTRS})")
    fmt = attr(ck, root, "format", str, required=False)
    if fmt != FORMAT:
        raise ck.corrupt(f"format is {fmt!r}, not {FORMAT!r}: not a flatopt checkpoint")
    version = attr(ck, root, "format_version", int)
    if version > FORMAT_VERSION:
        from .compare import Difference
        raise CheckpointMismatch(
            f"checkpoint {ck.name} has format version {version}, but this flatopt reads format "
            f"versions up to {FORMAT_VERSION}: upgrade flatopt to load it", path=ck.name,
            differences=[Difference("format", "file", saved=version, live=FORMAT_VERSION,
                                    note="the file is newer than this flatopt; upgrade flatopt")])
    if version < 1:
        raise ck.corrupt(f"format_version {version} is not a valid version")
    digest = attr(ck, root, "digest", str, required=False)
    if digest is None:
        raise ck.corrupt("it has no commit digest, so the save that wrote it did not finish "
                         "(an interrupted or crashed save); the previous checkpoint, if any, "
                         "is the one to use")
    extra = sorted(set(root.attrs) - set(ROOT_ATTRS))
    if extra:
        raise ck.corrupt(f"unexpected root attributes {extra}")
    header: dict[str, Any] = {}
    for key in ("flatopt_version", "h5py_version", "hdf5_version", "optimizer"):
        header[key] = attr(ck, root, key, str)
    header["format"] = fmt
    header["format_version"] = version
    schema_version = attr(ck, root, "schema_version", int, required=False)
    if schema_version is not None:
        header["schema_version"] = schema_version
    for key in ("metadata", "scheduler"):
        if key in root or key == "metadata":
            header[key] = text_dataset(ck, root, key)
    members = set(root)
    if members - {"scheduler"} != {"index", "groups", "metadata"}:
        raise ck.corrupt(f"the root should hold 'index', 'groups', 'metadata' and maybe "
                         f"'scheduler', holds {sorted(members)[:10]}")
    ck.header = header
    return digest


def read_index(ck: Contents) -> dict[str, list]:
    """Every index column (small), read completely; shapes unpadded."""
    index = member(ck, ck.file, "index", "group")
    if len(index.attrs):
        raise ck.corrupt(f"/index has unexpected attributes {sorted(index.attrs)[:5]}")
    missing = sorted(set(BASE_COLUMNS) - set(index))
    if missing:
        raise ck.corrupt(f"index columns {missing} are missing")
    columns: dict[str, list] = {}
    rows = None
    for column in [*BASE_COLUMNS, *sorted(set(index) - set(BASE_COLUMNS))]:
        ds = member(ck, index, column, "dataset")
        if len(ds.attrs):
            raise ck.corrupt(f"{ds.name} has unexpected attributes {sorted(ds.attrs)[:5]}")
        columns[column] = read_column(ck, ds, BASE_COLUMNS.get(column), rows)
        rows = len(columns[column])
    shapes = []
    for row, (ndim, padded) in enumerate(zip(columns["ndim"], columns["shape"])):
        if not 0 <= ndim <= len(padded) or any(d != -1 for d in padded[ndim:]):
            raise ck.corrupt(f"index row {row}: ndim {ndim} disagrees with its padded shape")
        shapes.append(tuple(padded[:ndim]))
    columns["shape"] = shapes
    return columns


_DIGEST = re.compile(r"crc32:[0-9a-f]{8}")


def read_groups(ck: Contents) -> dict[str, list]:
    """Group attributes and buffer datasets (attributes only: no data read); returns the
    buffer table the commit digest covers."""
    groups_obj = member(ck, ck.file, "groups", "group")
    n_groups = len(groups_obj)
    if set(groups_obj) != {str(k) for k in range(n_groups)}:
        raise ck.corrupt(f"groups are named {sorted(groups_obj)[:10]}, expected 0..{n_groups - 1}")
    table: dict[str, list] = {}
    declared = 0
    for number in range(n_groups):
        g = member(ck, groups_obj, str(number), "group")
        hyper_text = attr(ck, g, "hyperparameters", str)
        label = attr(ck, g, "label", str, required=False)
        if set(g.attrs) - {"hyperparameters", "label"}:
            raise ck.corrupt(f"{g.name} has unexpected attributes")
        ck.raw_groups.append({"hyperparameters": hyper_text, "label": label})
        for dtype_name in g:
            if dtype_name not in DTYPES:
                raise ck.corrupt(f"{g.name}/{dtype_name}: buffers are float32 or float64")
            b = member(ck, g, dtype_name, "group")
            length = attr(ck, b, "length", int)
            if set(b.attrs) != {"length"}:
                raise ck.corrupt(f"{b.name} has unexpected attributes")
            if length < 0:
                raise ck.corrupt(f"{b.name} declares a negative length {length}")
            datasets, digests = {}, {}
            for slot in b:
                ds = member(ck, b, slot, "dataset")
                where = ds.name
                if ds.dtype != DTYPES[dtype_name]:
                    raise ck.corrupt(f"dtype {ds.dtype} is not {dtype_name}", buffer=where)
                if ds.shape != (length,):
                    raise ck.corrupt(f"shape {ds.shape} disagrees with the declared length "
                                     f"{length}", buffer=where)
                nbytes = length * DTYPES[dtype_name].itemsize
                declared += nbytes
                if declared > ck.size:
                    raise ck.corrupt(f"declares {declared} bytes of buffers, more than the "
                                     f"file's {ck.size} bytes", buffer=where)
                if length and ds.id.get_storage_size() < nbytes:
                    raise ck.corrupt(f"only {ds.id.get_storage_size()} of {nbytes} bytes are "
                                     "stored (an incomplete write)", buffer=where)
                if set(ds.attrs) != {"digest"}:
                    raise ck.corrupt(f"unexpected attributes {sorted(ds.attrs)}", buffer=where)
                digest = attr(ck, ds, "digest", str)
                if not _DIGEST.fullmatch(digest):
                    raise ck.corrupt(f"bad digest attribute {digest!r}", buffer=where)
                datasets[slot], digests[slot] = ds, digest
                table[where] = [ds.dtype.name, int(length), digest]
            if "params" not in datasets:
                raise ck.corrupt(f"{b.name} has no params dataset")
            ck.buffers[number, dtype_name] = SavedBuffer(number, dtype_name, length, datasets,
                                                         digests)
    return table


def parse_structure(file: h5py.File, name: str, size: int) -> Contents:
    """The file's structure, read and guarded; the commit digest verified over all of it."""
    ck = Contents(name, file, size)
    digest = read_header(ck)
    columns = read_index(ck)
    table = read_groups(ck)
    if manifest_digest(ck.header, ck.raw_groups, columns, table) != digest:
        raise ck.corrupt("its metadata digest does not match (attributes or index were modified "
                         "or damaged)")
    ck.raw_columns = columns
    return ck
