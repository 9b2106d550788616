"""What a structurally sound checkpoint means, checked against the optimizer's schema: its
groups, index rows, packing and state, before any buffer data is read; then the data itself
(second moments finite and >= 0, no state where a parameter has none)."""

from __future__ import annotations

import json
import math

import numpy as np

from .._layout import SlotLayout, aligned_offsets
from ..schema import slot_value_problems
from . import precision
from .format import DTYPES, json_depth_problem, schema_named
from .reader import Contents, SavedParam


def interpret(ck: Contents) -> None:
    """Fill ``ck.schema``, ``ck.groups``, ``ck.params`` and buffer members, or raise
    ``CheckpointCorrupt`` (damaged) or ``CheckpointMismatch`` (sound but newer)."""
    name = ck.header["optimizer"]
    schema = schema_named(name)
    if schema is None:
        raise ck.newer(f"optimizer {name!r}")
    version = ck.header.get("schema_version", 1)
    if version > schema.version:
        raise ck.newer(f"{name} state of schema version {version} (this flatopt reads up to "
                       f"{schema.version})")
    if version < 1:
        raise ck.corrupt(f"schema_version {version} is not a valid version")
    ck.schema = schema
    unknown = sorted(set(ck.raw_columns) - {"id", "path", "ndim", "shape", "dtype", "group",
                                            "offset", "size", *schema.columns})
    if unknown:
        raise ck.newer(f"{name} per-parameter columns {unknown}")
    missing = sorted(set(schema.columns) - set(ck.raw_columns))
    if missing:
        raise ck.corrupt(f"index columns {missing} of a {name} checkpoint are missing")
    index = ck.file["index"]
    for column_name, column in schema.columns.items():
        if index[column_name].dtype != np.dtype(column.dtype).newbyteorder("<"):
            raise ck.corrupt(f"index column {column_name} should be {column.dtype}, is "
                             f"{index[column_name].dtype}")
    for buffer in ck.buffers.values():
        extra = sorted(set(buffer.datasets) - {"params", *schema.slots})
        if extra:
            raise ck.newer(f"{name} state slots {extra}")
    _groups(ck)
    _json_texts(ck)
    _rows(ck)
    _packing_and_state(ck)
    precision.interpret(ck)


def _groups(ck: Contents) -> None:
    schema = ck.schema
    for number, raw in enumerate(ck.raw_groups):
        values = _parsed_json(ck, raw["hyperparameters"], f"group {number} hyperparameters")
        if not isinstance(values, dict) or "label" in values or "params" in values:
            raise ck.corrupt(f"group {number} hyperparameters are not a dict of values")
        if raw["label"] is not None:
            values["label"] = raw["label"]
        values = schema.upgraded(values, ck.header.get("schema_version", 1))
        normal, problems = schema.check_group(values, f"saved param group {number}")
        if problems:
            raise ck.corrupt("; ".join(problems))
        ck.groups.append({"hyperparameters": {k: v for k, v in normal.items() if k != "label"},
                          "label": raw["label"]})


def _json_texts(ck: Contents) -> None:
    for key, attribute in (("metadata", "metadata"), ("scheduler", "scheduler_state")):
        if key in ck.header:
            setattr(ck, attribute, _parsed_json(ck, ck.header[key], key))


