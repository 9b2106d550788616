"""The group and extra-array datasets of a checkpoint file (attributes only, no data read),
guarded against a hostile file as ``reader`` guards the rest, and :func:`read_structure`:
all of a file's structure with its commit digest verified."""

from __future__ import annotations

import math
import re

import numpy as np

from .format import (DTYPES, MAX_ARRAY_NDIM, MAX_NAME, NESTED_FORMAT_VERSION,
                     array_dtype_problem, array_name_problem, manifest_digest, prefix_problem,
                     stored_dtype)
from .reader import (Contents, SavedArray, SavedBuffer, attr, block_hashes, member, raw_offset,
                     read_header, read_index)


DIGESTS = {1: re.compile(r"crc32:[0-9a-f]{8}"), 2: re.compile(r"xxh3:[0-9a-f]{16}")}
DATA_ATTRS = {1: {"digest"}, 2: {"digest", "checksums"}}


def read_groups(ck: Contents) -> dict[str, list]:
    """Group attributes and buffer datasets (attributes only: no data read); returns the
    buffer table the commit digest covers."""
    version = min(ck.version, 2)
    groups_obj = member(ck, ck.file, "groups", "group")
    n_groups = len(groups_obj)
    if set(groups_obj) != {str(k) for k in range(n_groups)}:
        raise ck.corrupt(f"groups are named {sorted(groups_obj)[:10]}, expected 0..{n_groups - 1}")
    table: dict[str, list] = {}
    declared = ck.declared = 0
    for number in range(n_groups):
        g = member(ck, groups_obj, str(number), "group")
        hyper_text = attr(ck, g, "hyperparameters", str)
        label = attr(ck, g, "label", str, required=False)
        known = {"hyperparameters", "label", *(("storage",) if ck.version >= 5 else ())}
        if set(g.attrs) - known:
            raise ck.corrupt(f"{g.name} has unexpected attributes")
        ck.raw_groups.append({"hyperparameters": hyper_text, "label": label})
        if "storage" in g.attrs:  # version 5: reduced-precision buffers as stored
            ck.raw_groups[-1]["storage"] = attr(ck, g, "storage", str)
        for dtype_name in g:
            if dtype_name not in DTYPES:
                raise ck.corrupt(f"{g.name}/{dtype_name}: buffers are float32 or float64")
            b = member(ck, g, dtype_name, "group")
            length = attr(ck, b, "length", int)
            if set(b.attrs) != {"length"}:
                raise ck.corrupt(f"{b.name} has unexpected attributes")
            if length < 0:
                raise ck.corrupt(f"{b.name} declares a negative length {length}")
            datasets, digests, offsets, hashes, lengths = {}, {}, {}, {}, {}
            for slot in b:
                ds = member(ck, b, slot, "dataset")
                where = ds.name
                if ds.dtype != DTYPES[dtype_name]:
                    raise ck.corrupt(f"dtype {ds.dtype} is not {dtype_name}", buffer=where)
                # format 3: a shaped state slot (Adafactor's factors) has its own length,
                # which validate checks against the schema's packing of the index's shapes
                own_length = ck.version >= 3 and slot != "params" and len(ds.shape) == 1
                if ds.shape != (length,) and not own_length:
                    raise ck.corrupt(f"shape {ds.shape} disagrees with the declared length "
                                     f"{length}", buffer=where)
                slot_length = int(ds.shape[0])
                nbytes = slot_length * DTYPES[dtype_name].itemsize
                declared += nbytes
                if declared > ck.size:
                    raise ck.corrupt(f"declares {declared} bytes of buffers, more than the "
                                     f"file's {ck.size} bytes", buffer=where)
                if version == 1 and length and ds.id.get_storage_size() < nbytes:
                    raise ck.corrupt(f"only {ds.id.get_storage_size()} of {nbytes} bytes are "
                                     "stored (an incomplete write)", buffer=where)
                if set(ds.attrs) != DATA_ATTRS[version]:
                    raise ck.corrupt(f"unexpected attributes {sorted(ds.attrs)}", buffer=where)
                digest = attr(ck, ds, "digest", str)
                if not DIGESTS[version].fullmatch(digest):
                    raise ck.corrupt(f"bad digest attribute {digest!r}", buffer=where)
                if version >= 2:
                    offsets[slot] = raw_offset(ck, ds, nbytes)
                    hashes[slot] = block_hashes(ck, ds, nbytes, digest)
                datasets[slot], digests[slot], lengths[slot] = ds, digest, slot_length
                table[where] = [ds.dtype.name, slot_length, digest]
            if "params" not in datasets:
                raise ck.corrupt(f"{b.name} has no params dataset")
            ck.buffers[number, dtype_name] = SavedBuffer(number, dtype_name, length, datasets,
                                                         digests, hashes=hashes,
                                                         offsets=offsets, lengths=lengths)
    ck.declared = declared
    return table


