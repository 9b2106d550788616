"""Library functions behind ``flatopt inspect``, ``verify`` and ``diff`` (the CLI only prints
what these return)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _lossless
from ..errors import CheckpointError
from . import files, precision
from .format import check_flags
from .loader import Scratch, guarded, open_checkpoint, saved_values, verify_one


def _state_summary(schema, members) -> dict:
    """How many parameters have state, and the range of their step counts (a ``step``
    column) when the optimizer keeps one."""
    steps = [e.columns["step"] for e in members] if "step" in schema.columns else []
    return {"step_min": min(steps) if steps else None,
            "step_max": max(steps) if steps else None,
            "with_state": sum(1 for e in members if schema.stateful(e.columns))}


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def inspect_checkpoint(source, *, tensors: bool = False) -> dict:
    """A summary of a checkpoint (structure and digest checked; buffer data not read), with
    its extra arrays (name, shape, dtype, bytes). With ``tensors``, one row per parameter in
    id order: id, path, shape, dtype, group, its label and the schema's persisted columns
    (named in ``columns``: Adam's step, SGD's momentum_initialized)."""
    check_flags(tensors=tensors)
    with open_checkpoint(source) as ck:
        schema = ck.schema
        groups = []
        total_bytes = 0
        for number, group in enumerate(ck.groups):
            members = [e for e in ck.params if e.group == number]
            buffers = [b for key, b in ck.buffers.items() if key[0] == number]
            nbytes = sum(length * np.dtype(b.dtype).itemsize
                         for b in buffers for length in b.lengths.values())
            total_bytes += nbytes
            groups.append({
                "group": number, "label": group["label"],
                "hyperparameters": {k: _plain(v) for k, v in group["hyperparameters"].items()},
                "parameters": len(members), "elements": sum(e.size for e in members),
                "dtypes": sorted({b.dtype for b in buffers}),
                "slots": sorted({slot for b in buffers for slot in b.datasets}),
                "bytes": nbytes, **_state_summary(schema, members),
                # reduced precision: each coded buffer's settings; plain: the dtype's
                "storage": precision.group_storage(ck, number) or [
                    {"storage": _lossless.fmt(_lossless.plain(b.dtype)),
                     **_lossless.plain(b.dtype)} for b in buffers]})
        info = {"path": ck.name, "format": ck.header["format"],
                "format_version": ck.header["format_version"],
                "flatopt_version": ck.header["flatopt_version"],
                "h5py_version": ck.header["h5py_version"],
                "hdf5_version": ck.header["hdf5_version"],
                "optimizer": schema.name, "parameters": len(ck.params),
                "elements": sum(e.size for e in ck.params), "buffer_bytes": total_bytes,
                "file_bytes": ck.part_bytes() if "world_size" in ck.header else ck.size,
                **_state_summary(schema, ck.params), "groups": groups,
                "metadata": ck.metadata, "scheduler_state": ck.scheduler_state}
        if "world_size" in ck.header:  # a sharded checkpoint (a directory)
            info["world_size"] = ck.header["world_size"]
            info["save_id"] = ck.header["save_id"]
        info["arrays"] = [{"name": name, "shape": list(saved.shape),
                           "dtype": saved.dtype.name, "bytes": saved.nbytes}
                          for name, saved in ck.arrays.items()]
        if tensors:
            info["columns"] = list(schema.columns)
            info["tensors"] = [{"id": e.id, "path": e.path, "shape": list(e.shape),
                                "dtype": e.dtype, "group": e.group,
                                "label": ck.groups[e.group]["label"], **e.columns}
                               for e in sorted(ck.params, key=lambda e: e.id)]
        return info


def verify_checkpoint(source) -> dict:
    """Check structure, digest, every buffer's and extra array's checksums and the state's
    values; ``ok`` only when all are sound. This is exactly what ``load`` verifies before it
    changes anything. Memory: the largest buffer (or extra array), whatever the file's size."""
    result: dict[str, Any] = {"path": str(source) if not hasattr(source, "read") else
                              getattr(source, "name", "<in-memory checkpoint>"),
                              "ok": False, "problems": [], "buffers": []}
    try:
        with open_checkpoint(source) as ck, files.pool() as workers:
            result.update(path=ck.name, optimizer=ck.schema.name,
                          format_version=ck.header["format_version"],
                          parameters=len(ck.params))
            scratch = Scratch()
            checks = [({"buffer": saved.datasets[slot].name, "elements": saved.lengths[slot],
                        "digest": saved.digests[slot]},
                       lambda key=key, slot=slot: verify_one(ck, key, slot, workers, scratch))
                      for key, saved in sorted(ck.buffers.items()) for slot in saved.datasets]
            checks += [({"buffer": saved.dataset.name, "array": name,
                         "elements": math.prod(saved.shape), "digest": saved.digest},
                        lambda name=name: precision.check_arrays(ck, {name: guarded(
                            ck, lambda: ck.read_array(name, workers))}))
                       for name, saved in ck.arrays.items()]
            for entry, check in checks:
                try:
                    check()
                    entry["ok"] = True
                except CheckpointError as exc:
                    entry["ok"] = False
                    result["problems"].append(str(exc))
                result["buffers"].append(entry)
    except CheckpointError as exc:
        result["problems"].append(str(exc))
    result["ok"] = not result["problems"]
    return result


