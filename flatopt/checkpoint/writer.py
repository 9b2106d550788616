"""``save``: an optimizer (through its public contract) into a checkpoint file."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import h5py
import numpy as np

from ..errors import CheckpointError
from ..optimizer import Optimizer
from ..schema import column_problems, slot_value_problems
from . import files
from .format import (CHUNK_BYTES, FORMAT, FORMAT_VERSION, LIBVER, crc, jsonable,
                     limits_problems, manifest_digest, schema_columns, text_dtype, to_json)


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


def _set_text(obj, name: str, text: str) -> None:
    """A fixed-length UTF-8 string attribute (stored inside the checksummed object header)."""
    raw = text.encode("utf-8")
    obj.attrs.create(name, data=np.array(raw, dtype=text_dtype(raw)))


def _write_column(parent: h5py.Group, name: str, values: list, dtype) -> None:
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


def _write_buffer(parent: h5py.Group, name: str, flat: np.ndarray, pool) -> tuple:
    """Create one buffer dataset; its CRC is computed on another thread during the write."""
    future = pool.submit(crc, flat)
    if flat.size:
        chunk = max(1, min(flat.size, CHUNK_BYTES // flat.itemsize))
        ds = parent.create_dataset(name, shape=flat.shape, dtype=flat.dtype, chunks=(chunk,),
                                   fletcher32=True)
        ds.write_direct(flat)
    else:
        ds = parent.create_dataset(name, shape=(0,), dtype=flat.dtype)
    return ds, future


class _Snapshot:
    """What save writes, gathered and checked before the target is touched."""

    def __init__(self, opt: Optimizer, metadata: Any, scheduler: Any):
        from .. import __version__
        self.opt = opt
        self.schema = opt.schema
        self.groups = _groups(opt)
        self.columns = _index_columns(opt)
        self.header = {"format": FORMAT, "format_version": FORMAT_VERSION,
                       "flatopt_version": __version__, "h5py_version": h5py.version.version,
                       "hdf5_version": h5py.version.hdf5_version, "optimizer": self.schema.name}
        if self.schema.version != 1:
            self.header["schema_version"] = self.schema.version
        self.header["metadata"] = to_json(metadata, "metadata")
        if scheduler is not None:
            if not callable(getattr(scheduler, "state_dict", None)):
                raise CheckpointError(f"scheduler must have a state_dict() method, got "
                                      f"{type(scheduler).__name__}")
            self.header["scheduler"] = to_json(scheduler.state_dict(), "scheduler.state_dict()")
        texts = {"metadata": self.header["metadata"],
                 **({"scheduler state": self.header["scheduler"]}
                    if "scheduler" in self.header else {}),
                 **{f"param group {n} hyperparameters": g["hyperparameters"]
                    for n, g in enumerate(self.groups)}}
        problems = limits_problems(self.schema, len(self.groups),
                                   [info.shape for info in opt.index], texts)
        problems += _state_problems(opt)
        if problems:
            raise CheckpointError("cannot save this optimizer (nothing was written): "
                                  + "; ".join(problems[:20]))

    def estimate_bytes(self) -> int:
        """An upper bound for the file size: buffers with their chunk index and fletcher32
        sums, the index (strings stored at the longest one's width), the JSON texts, and
        HDF5's object headers (generously, per object). The property test checks it."""
        data, objects = 0, 8 + 2 * len(self.columns)
        for buf in self.opt.buffers:
            objects += 1
            for flat in (buf.params, *buf.state.values()):
                objects += 1
                data += flat.nbytes + 96 * -(-flat.nbytes // CHUNK_BYTES)
        rows = len(self.columns["id"])
        longest = max((len(p.encode()) for p in self.columns["path"]), default=1)
        width = max((len(s) for s in self.columns["shape"]), default=1)
        index = rows * (longest + 8 * (width + len(self.columns)))
        texts = sum(len(v.encode()) for k, v in self.header.items() if isinstance(v, str))
        for group in self.groups:
            objects += 1
            texts += len(group["hyperparameters"].encode()) + len((group["label"] or "").encode())
        return data + 2 * (index + texts) + 4096 * objects + data // 50 + (1 << 20)

    def write(self, target, *, stop_before_digest: bool = False) -> None:
        buffer_table: dict[str, list] = {}
        with h5py.File(target, "w", libver=LIBVER) as f, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            if isinstance(target, str):
                files.reserve(target, self.estimate_bytes())
            for key, value in self.header.items():
                if key in ("metadata", "scheduler"):  # may be long: a scalar string dataset
                    raw = value.encode("utf-8")
                    f.create_dataset(key, data=np.array(raw, dtype=text_dtype(raw)))
                elif isinstance(value, str):
                    _set_text(f, key, value)
                else:
                    f.attrs[key] = value
            index = f.create_group("index")
            for name, dtype in schema_columns(self.schema).items():
                _write_column(index, name, self.columns[name], dtype)
            pending = self._write_groups(f.create_group("groups"), pool)
            for ds, future in pending:
                digest = future.result()
                _set_text(ds, "digest", digest)
                buffer_table[ds.name] = [ds.dtype.name, int(ds.shape[0]), digest]
            if stop_before_digest:
                return
            _set_text(f, "digest", manifest_digest(self.header, self.groups, self.columns,
                                                   buffer_table))

    def _write_groups(self, root: h5py.Group, pool) -> list:
        pending = []
        for number, group in enumerate(self.groups):
            g = root.create_group(str(number))
            _set_text(g, "hyperparameters", group["hyperparameters"])
            if group["label"] is not None:
                _set_text(g, "label", group["label"])
            for buf in self.opt.buffers:
                if buf.group != number:
                    continue
                b = g.create_group(buf.dtype.name)
                b.attrs["length"] = int(buf.length)
                for slot in ("params", *self.schema.slots):
                    flat = buf.params if slot == "params" else buf.state.get(slot)
                    if flat is not None:
                        pending.append(_write_buffer(b, slot, flat, pool))
        return pending


def save(path: str | os.PathLike, opt: Optimizer, *, scheduler: Any = None,
         metadata: Any = None) -> str:
    """Save ``opt`` (parameters, state, hyperparameters, index) to the HDF5 file ``path``.

    The file is written to a temporary file in the same directory, fsynced, renamed over
    ``path`` and the directory fsynced: a crash at any moment leaves either the previous
    checkpoint or the new one, never a mix. ``metadata`` (JSON-serializable) and
    ``scheduler.state_dict()`` are stored in the same file. Everything a load would refuse is
    refused here, before the target is touched. Returns the absolute path.
    """
    if not isinstance(opt, Optimizer):
        raise CheckpointError(f"save() takes a flatopt optimizer, got {type(opt).__name__}")
    final = files.target_path(path)
    with opt.lock:  # no step can change the buffers while they are written
        try:
            snapshot = _Snapshot(opt, metadata, scheduler)
        except OSError as exc:  # e.g. Numba's cache on a full disk, compiling a check
            raise CheckpointError(f"could not save checkpoint {final}{files.full_hint(exc)}: "
                                  f"{exc}; nothing was written and any previous checkpoint at "
                                  "that path is untouched", path=final) from exc
        files.replace_atomically(final, snapshot.write)
    return final


def _state_problems(opt: Optimizer) -> list[str]:
    """The live state checked as load will check it (``flatopt.schema``'s one check)."""
    problems = []
    for buf in opt.buffers:
        where = f"param group {buf.group} {buf.dtype} buffer"
        found = column_problems(opt.schema, buf.columns, len(buf), where)
        stateful = opt.schema.stateful(buf.columns)
        for name, flat in buf.state.items():
            found += [f"{where}: {problem}" for problem in slot_value_problems(
                opt.schema, name, flat, buf.offsets, buf.sizes, stateful, buf.paths)]
        problems += found
    return problems