def _parsed_json(ck: Contents, text: str, what: str):
    """A JSON text of the file, parsed; no deeper than save writes (json.loads recurses)."""
    problem = json_depth_problem(text)
    if problem:
        raise ck.corrupt(f"{what} {problem}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ck.corrupt(f"{what} is not valid JSON: {exc}") from None


def _rows(ck: Contents) -> None:
    columns = ck.raw_columns
    schema = ck.schema
    ids = set()
    for row in range(len(columns["id"])):
        path = columns["path"][row]
        shape, size = columns["shape"][row], columns["size"][row]
        entry = SavedParam(row, columns["id"][row], path, shape, columns["dtype"][row],
                           columns["group"][row], columns["offset"][row], size,
                           {name: columns[name][row] for name in schema.columns})
        what = f"index row {row} ({path!r})"
        if not path or "\x00" in path:
            raise ck.corrupt(f"index row {row} has an empty path or one with a NUL")
        if path in ck.by_path:
            raise ck.corrupt(f"path {path!r} appears twice in the index")
        if entry.id < 0 or entry.id in ids:
            raise ck.corrupt(f"{what}: id {entry.id} is negative or duplicated")
        ids.add(entry.id)
        if any(d < 0 for d in shape):
            raise ck.corrupt(f"{what}: shape {shape} has a negative dimension")
        if math.prod(shape) != size:
            raise ck.corrupt(f"{what}: size {size} is not the product of shape {shape}")
        if entry.dtype not in DTYPES:
            raise ck.corrupt(f"{what}: dtype {entry.dtype!r} is not float32 or float64")
        buffer = ck.buffers.get((entry.group, entry.dtype))
        if buffer is None:
            raise ck.corrupt(f"{what}: group {entry.group} has no {entry.dtype} buffer")
        if entry.offset < 0 or entry.offset + size > buffer.length:
            raise ck.corrupt(f"{what}: elements [{entry.offset}, {entry.offset + size}) lie "
                             f"outside its buffer of {buffer.length}")
        for name, column in schema.columns.items():
            problem = column.problem(entry.columns[name])
            if problem:
                raise ck.corrupt(f"{what}: {name} {problem} (outside its range)")
        ck.params.append(entry)
        ck.by_path[path] = entry
        buffer.members.append(entry)


def _packing_and_state(ck: Contents) -> None:
    schema = ck.schema
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
        offsets, length = aligned_offsets([e.size for e in buffer.members], DTYPES[key[1]])
        if length != buffer.length or any(int(o) != e.offset
                                           for o, e in zip(offsets, buffer.members)):
            raise ck.corrupt(f"group {key[0]} {key[1]}: offsets or length do not follow "
                             "flatopt's aligned packing (gaps or a wrong length)")
        buffer.positions = {e.row: k for k, e in enumerate(buffer.members)}
        for slot in buffer.datasets:
            # a shaped slot packs its own entries the way the live optimizer does
            entry_shape = schema.slots[slot].entry_shape if slot in schema.slots else tuple
            layout = SlotLayout([entry_shape(e.shape) for e in buffer.members], DTYPES[key[1]])
            if layout.length != buffer.lengths[slot]:
                raise ck.corrupt(f"{buffer.datasets[slot].name} holds {buffer.lengths[slot]} "
                                 f"values; its {len(buffer.members)} parameters' entries take "
                                 f"{layout.length}")
            buffer.layouts[slot] = layout
        if any(schema.stateful(e.columns) for e in buffer.members):
            settings = ck.groups[key[0]]["hyperparameters"]
            # a slot none of these parameters has an entry in (Adafactor's row and column
            # factors beside vectors only) holds nothing, allocated by a step or not
            lacking = [slot for slot in schema.used_slots(settings)
                       if slot not in buffer.datasets and SlotLayout(
                           [schema.slots[slot].entry_shape(e.shape) for e in buffer.members],
                           DTYPES[key[1]]).length]
            if lacking:
                raise ck.corrupt(f"group {key[0]} {key[1]}: parameters have state but the "
                                 f"buffers {lacking} are missing")


def check_data(ck: Contents, staged: dict) -> None:
    """Data that no honest save writes (see ``flatopt.schema.slot_value_problems``)."""
    schema = ck.schema
    for (key, slot), flat in staged.items():
        if slot == "params":
            continue
        members = ck.buffers[key].members
        problems = slot_value_problems(
            schema, slot, flat, ck.buffers[key].layouts[slot],
            np.array([schema.stateful(e.columns) for e in members], bool),
            [e.path for e in members])
        if problems:
            raise ck.corrupt("; ".join(problems), buffer=ck.buffers[key].datasets[slot].name)
