"""The checkpoint format: names, versions, limits, digests, JSON, and which optimizer a file
holds (through the registry). Writer and reader both take everything from here.

File layout (format ``flatopt.checkpoint`` version 2, or 3 for an optimizer with shaped
slots); every string is fixed-length UTF-8::

    /                     attrs: format, format_version, flatopt_version, h5py_version,
                                 hdf5_version, optimizer, [schema_version when above 1], digest
                                 (sha256 over every attribute, the whole index and every
                                 buffer's and array's digest; written last)
    /metadata             user metadata as JSON text (scalar string dataset)
    /scheduler            scheduler.state_dict() as JSON text (only when saved with one)
    /index/<column>       one row per parameter in id order: id, path, ndim, shape (2-D, padded
                          with -1), dtype, group, offset, size, and the optimizer's persisted
                          per-parameter columns from its schema (Adam: step; SGD:
                          momentum_initialized)
    /groups/<g>           attrs: hyperparameters (JSON), [label]
    /groups/<g>/<dtype>   attrs: length (elements, with alignment padding)
    /groups/<g>/<dtype>/<slot>   params and the schema's state slots: 1-D, contiguous, no
                          filter; attrs checksums (uint64, the XXH3-64 of each 4 MiB block)
                          and digest = "xxh3:<16 hex>" (XXH3-64 of the checksums)
    /arrays/<k>           extra arrays (save(arrays=...)), k = 0, 1, ...: any shape,
                          contiguous; attrs name, dtype (NumPy's dtype string), checksums,
                          digest

Version 3 is version 2 in which a shaped state slot (``Slot.shape``: Adafactor's row and
column factors) has its own length: its members' entries packed as the live optimizer packs
them (aligned, in offset order, none for a parameter without an entry). Only files of such
optimizers are written as version 3, so a flatopt that reads version 2 still reads the rest.

Version 4 is version 3 in which an extra array's name may be a key path: the keys of nested
``arrays=`` dicts joined by ``/`` (each key non-empty, without ``/``); no name is both an array
and a prefix of another. Top-level keys beginning ``flatopt:`` hold flatopt's own state saved
with ``save(ema=, scaler=)``: ``flatopt:ema/<g>/<dtype>`` (the EMA's averages, packed as the
group's parameter buffer), ``flatopt:ema/decay|warmup|num_updates`` and
``flatopt:scaler/<key>`` (0-d arrays). Only files with such names are written as version 4.

Version 5 is version 4 holding reduced-precision buffers (16-bit parameters, master
weights, bfloat16 or int8 state): the buffers above hold their float32 values and each such
group's attribute ``storage`` and the extra arrays ``flatopt:storage/...`` hold them as stored
(see ``flatopt.checkpoint.precision``). Only such files are written as version 5.

Version 1 (flatopt 0.1.0) stored each buffer in 1 MiB chunks with HDF5's fletcher32 filter and
attr digest = "crc32:<hex>" (zlib CRC-32 of the buffer), and had no /arrays; it is still read.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from typing import Any, Mapping

import h5py
import numpy as np
import xxhash

from .. import registry
from ..errors import CheckpointError, CheckpointOptionError
from ..schema import Schema, python_number

FORMAT = "flatopt.checkpoint"
FORMAT_VERSION = 5
"""The newest version this flatopt reads; it writes 4 only for nested extra arrays, 3 only for
shaped slots (see above)."""
PLAIN_FORMAT_VERSION = 2
SHAPED_FORMAT_VERSION = 3
NESTED_FORMAT_VERSION = 4
BLOCK_BYTES = 4 << 20     # a buffer's checksum covers one block of this many bytes (version 2)
CHUNK_BYTES = 1 << 20     # version 1: HDF5 chunk size, each with a fletcher32 sum
LIBVER = ("v110", "latest")  # superblock v3: checksummed metadata
FLETCHER32 = h5py.h5z.FILTER_FLETCHER32

DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}

# Limits a file must keep; save refuses an optimizer that would break one (see limits_problems).
MAX_ATTRS = 32
MAX_MEMBERS = 4096        # members of one HDF5 group: /groups holds one per param group
MAX_NDIM = 64             # columns of /index/shape: NumPy's own limit
MAX_ARRAY_NDIM = 32       # an extra array is a dataset of its own shape: HDF5's H5S_MAX_RANK
MAX_JSON = 16 << 20       # bytes of one JSON text (metadata, scheduler state, hyperparameters)
MAX_JSON_DEPTH = 100      # nesting of one JSON text: json.loads recurses once per level, so a
                          # deeper text would load or not depending on the caller's stack
MAX_NAME = 64 << 10       # bytes of an extra array's name (UTF-8)

BASE_COLUMNS = {"id": np.dtype("<i8"), "path": "str", "ndim": np.dtype("<i8"),
                "shape": "shape", "dtype": "str", "group": np.dtype("<i8"),
                "offset": np.dtype("<i8"), "size": np.dtype("<i8")}
"""Index columns every file has. Strings are fixed-length UTF-8 and shapes a padded 2-D array:
nothing in a checkpoint lives in HDF5's global heap, whose unchecksummed records can make HDF5
spin on a single flipped bit. "ndim" is stored alongside "shape" (padded with -1)."""

ROOT_ATTRS = ("format", "format_version", "flatopt_version", "h5py_version", "hdf5_version",
              "optimizer", "schema_version", "digest")


def schema_columns(schema: Schema) -> dict[str, Any]:
    """Index columns of a file holding this optimizer: the base ones and its persisted ones."""
    return {**BASE_COLUMNS, **{name: np.dtype(column.dtype).newbyteorder("<")
                               for name, column in schema.columns.items()}}


def schema_named(name: str) -> Schema | None:
    cls = registry.lookup(name)
    return None if cls is None else cls.schema


def limits_problems(schema: Schema, n_groups: int, shapes, texts: Mapping[str, str]) -> list[str]:
    """What in an optimizer a file cannot hold (what the reader would refuse)."""
    problems = []
    if n_groups > MAX_MEMBERS:
        problems.append(f"{n_groups} param groups: a checkpoint holds at most {MAX_MEMBERS}")
    deepest = max((len(shape) for shape in shapes), default=0)
    if deepest > MAX_NDIM:
        problems.append(f"a parameter has {deepest} dimensions: a checkpoint holds at most "
                        f"{MAX_NDIM}")
    for what, value in texts.items():
        if len(value.encode("utf-8")) > MAX_JSON:
            problems.append(f"{what} is {len(value.encode('utf-8')):,} bytes of JSON: a "
                            f"checkpoint holds at most {MAX_JSON:,}; store large data in a "
                            "separate file")
        problem = json_depth_problem(value)
        if problem:
            problems.append(f"{what} {problem}")
    return problems


def check_flags(**flags: Any) -> None:
    """Each option is True or False (a NumPy bool too), or CheckpointOptionError: "no" and 1
    are truthy, and ``strict="no"`` taken as true would be a strict load nobody asked for."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise CheckpointOptionError(f"{name} must be True or False, got {value!r}")


