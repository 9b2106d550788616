"""The checkpoint format: names, versions, limits, digests, JSON, and which optimizer a file
holds (through the registry). Writer and reader both take everything from here.

File layout (format ``flatopt.checkpoint`` version 1); every string is fixed-length UTF-8::

    /                     attrs: format, format_version, flatopt_version, h5py_version,
                                 hdf5_version, optimizer, [schema_version when above 1], digest
                                 (sha256 over every attribute, the whole index and every buffer
                                 CRC; written last)
    /metadata             user metadata as JSON text (scalar string dataset)
    /scheduler            scheduler.state_dict() as JSON text (only when saved with one)
    /index/<column>       one row per parameter in id order: id, path, ndim, shape (2-D, padded
                          with -1), dtype, group, offset, size, and the optimizer's persisted
                          per-parameter columns from its schema (Adam: step; SGD:
                          momentum_initialized)
    /groups/<g>           attrs: hyperparameters (JSON), [label]
    /groups/<g>/<dtype>   attrs: length (elements, with alignment padding)
    /groups/<g>/<dtype>/<slot>   params and the schema's state slots: 1-D, chunked (1 MiB),
                          fletcher32; attr digest = "crc32:<hex>"
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Mapping

import h5py
import numpy as np

from .. import registry
from ..errors import CheckpointError
from ..schema import Schema

FORMAT = "flatopt.checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20
LIBVER = ("v110", "latest")  # superblock v3: checksummed metadata
FLETCHER32 = h5py.h5z.FILTER_FLETCHER32

DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}

# Limits a file must keep; save refuses an optimizer that would break one (see limits_problems).
MAX_ATTRS = 32
MAX_MEMBERS = 4096        # members of one HDF5 group: /groups holds one per param group
MAX_NDIM = 64             # columns of /index/shape: NumPy's own limit
MAX_JSON = 16 << 20       # bytes of one JSON text (metadata, scheduler state, hyperparameters)

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
    return problems


# ----------------------------------------------------------------------------- JSON
def json_default(value: Any) -> Any:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, default=json_default, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"{what} must be JSON-serializable (dicts with string keys, lists, strings, numbers, "
            f"booleans, None; numpy scalars are converted): {exc}. flatopt checkpoints never "
            "pickle; store arrays as lists or in a separate file") from None


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
    return f"crc32:{zlib.crc32(memoryview(np.ascontiguousarray(array)).cast('B')):08x}"


def manifest_digest(header: Mapping, groups: list, index: Mapping, buffers: Mapping) -> str:
    """sha256 over every attribute, the whole index and every buffer's CRC, canonically."""
    text = json.dumps({"header": dict(header), "groups": groups, "index": dict(index),
                       "buffers": dict(buffers)}, sort_keys=True, default=json_default,
                      allow_nan=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def text_dtype(raw: bytes | list[bytes]) -> np.dtype:
    longest = max((len(r) for r in raw), default=0) if isinstance(raw, list) else len(raw)
    return h5py.string_dtype("utf-8", max(1, longest))
