"""A kept copy of flatopt 0.1.0's checkpoint writer (format version 1: 1 MiB chunks with HDF5
fletcher32 and a zlib CRC-32 per buffer), so that tests can write version-1 files of any
optimizer and check that today's reader still loads them. Self-contained on purpose: it must
keep writing exactly what version 1 was, whatever the current writer does."""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import h5py
import numpy as np

from flatopt.checkpoint.format import (json_default, jsonable, schema_columns, text_dtype,
                                       to_json)

CHUNK_BYTES = 1 << 20
LIBVER = ("v110", "latest")


def crc(array: np.ndarray) -> str:
    return f"crc32:{zlib.crc32(memoryview(np.ascontiguousarray(array)).cast('B')):08x}"


def manifest_digest(header, groups, index, buffers) -> str:
    text = json.dumps({"header": dict(header), "groups": groups, "index": dict(index),
                       "buffers": dict(buffers)}, sort_keys=True, default=json_default,
                      allow_nan=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _set_text(obj, name: str, text: str) -> None:
    raw = text.encode("utf-8")
    obj.attrs.create(name, data=np.array(raw, dtype=text_dtype(raw)))


def _write_column(parent, name, values, dtype) -> None:
    if dtype == "str":
        raw = [v.encode("utf-8") for v in values]
        parent.create_dataset(name, data=np.array(raw, dtype=text_dtype(raw)),
                              shape=(len(values),))
    elif dtype == "shape":
        width = max([1] + [len(shape) for shape in values])
        data = np.full((len(values), width), -1, dtype=np.int64)
        for k, shape in enumerate(values):
            data[k, :len(shape)] = shape
        parent.create_dataset(name, data=data)
    else:
        parent.create_dataset(name, data=np.asarray(values, dtype=dtype).reshape(-1))


def save_v1(path, opt, *, metadata=None, scheduler=None) -> None:
    """Write ``opt`` as flatopt 0.1.0 did (no checks: the caller passes a sound optimizer)."""
    schema = opt.schema
    groups = []
    for values in opt.settings():
        hyper = {key: jsonable(value) for key, value in values.items() if key != "label"}
        groups.append({"hyperparameters": to_json(hyper, "group"),
                       "label": values.get("label")})
    columns = {name: [] for name in schema_columns(schema)}
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
        for name in schema.columns:
            columns[name].append(buf.columns[name][info.slot].item())
    header = {"format": "flatopt.checkpoint", "format_version": 1, "flatopt_version": "0.1.0",
              "h5py_version": h5py.version.version, "hdf5_version": h5py.version.hdf5_version,
              "optimizer": schema.name}
    if schema.version != 1:
        header["schema_version"] = schema.version
    header["metadata"] = to_json(metadata, "metadata")
    if scheduler is not None:
        header["scheduler"] = to_json(scheduler.state_dict(), "scheduler")
    table = {}
    with h5py.File(os.fspath(path), "w", libver=LIBVER) as f:
        for key, value in header.items():
            if key in ("metadata", "scheduler"):
                raw = value.encode("utf-8")
                f.create_dataset(key, data=np.array(raw, dtype=text_dtype(raw)))
            elif isinstance(value, str):
                _set_text(f, key, value)
            else:
                f.attrs[key] = value
        index = f.create_group("index")
        for name, dtype in schema_columns(schema).items():
            _write_column(index, name, columns[name], dtype)
        root = f.create_group("groups")
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
                for slot in ("params", *schema.slots):
                    flat = buf.params if slot == "params" else buf.state.get(slot)
                    if flat is None:
                        continue
                    if flat.size:
                        chunk = max(1, min(flat.size, CHUNK_BYTES // flat.itemsize))
                        ds = b.create_dataset(slot, shape=flat.shape, dtype=flat.dtype,
                                              chunks=(chunk,), fletcher32=True)
                        ds.write_direct(flat)
                    else:
                        ds = b.create_dataset(slot, shape=(0,), dtype=flat.dtype)
                    digest = crc(flat)
                    _set_text(ds, "digest", digest)
                    table[ds.name] = [ds.dtype.name, int(ds.shape[0]), digest]
        _set_text(f, "digest", manifest_digest(header, groups, columns, table))