# ----------------------------------------------------------------------------- JSON
def json_default(value: Any) -> Any:
    number = python_number(value)
    if number is value:
        raise TypeError(f"{type(value).__name__} is not JSON-serializable")
    return number


def to_json(value: Any, what: str) -> str:
    try:
        text = json.dumps(value, default=json_default, sort_keys=True, allow_nan=True)
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deep to write as JSON: a checkpoint holds "
                              f"at most {MAX_JSON_DEPTH} levels") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} must be JSON-serializable (dicts with string keys, lists, strings, numbers, "
            f"booleans, None; numpy scalars are converted): {exc}. flatopt checkpoints never "
            "pickle; store arrays as lists or in a separate file") from None
    keys = _keys_not_strings(value)
    if keys:
        more = " and more" if len(keys) > 1 else ""
        raise CheckpointError(f"{what} has dict keys that are not strings ({keys[0]!r}{more}): "
                              "JSON would turn them into strings, so it would not load back as "
                              "saved; use string keys")
    return text


def _keys_not_strings(value: Any) -> list:
    """The dict keys in ``value`` that are not str, walked without recursion (``value`` is
    known to be JSON-serializable, so it has no cycles)."""
    found, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            found += [key for key in item if not isinstance(key, str)]
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return found


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET_STEPS = np.zeros(256, np.int8)
_BRACKET_STEPS[list(b"[{")] = 1
_BRACKET_STEPS[list(b"]}")] = -1


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of the JSON ``text`` nest, counted without
    recursion: the brackets outside strings, in C and NumPy loops."""
    outside = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass")
    steps = _BRACKET_STEPS[np.frombuffer(outside, np.uint8)]
    return int(np.cumsum(steps[steps != 0], dtype=np.int32).max(initial=0))


def json_depth_problem(text: str) -> str | None:
    """Why a JSON text is too deep for a checkpoint (save and load apply the one limit)."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        return f"is nested {depth} deep: a checkpoint holds at most {MAX_JSON_DEPTH} levels"
    return None


def jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype):
        return value.name
    return value


# ----------------------------------------------------------------------------- digests
def crc(array: np.ndarray) -> str:
    """Version 1's buffer digest: zlib CRC-32 of the whole buffer."""
    return f"crc32:{zlib.crc32(memoryview(np.ascontiguousarray(array)).cast('B')):08x}"


def hash_block(view) -> int:
    """The checksum of one block (version 2): XXH3-64, which releases the GIL, so blocks are
    hashed on several threads at once."""
    return xxhash.xxh3_64_intdigest(view)


def block_hasher():
    """A streaming :func:`hash_block`: ``update`` with a block's bytes in pieces, then
    ``intdigest()`` (the same value; the updates release the GIL too)."""
    return xxhash.xxh3_64()


def n_blocks(nbytes: int) -> int:
    return -(-int(nbytes) // BLOCK_BYTES)


def hashes_digest(hashes: np.ndarray) -> str:
    """A buffer's digest (version 2): XXH3-64 of its block checksums (little-endian uint64)."""
    raw = np.ascontiguousarray(hashes, dtype="<u8").tobytes()
    return f"xxh3:{xxhash.xxh3_64_intdigest(raw):016x}"


def manifest_digest(header: Mapping, groups: list, index: Mapping, buffers: Mapping,
                    arrays: Mapping | None = None) -> str:
    """sha256 over every attribute, the whole index and every buffer's digest (and, from
    version 2, every extra array's name, dtype, shape and digest), canonically."""
    content = {"header": dict(header), "groups": groups, "index": dict(index),
               "buffers": dict(buffers)}
    if arrays is not None:
        content["arrays"] = dict(arrays)
    text = json.dumps(content, sort_keys=True, default=json_default, allow_nan=True,
                      separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- extra arrays
ARRAY_KINDS = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8)}
"""Extra arrays hold bool, integer and float data (no object, structured, complex, string or
datetime data: nothing a reader would have to interpret, nothing pickled)."""


def array_dtype_problem(dtype: np.dtype) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None:
        return f"has a structured dtype {dtype}"
    if dtype.kind not in ARRAY_KINDS or dtype.itemsize not in ARRAY_KINDS[dtype.kind]:
        return (f"has dtype {dtype} ({dtype.str}): extra arrays hold bool, integer "
                "(8 to 64 bits) and float (16, 32, 64 bits) data; no object, structured, "
                "complex, string or datetime data (checkpoints never pickle)")
    return None


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """How an extra array's dtype is stored: little-endian."""
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


NEST = "/"
"""Joins the keys of nested ``arrays=`` dicts into one stored name (format version 4)."""
OWN_PREFIX = "flatopt:"
"""Top-level keys of extra arrays that flatopt keeps for its own state (EMA, GradScaler)."""
MAX_NESTING = 32


def array_name_problem(name: Any, nested: bool = False) -> str | None:
    """Why ``name`` cannot name an extra array: a key of a user's dict (``nested=False``) or a
    stored name (``nested=True``: keys joined by ``/``)."""
    if not isinstance(name, str):
        return f"extra array names are strings, got {type(name).__name__} {name!r}"
    keys = name.split(NEST) if nested else [name]
    if not all(keys) or "\x00" in name or (not nested and NEST in name):
        return (f"extra array name {name!r} is empty or holds a NUL or '/' (nest dicts "
                "instead of writing paths)")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return f"extra array name {name!r} cannot be encoded as UTF-8 (a lone surrogate?)"
    if len(raw) > MAX_NAME:
        return f"extra array name of {len(raw):,} bytes (at most {MAX_NAME:,})"
    return None