def _header_differences(ca, cb) -> list[dict]:
    keys = ("format", "format_version", "world_size", "optimizer", "flatopt_version",
            "h5py_version", "hdf5_version", "metadata", "scheduler")
    return [{"field": key, "a": ca.header.get(key), "b": cb.header.get(key)}
            for key in keys if ca.header.get(key) != cb.header.get(key)]


def _group_differences(ca, cb) -> list[dict]:
    out = []
    for number in range(max(len(ca.groups), len(cb.groups))):
        ga = ca.groups[number] if number < len(ca.groups) else None
        gb = cb.groups[number] if number < len(cb.groups) else None
        if ga is None or gb is None:
            out.append({"group": number, "field": "exists", "a": ga is not None,
                        "b": gb is not None})
            continue
        if ga["label"] != gb["label"]:
            out.append({"group": number, "field": "label", "a": ga["label"], "b": gb["label"]})
        ha, hb = ga["hyperparameters"], gb["hyperparameters"]
        for key in sorted(set(ha) | set(hb)):
            if ha.get(key) != hb.get(key):
                out.append({"group": number, "field": key, "a": _plain(ha.get(key)),
                            "b": _plain(hb.get(key))})
    return out


def _values(ck, staged, entry, slot):
    """A parameter's values in ``slot`` (None where the file has no such slot or entry)."""
    if ((entry.group, entry.dtype), slot) not in staged:
        return None
    return saved_values(ck, entry, staged, slot)


def _slot_difference(path: str, slot: str, va, vb) -> dict | None:
    if va is None and vb is None:
        return None
    if va is None or vb is None:
        return {"path": path, "field": slot, "a": va is not None, "b": vb is not None,
                "note": "present"}
    difference = _value_difference(va, vb)
    return None if difference is None else {"path": path, "field": slot, **difference}


def _value_difference(va: np.ndarray, vb: np.ndarray) -> dict | None:
    """How two arrays of one dtype and shape differ: ``elements_differing`` (NaN equals NaN)
    and, for numbers, ``max_abs_diff`` (NaN against a number: unbounded, null in --json);
    None when they are equal."""
    numeric = va.dtype.kind in "iuf"
    floating = va.dtype.kind == "f"
    va, vb = va.reshape(-1), vb.reshape(-1)   # a 0-d array too (an EMA's count)
    if np.array_equal(va, vb, equal_nan=floating):
        return None
    both_nan = (np.isnan(va) & np.isnan(vb)) if floating else np.zeros(va.shape, bool)
    difference = {"elements_differing": int(np.count_nonzero(~((va == vb) | both_nan)))}
    if numeric and va.size:
        delta = np.abs(va.astype(np.float64) - vb.astype(np.float64))
        delta[both_nan] = 0.0
        difference = {"max_abs_diff": float(np.max(delta)), **difference}
    return difference


def diff_checkpoints(a, b) -> dict:
    """Every difference between two checkpoints: header, groups, per path, extra arrays."""
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        only_a = [e.path for e in ca.params if e.path not in cb.by_path]
        only_b = [e.path for e in cb.params if e.path not in ca.by_path]
        staged_a, staged_b = guarded(ca, ca.read_all), guarded(cb, cb.read_all)
        slots = sorted({s for buf in (*ca.buffers.values(), *cb.buffers.values())
                        for s in buf.datasets})
        params = []
        for ea in ca.params:
            eb = cb.by_path.get(ea.path)
            if eb is None:
                continue
            for name in ("id", "shape", "dtype", "group"):
                if getattr(ea, name) != getattr(eb, name):
                    params.append({"path": ea.path, "field": name,
                                   "a": _plain(getattr(ea, name)),
                                   "b": _plain(getattr(eb, name))})
            for name in sorted(set(ea.columns) | set(eb.columns)):
                if ea.columns.get(name) != eb.columns.get(name):
                    params.append({"path": ea.path, "field": name,
                                   "a": ea.columns.get(name), "b": eb.columns.get(name)})
            if ea.shape != eb.shape:
                continue
            for slot in slots:
                found = _slot_difference(ea.path, slot, _values(ca, staged_a, ea, slot),
                                         _values(cb, staged_b, eb, slot))
                if found:
                    params.append(found)
        header, groups = _header_differences(ca, cb), _group_differences(ca, cb)
        arrays = _array_differences(ca, cb)
        identical = not (header or groups or only_a or only_b or params or arrays)
        return {"a": ca.name, "b": cb.name, "identical": identical, "header": header,
                "groups": groups, "only_in_a": only_a, "only_in_b": only_b, "params": params,
                "arrays": arrays}


def _array_differences(ca, cb) -> list[dict]:
    """Extra arrays only in one file, or differing in dtype, shape or values."""
    out = []
    for name in [*ca.arrays, *(n for n in cb.arrays if n not in ca.arrays)]:
        sa, sb = ca.arrays.get(name), cb.arrays.get(name)
        if sa is None or sb is None:
            out.append({"array": name, "field": "exists", "a": sa is not None,
                        "b": sb is not None})
        elif (sa.dtype.str, sa.shape) != (sb.dtype.str, sb.shape):
            out.append({"array": name, "field": "dtype and shape",
                        "a": [sa.dtype.str, list(sa.shape)], "b": [sb.dtype.str, list(sb.shape)]})
        else:
            va, vb = (guarded(ck, lambda ck=ck: ck.read_array(name)) for ck in (ca, cb))
            difference = _value_difference(va, vb)
            if difference is not None:
                out.append({"array": name, "field": "values", **difference})
    return out
