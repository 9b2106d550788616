"""Opening a checkpoint and reading its structure, refusing hostile files before anything is
allocated: external storage, links, virtual datasets, unknown filters, variable-length data,
sizes the file cannot hold. The commit digest is checked before the contents are interpreted
(``validate``), so a sound file from a newer flatopt is told apart from a damaged one.

Buffer data is read on demand (:meth:`Contents.read_into`, or only the blocks that hold a range
with :meth:`Contents.read_range`): in format version 2 straight from the file's bytes into the
destination, block by block on several threads, each block's XXH3 checked as it lands; in
version 1 through HDF5 (fletcher32 per chunk) and a zlib CRC-32."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from .._layout import aligned_zeros
from ..errors import CheckpointCorrupt, CheckpointMismatch
from ..schema import Schema
from . import files
from .difference import Difference
from .format import (BASE_COLUMNS, BLOCK_BYTES, DTYPES, FLETCHER32, FORMAT, FORMAT_VERSION,
                     MAX_ATTRS, MAX_JSON, MAX_MEMBERS, MAX_NDIM, ROOT_ATTRS, crc, hashes_digest,
                     n_blocks, stored_dtype)


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
    hashes: dict[str, np.ndarray] = field(default_factory=dict)   # version 2: block hashes
    offsets: dict[str, int] = field(default_factory=dict)         # version 2: byte offsets
    lengths: dict[str, int] = field(default_factory=dict)
    """Elements of each dataset: ``length``, but a shaped slot's own (format version 3)."""
    layouts: dict[str, Any] = field(default_factory=dict)
    """Each dataset's packing of the members (a SlotLayout), set by ``validate``."""
    positions: dict[int, int] = field(default_factory=dict)
    """Index row -> the member's position in the buffer, set by ``validate``."""