def flat_arrays(arrays: Mapping, problems: list, prefix: str = "", depth: int = 0) -> dict:
    """The leaves of nested ``arrays`` by stored name (keys joined by ``/``); a key path's
    problems are added to ``problems``."""
    out = {}
    if depth > MAX_NESTING:
        problems.append(f"extra arrays nest deeper than {MAX_NESTING} dicts at {prefix!r}")
        return out
    for key, value in arrays.items():
        problem = array_name_problem(key)
        if problem:
            problems.append(problem + (f" (in {prefix!r})" if prefix else ""))
            continue
        name = prefix + NEST + key if prefix else key
        if isinstance(value, Mapping):
            if not value:
                problems.append(f"extra arrays {name!r} is an empty dict (nothing to store)")
            out.update(flat_arrays(value, problems, name, depth + 1))
        else:
            out[name] = value
    return out


def nested_arrays(flat: Mapping[str, Any]) -> dict:
    """Stored names back into the nested dicts they came from (names without ``/``, as
    every file before version 4 has, stay flat)."""
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(NEST)
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def prefix_problem(names) -> str | None:
    """A stored name that is also a key path's prefix (``a`` and ``a/b``): no dict gives that."""
    known = set(names)
    for name in known:
        parts = name.split(NEST)
        for n in range(1, len(parts)):
            if NEST.join(parts[:n]) in known:
                return f"extra array {NEST.join(parts[:n])!r} is also a dict holding {name!r}"
    return None


def checked_arrays(arrays: Any, own: Mapping[str, np.ndarray] | None = None
                   ) -> dict[str, np.ndarray]:
    """``save(arrays=...)`` checked and flattened: stored name -> contiguous array of an
    allowed dtype, at most ``MAX_MEMBERS`` of them (with ``own``, flatopt's state stored
    beside them), each of at most ``MAX_ARRAY_NDIM`` dimensions. Raises CheckpointError naming
    every problem (nothing is written)."""
    if arrays is not None and not isinstance(arrays, Mapping):
        raise CheckpointError(f"arrays must be a dict {{name: ndarray or dict}}, got "
                              f"{type(arrays).__name__}")
    problems: list[str] = []
    flat = flat_arrays(arrays or {}, problems)
    problems += [f"extra array name {name!r}: top-level keys beginning {OWN_PREFIX!r} are "
                 "flatopt's own (save(ema=, scaler=))" for name in flat
                 if name.startswith(OWN_PREFIX)]
    flat.update(own or {})
    out = {}
    if len(flat) > MAX_MEMBERS:
        problems.append(f"{len(flat)} extra arrays: a checkpoint holds at most {MAX_MEMBERS}")
    for name, value in flat.items():
        if not isinstance(value, np.ndarray):
            if hasattr(value, "__array__") or isinstance(value, (list, tuple, int, float, bool)):
                try:
                    value = np.asarray(value)
                except Exception as exc:
                    problems.append(f"extra array {name!r} cannot be converted to an array: {exc}")
                    continue
            else:
                problems.append(f"extra array {name!r} is a {type(value).__name__}, not a NumPy "
                                "array")
                continue
        problem = array_dtype_problem(value.dtype)
        if problem:
            problems.append(f"extra array {name!r} {problem}")
            continue
        if value.ndim > MAX_ARRAY_NDIM:
            problems.append(f"extra array {name!r} has {value.ndim} dimensions (HDF5 stores "
                            f"at most {MAX_ARRAY_NDIM})")
            continue
        out[name] = value
    if problems:
        raise CheckpointError("cannot save these extra arrays (nothing was written): "
                              + "; ".join(problems[:20]))
    return out


def text_dtype(raw: bytes | list[bytes]) -> np.dtype:
    longest = max((len(r) for r in raw), default=0) if isinstance(raw, list) else len(raw)
    return h5py.string_dtype("utf-8", max(1, longest))