ARRAY_ATTRS = {"name", "dtype", "digest", "checksums"}


def read_arrays(ck: Contents) -> dict[str, list]:
    """Format version 2: the extra arrays' datasets (no data read), guarded like buffers;
    returns the table the commit digest covers."""
    table: dict[str, list] = {}
    if ck.version < 2 or "arrays" not in ck.file:
        return table
    group = member(ck, ck.file, "arrays", "group")
    if len(group.attrs):
        raise ck.corrupt(f"/arrays has unexpected attributes {sorted(group.attrs)[:5]}")
    count = len(group)
    if set(group) != {str(k) for k in range(count)}:
        raise ck.corrupt(f"extra arrays are named {sorted(group)[:10]}, expected "
                         f"0..{count - 1}")
    for number in range(count):
        ds = member(ck, group, str(number), "dataset")
        where = ds.name
        if set(ds.attrs) != ARRAY_ATTRS:
            raise ck.corrupt(f"unexpected attributes {sorted(ds.attrs)}", buffer=where)
        name = attr(ck, ds, "name", str)
        problem = (array_name_problem(name, nested=ck.version >= NESTED_FORMAT_VERSION)
                   if len(name) <= MAX_NAME else "name too long")
        if problem:
            raise ck.corrupt(problem, buffer=where)
        if name in ck.arrays:
            raise ck.corrupt(f"extra array name {name!r} appears twice", buffer=where)
        text = attr(ck, ds, "dtype", str)
        try:
            dtype = np.dtype(text) if len(text) <= 8 else None
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.str != text or array_dtype_problem(dtype):
            raise ck.corrupt(f"extra array {name!r} has dtype {text[:40]!r}: not a bool, "
                             "integer or float dtype", buffer=where)
        if ds.dtype != stored_dtype(dtype):
            raise ck.corrupt(f"extra array {name!r} is stored as {ds.dtype}, not "
                             f"{stored_dtype(dtype)}", buffer=where)
        shape = tuple(int(d) for d in ds.shape) if ds.shape is not None else None
        if shape is None or len(shape) > MAX_ARRAY_NDIM:
            raise ck.corrupt(f"extra array {name!r} has no shape or more than "
                             f"{MAX_ARRAY_NDIM} dimensions", buffer=where)
        nbytes = math.prod(shape) * dtype.itemsize
        ck.declared += nbytes
        if ck.declared > ck.size:
            raise ck.corrupt(f"declares {ck.declared} bytes of buffers and arrays, more than "
                             f"the file's {ck.size} bytes", buffer=where)
        digest = attr(ck, ds, "digest", str)
        if not DIGESTS[2].fullmatch(digest):
            raise ck.corrupt(f"bad digest attribute {digest!r}", buffer=where)
        offset = raw_offset(ck, ds, nbytes)
        hashes = block_hashes(ck, ds, nbytes, digest)
        ck.arrays[name] = SavedArray(name, dtype, shape, ds, digest, hashes, offset)
        table[where] = [name, dtype.str, list(shape), digest]
    problem = prefix_problem(ck.arrays)
    if problem:
        raise ck.corrupt(problem)
    return table


def read_structure(ck: Contents) -> None:
    """``ck``'s structure read and guarded, the commit digest verified over all of it."""
    digest = read_header(ck)
    columns = read_index(ck)
    table = read_groups(ck)
    arrays = read_arrays(ck) if ck.version >= 2 else None
    if manifest_digest(ck.header, ck.raw_groups, columns, table, arrays) != digest:
        raise ck.corrupt("its metadata digest does not match (attributes or index were modified "
                         "or damaged)")
    ck.raw_columns, ck.digest = columns, digest