@dataclass
class SavedArray:
    """An extra array (format version 2): where its bytes are and what they must hash to."""

    name: str
    dtype: np.dtype     # exactly as saved (byte order included)
    shape: tuple[int, ...]
    dataset: Any
    digest: str
    hashes: np.ndarray
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Contents:
    """A checkpoint whose structure, sizes, digest and meaning have been checked; buffer data
    is read on demand (:meth:`read`, :meth:`read_into`, :meth:`read_all`), its checksums
    verified as it is."""

    def __init__(self, name: str, file: h5py.File, size: int,
                 raw: files.RawReader | None = None):
        self.name = name
        self.file = file
        self.size = size
        self.raw = raw
        self.version = 0
        self.header: dict[str, Any] = {}
        self.schema: Schema | None = None
        self.groups: list[dict] = []     # {"hyperparameters": normalised values, "label"}
        self.params: list[SavedParam] = []
        self.by_path: dict[str, SavedParam] = {}
        self.buffers: dict[tuple[int, str], SavedBuffer] = {}
        self.arrays: dict[str, SavedArray] = {}
        self.metadata: Any = None
        self.scheduler_state: Any = None
        self.raw_columns: dict[str, list] = {}
        self.raw_groups: list[dict] = []
        self.storage: dict[str, tuple] = {}
        """Version 5: path -> (storage settings, draws, its stored arrays' names, offset)
        for parameters saved in reduced precision (``precision.interpret``)."""
        self.declared = 0   # bytes of buffers and arrays the structure declares
        self.digest: str | None = None  # the commit digest, once verified

    def corrupt(self, message: str, buffer: str | None = None) -> CheckpointCorrupt:
        where = f" (buffer {buffer})" if buffer else ""
        return CheckpointCorrupt(f"checkpoint {self.name} is damaged or not a valid flatopt "
                                 f"checkpoint{where}: {message}", path=self.name, buffer=buffer)

    def newer(self, what: str) -> CheckpointMismatch:
        """A sound file (its digest matches) holding something this flatopt does not know."""
        version = self.header.get("flatopt_version", "?")
        return CheckpointMismatch(
            f"checkpoint {self.name} was written by flatopt {version} and holds {what}, which "
            "this flatopt does not know: upgrade flatopt to load it (or register the optimizer "
            "that wrote it)", path=self.name,
            differences=[Difference("format", "file", saved=what, live=None,
                                    note="written by a newer flatopt; upgrade flatopt")])

    # ------------------------------------------------------------------ data
    def _read_hashed(self, offset: int, out: np.ndarray, hashes: np.ndarray, where: str,
                     workers, before=None, after=None) -> None:
        """Version 2: the bytes at ``offset`` into ``out``, every block's XXH3 checked
        (``before``, ``after``: see :func:`files.read_hashed`)."""
        view = files.byte_view(out)
        if not len(view):
            return
        try:
            got = files.read_hashed(self.raw, offset, view, workers, before, after)
        except (OSError, EOFError, ValueError) as exc:
            raise self.corrupt(f"reading failed ({type(exc).__name__}: {exc}); the file is "
                               "truncated or unreadable", buffer=where) from exc
        bad = np.flatnonzero(got != hashes)
        if bad.size:
            first = int(bad[0])
            raise self.corrupt(
                f"checksum mismatch in {bad.size} of {hashes.size} block(s) of "
                f"{BLOCK_BYTES >> 20} MiB (first: bytes {first * BLOCK_BYTES:,} to "
                f"{min(len(view), (first + 1) * BLOCK_BYTES):,}); the data was damaged: use "
                "another copy or an earlier checkpoint", buffer=where)

    def pieces(self, key: tuple[int, str], slot: str) -> list[tuple]:
        """Where a slot's elements are stored (version 2 and later): one ``(first, stop,
        locate)`` per stored piece, ``locate()`` giving (the Contents that reads it, byte
        offset, block hashes, name) when the piece is read. A file holds each slot whole; a
        sharded checkpoint holds it in fragments, one per rank file."""
        saved = self.buffers[key]
        return [(0, saved.lengths[slot], lambda: (self, saved.offsets[slot], saved.hashes[slot],
                                                  saved.datasets[slot].name))]

    def read_into(self, key: tuple[int, str], slot: str, out: np.ndarray,
                  workers=None, keep=None, landed=None) -> np.ndarray:
        """Buffer ``slot`` of ``key`` read into ``out`` (its length, the buffer's dtype) and
        verified: every block's XXH3 (version 2), or HDF5's fletcher32 per chunk and the
        buffer's CRC-32 (version 1). On an error ``out`` holds partial data. ``keep(start,
        stop)`` and ``landed(start, stop)``, when given, are called (on any thread, for byte
        ranges of ``out`` that together cover it once, on element boundaries) before those
        bytes are overwritten and after they have landed."""
        saved = self.buffers[key]
        if self.version >= 2:
            item = out.dtype.itemsize

            def shifted(hook, base):
                return None if hook is None else (lambda a, b: hook(base + a, base + b))
            with files.pool(None if workers is None else 1) as own:
                for first, stop, locate in self.pieces(key, slot):
                    part, offset, hashes, where = locate()
                    part._read_hashed(offset, out[first:stop], hashes, where, workers or own,
                                      shifted(keep, first * item), shifted(landed, first * item))
            return out
        ds = saved.datasets[slot]
        if keep is not None:
            keep(0, out.nbytes)
        try:
            if saved.length:
                ds.read_direct(out)
        except Exception as exc:  # h5py reports a failed fletcher32 check as a bare OSError
            raise self.corrupt(f"reading failed ({type(exc).__name__}: {exc}); a fletcher32 "
                               "checksum mismatch means the data was damaged: use another "
                               "copy or an earlier checkpoint", buffer=ds.name) from exc
        digest = crc(out)
        if digest != saved.digests[slot]:
            raise self.corrupt(f"CRC mismatch: stored {saved.digests[slot]}, data {digest}; "
                               "the data was damaged: use another copy or an earlier checkpoint",
                               buffer=ds.name)
        if landed is not None:
            landed(0, out.nbytes)
        return out

    def read_range(self, key: tuple[int, str], slot: str, start: int, stop: int,
                   workers=None) -> np.ndarray:
        """Elements ``[start, stop)`` of a slot as a fresh aligned array, verified: only the
        blocks holding them are read, each checked against its checksum (version 1 has a
        checksum per buffer: the whole buffer is read and checked)."""
        saved = self.buffers[key]
        dtype = DTYPES[saved.dtype]
        out = aligned_zeros(stop - start, dtype)
        if self.version < 2:
            out[...] = self.read(key, slot, workers)[start:stop]
            return out
        item = dtype.itemsize
        with files.pool(None if workers is None else 1) as own:
            for first, last, locate in self.pieces(key, slot):
                lo, hi = max(start, first), min(stop, last)
                if lo >= hi:
                    continue
                part, offset, hashes, where = locate()
                self._read_blocks_of(part, offset, hashes, where, (last - first) * item,
                                     (lo - first) * item, files.byte_view(out[lo - start:
                                                                              hi - start]),
                                     workers or own)
        return out

    @staticmethod
    def _read_blocks_of(part: "Contents", offset: int, hashes: np.ndarray, where: str,
                        nbytes: int, head: int, target: memoryview, workers) -> None:
        """Bytes ``[head, head + len(target))`` of a stored piece of ``nbytes`` bytes at
        ``offset`` into ``target``, reading and checking only the blocks that hold them: the
        blocks wholly inside land in ``target`` directly, a block cut by either end passes
        through a block-sized buffer."""
        tail = head + len(target)
        inner0 = -(-head // BLOCK_BYTES)
        inner1 = n_blocks(nbytes) if tail == nbytes else tail // BLOCK_BYTES
        if inner1 > inner0:
            begin, end = inner0 * BLOCK_BYTES, min(inner1 * BLOCK_BYTES, nbytes)
            part._read_hashed(offset + begin, target[begin - head:end - head],
                              hashes[inner0:inner1], where, workers)
        for block in sorted({head // BLOCK_BYTES, n_blocks(tail) - 1}):
            if inner0 <= block < inner1 or tail == head:
                continue
            begin, end = block * BLOCK_BYTES, min((block + 1) * BLOCK_BYTES, nbytes)
            staged = np.empty(end - begin, np.uint8)
            part._read_hashed(offset + begin, staged, hashes[block:block + 1], where, workers)
            low, high = max(begin, head), min(end, tail)
            target[low - head:high - head] = staged[low - begin:high - begin]

    def close(self) -> None:
        try:
            self.file.close()
        except Exception:
            pass

    def read(self, key: tuple[int, str], slot: str, workers=None) -> np.ndarray:
        """One buffer as a fresh aligned array, its checksums verified."""
        saved = self.buffers[key]
        return self.read_into(key, slot, aligned_zeros(saved.lengths[slot],
                                                       DTYPES[saved.dtype]), workers)

    def read_all(self, keys=None) -> dict[tuple[tuple[int, str], str], np.ndarray]:
        """Read and verify every slot of the given buffers (all by default)."""
        staged = {}
        with files.pool() as workers:
            for key in sorted(self.buffers) if keys is None else keys:
                for slot in self.buffers[key].datasets:
                    staged[key, slot] = self.read(key, slot, workers)
        return staged

    def read_array(self, name: str, workers=None) -> np.ndarray:
        """An extra array as a fresh array of its saved dtype and shape, verified."""
        saved = self.arrays[name]
        stored = stored_dtype(saved.dtype)
        out = np.empty(saved.shape, stored)
        with files.pool(None if workers is None else 1) as own:
            self._read_hashed(saved.offset, out, saved.hashes, saved.dataset.name,
                              workers or own)
        return out if stored == saved.dtype else out.astype(saved.dtype)

    def read_arrays(self) -> dict[str, np.ndarray]:
        with files.pool() as workers:
            return {name: self.read_array(name, workers) for name in self.arrays}


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
        if filter_id != FLETCHER32 or ck.version >= 2:
            allowed = "only fletcher32" if ck.version < 2 else "none (format version 2)"
            raise ck.corrupt(f"{where} uses HDF5 filter {filter_id}; filters allowed: "
                             f"{allowed}", buffer=where)
    return obj


def raw_offset(ck: Contents, ds: h5py.Dataset, nbytes: int) -> int:
    """Format version 2: where a dataset's bytes lie in the file, checked: contiguous storage
    of exactly ``nbytes`` bytes, inside the file."""
    where = ds.name
    if ds.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        raise ck.corrupt("its storage is not contiguous (format version 2 stores every buffer "
                         "contiguously)", buffer=where)
    if not nbytes:
        return 0
    offset = ds.id.get_offset()
    stored = ds.id.get_storage_size()
    if offset is None or stored != nbytes:
        raise ck.corrupt(f"{stored} of its {nbytes} bytes are stored (an incomplete or "
                         "altered write)", buffer=where)
    if not 0 <= offset <= ck.size - nbytes:
        raise ck.corrupt(f"its bytes [{offset}, {offset + nbytes}) lie outside the file of "
                         f"{ck.size} bytes", buffer=where)
    return int(offset)


def block_hashes(ck: Contents, ds: h5py.Dataset, nbytes: int, digest: str) -> np.ndarray:
    """Format version 2: a dataset's block checksums (attribute ``checksums``), checked against
    its digest before use."""
    where = ds.name
    if "checksums" not in ds.attrs:
        raise ck.corrupt("its block checksums are missing", buffer=where)
    aid = ds.attrs.get_id("checksums")
    want = n_blocks(nbytes)
    if aid.shape != (want,) or aid.dtype != np.dtype("<u8"):
        raise ck.corrupt(f"its checksums should be {want} uint64 values, are {aid.dtype} "
                         f"{aid.shape}", buffer=where)
    hashes = np.empty(want, np.dtype("<u8"))
    if want:
        aid.read(hashes)
    if hashes_digest(hashes) != digest:
        raise ck.corrupt("its block checksums do not match its digest (damaged attributes)",
                         buffer=where)
    return hashes.astype(np.uint64)


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


def read_header(ck: Contents, fmt_name: str = FORMAT, newest: int = FORMAT_VERSION,
                more_attrs: dict | None = None, data_version: int | None = None) -> str:
    """The root: format, version, library versions, optimizer; returns the commit digest.
    A sharded checkpoint's manifest has a format of its own (``fmt_name``, ``newest``), root
    attributes of its own (``more_attrs``: name -> str or int) and stores its data as file
    format ``data_version`` does."""
    more_attrs = more_attrs or {}
    root = ck.file
    if len(root.attrs) > MAX_ATTRS:
        raise ck.corrupt(f"the root has {len(root.attrs)} attributes (at most {MAX_ATTRS})")
    fmt = attr(ck, root, "format", str, required=False)
    if fmt != fmt_name:
        raise ck.corrupt(f"format is {fmt!r}, not {fmt_name!r}: not a flatopt checkpoint")
    version = attr(ck, root, "format_version", int)
    if version > newest:
        raise CheckpointMismatch(
            f"checkpoint {ck.name} has format version {version}, but this flatopt reads format "
            f"versions up to {newest}: upgrade flatopt to load it", path=ck.name,
            differences=[Difference("format", "file", saved=version, live=newest,
                                    note="the file is newer than this flatopt; upgrade flatopt")])
    if version < 1:
        raise ck.corrupt(f"format_version {version} is not a valid version")
    ck.version = version = version if data_version is None else data_version
    if ck.file.userblock_size:
        raise ck.corrupt(f"it has a user block of {ck.file.userblock_size} bytes; flatopt "
                         "writes none")
    digest = attr(ck, root, "digest", str, required=False)
    if digest is None:
        raise ck.corrupt("it has no commit digest, so the save that wrote it did not finish "
                         "(an interrupted or crashed save); the previous checkpoint, if any, "
                         "is the one to use")
    extra = sorted(set(root.attrs) - set(ROOT_ATTRS) - set(more_attrs))
    if extra:
        raise ck.corrupt(f"unexpected root attributes {extra}")
    header: dict[str, Any] = {}
    for key in ("flatopt_version", "h5py_version", "hdf5_version", "optimizer"):
        header[key] = attr(ck, root, key, str)
    header["format"] = fmt
    header["format_version"] = attr(ck, root, "format_version", int)
    for key, kind in more_attrs.items():
        header[key] = attr(ck, root, key, kind)
    schema_version = attr(ck, root, "schema_version", int, required=False)
    if schema_version is not None:
        header["schema_version"] = schema_version
    for key in ("metadata", "scheduler"):
        if key in root or key == "metadata":
            header[key] = text_dataset(ck, root, key)
    members = set(root)
    optional = {"scheduler", "arrays"} if version >= 2 else {"scheduler"}
    if members - optional != {"index", "groups", "metadata"}:
        raise ck.corrupt(f"the root should hold 'index', 'groups', 'metadata' and maybe "
                         f"{' and '.join(repr(k) for k in sorted(optional))}, holds "
                         f"{sorted(members)[:10]}")
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
