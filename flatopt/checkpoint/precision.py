"""Reduced-precision buffers in checkpoint files (format version 5).

A file of an optimizer with coded buffers keeps the usual structure for every group (index,
``/groups/<g>/<dtype>`` buffers) holding the parameters' and state's float32 VALUES, packed as
a float32 optimizer packs them (what ``read``, ``inspect``, ``verify`` and a converting load
use), and beside it the buffers AS STORED, losslessly:

- ``/groups/<g>`` attribute ``storage``: JSON, a list with one item per coded buffer of the
  group: its settings (``param``, ``grad``, ``state``, ``master``, ``rounding``, ``seed``),
  ``draws`` (the stochastic rounding stream's step counter), ``length`` and its ``paths``
  with their ``offsets`` in the live packing;
- extra arrays ``flatopt:storage/<g>/<k>/<name>`` (checksummed like every array): ``params``
  (16-bit parameters as their uint16 bit patterns: the ``param`` setting names the dtype),
  ``master``, ``compensation``, each state slot as stored (float32, bfloat16 bits as uint16,
  int8 codes as uint8) and ``<slot>.absmax`` (float32, one per 256-element block).

Gradients are not stored. Everything here is checked against the index before use.
"""

from __future__ import annotations

import json

import numpy as np

from .. import _codec, _lossless
from ..errors import CheckpointError
from .._layout import SlotLayout
from ..kernels.storage import BLOCK
from .._storage import numpy_dtype
from ..schema import MAX_STEP
from .format import NEST, OWN_PREFIX, json_depth_problem, to_json

STORAGE_KEY = OWN_PREFIX + "storage"
PRECISION_FORMAT_VERSION = 5
FIELDS = {"param": str, "grad": str, "state": str, "master": bool, "rounding": str,
          "seed": int, "draws": int, "length": int, "paths": list, "offsets": list}
STATE_FORMATS = ("float32", "bfloat16", "int8")
BITS = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<u2"), "float32": np.dtype("<f4")}


def coded(opt) -> bool:
    """Whether ``opt`` keeps reduced-precision buffers: its checkpoint is a version-5 file
    (sharded, gathered on rank 0 into one: ``sharded.save_consolidated``)."""
    return any(buf.coded for buf in opt.buffers)


def array_name(group: int, number: int, name: str) -> str:
    return NEST.join((STORAGE_KEY, str(group), str(number), name))


def _stored(flat: np.ndarray) -> np.ndarray:
    """A stored array as the file holds it: 16-bit floats as their bit patterns."""
    return flat.view(np.uint16) if flat.dtype.itemsize == 2 else flat


# ----------------------------------------------------------------------------- save
def storage_texts_and_arrays(opt) -> tuple[dict[int, str], dict[str, np.ndarray]]:
    """Per group, its ``storage`` JSON text; and the stored arrays (copies) by name. Raises
    CheckpointError, before anything is written, for what a load would refuse: a ``draws``
    count past ``MAX_STEP`` (neither a step nor a load makes one; ``buf.draws`` written)."""
    items: dict[int, list] = {}
    arrays: dict[str, np.ndarray] = {}
    for buf in opt.buffers:
        if not buf.coded:
            continue
        if not 0 <= buf.draws <= MAX_STEP:
            raise CheckpointError(f"cannot save this optimizer (nothing was written): param "
                                  f"group {buf.group}: the buffer of {buf.paths[0]!r} has "
                                  f"drawn {buf.draws} rounding streams, past {MAX_STEP}")
        number = len(items.setdefault(buf.group, []))
        items[buf.group].append({**_lossless.describe(buf), "draws": int(buf.draws),
                                 "length": int(buf.length), "paths": list(buf.paths),
                                 "offsets": [int(o) for o in buf.offsets]})
        named = {"params": buf.params, "master": buf.master, "compensation": buf.compensation,
                 **buf.state, **{f"{slot}.absmax": s for slot, s in buf.absmax.items()}}
        for name, flat in named.items():
            if flat is not None:
                arrays[array_name(buf.group, number, name)] = _stored(flat).copy()
    texts = {group: to_json(value, f"param group {group} storage")
             for group, value in items.items()}
    return texts, arrays


def view_packing(opt) -> list[tuple[int, str, list, SlotLayout]]:
    """How the float32 view of a coded optimizer packs it: (group, compute dtype name, its
    members (buffer, slot) in id order, their layout), one per group and compute dtype, as a
    plain optimizer packs them (a coded optimizer may split such a group into several
    buffers: 16-bit and float32 parameters, tensors too small for 8-bit state)."""
    keyed: dict[tuple, list] = {}
    for buf in opt.buffers:
        for slot in range(len(buf)):
            keyed.setdefault((buf.group, buf.dtype.name), []).append((buf, slot))
    out = []
    for (group, dtype), members in sorted(keyed.items()):
        members.sort(key=lambda m: int(m[0].ids[m[1]]))
        out.append((group, dtype, members,
                    SlotLayout([m[0].shapes[m[1]] for m in members], np.dtype(dtype))))
    return out


def view_buffers(opt, make):
    """The float32 view of a coded optimizer (:func:`view_packing`) with decoded values;
    ``make`` builds writer._Buffer. Returns (buffers, path -> offset in its view buffer)."""
    out, offsets = [], {}
    for number, (group, dtype, members, layout) in enumerate(view_packing(opt)):
        names = sorted({name for buf, _ in members for name in buf.state},
                       key=list(opt.schema.slots).index)
        arrays = {name: np.zeros(layout.length, dtype) for name in ("params", *names)}
        columns = {name: np.array([m[0].columns[name][m[1]] for m in members],
                                  opt.buffers[members[0][0].number].columns[name].dtype)
                   for name in members[0][0].columns}
        for k, (buf, slot) in enumerate(members):
            start, size = int(layout.offsets[k]), int(layout.sizes[k])
            offsets[buf.paths[slot]] = start
            arrays["params"][start:start + size] = buf.view(buf.params, slot).reshape(-1)
            for name in buf.state:
                values = (_codec.read_slot(buf, opt.schema, name, slot) if buf.coded
                          else buf.state_view(name, slot))
                arrays[name][start:start + size] = np.asarray(values).reshape(-1)
        saved = make(number, group, np.dtype(dtype), layout.length, layout.offsets,
                     layout.sizes, [m[0].paths[m[1]] for m in members], columns,
                     {slot: layout for slot in arrays})
        saved.arrays = arrays
        out.append(saved)
    return out, offsets


# ----------------------------------------------------------------------------- read
def interpret(ck) -> None:
    """Parse and check every group's ``storage`` (version 5) against the index and the extra
    arrays: ``ck.storage`` path -> (settings, draws, its arrays' names, offset)."""
    ck.storage = {}
    for group, raw in enumerate(ck.raw_groups):
        text = raw.get("storage")
        if text is None:
            continue
        problem = json_depth_problem(text)
        try:
            items = json.loads(text) if problem is None else None
        except ValueError:
            items = None
        if not isinstance(items, list):
            raise ck.corrupt(f"group {group} storage is not a JSON list")
        for number, item in enumerate(items):
            _check_item(ck, group, number, item)
    expected = {name for _, _, names, _ in ck.storage.values() for name in names.values()}
    extra = sorted(n for n in ck.arrays if n.startswith(STORAGE_KEY + NEST) and n not in expected)
    if extra:
        raise ck.corrupt(f"storage arrays {extra[:5]} belong to no buffer")


def _check_item(ck, group: int, number: int, item) -> None:
    where = f"group {group} storage {number}"
    if not isinstance(item, dict) or set(item) != set(FIELDS) or not all(
            isinstance(item[key], kind) and not (kind is int and isinstance(item[key], bool))
            for key, kind in FIELDS.items()):
        raise ck.corrupt(f"{where} is not a buffer storage ({sorted(FIELDS)})")
    if (item["param"] not in BITS or item["grad"] not in ("float32", "float16", "bfloat16")
            or item["state"] not in STATE_FORMATS
            or item["rounding"] not in ("nearest", "stochastic", "kahan")
            or not 0 <= item["draws"] <= MAX_STEP or not 0 <= item["seed"] < 1 << 63
            or item["length"] < 0
            or len(item["paths"]) != len(item["offsets"]) or not item["paths"]):
        raise ck.corrupt(f"{where} has settings no save writes")
    length, end = item["length"], 0
    names = {"params": (BITS[item["param"]], length)}
    if item["master"]:
        names["master"] = (np.dtype("<f4"), length)
    if item["rounding"] == "kahan":
        names["compensation"] = (BITS[item["param"]], length)
    desc = {key: item[key] for key in ("param", "grad", "state", "master", "rounding", "seed")}
    placed = []
    for path, offset in sorted(zip(item["paths"], item["offsets"]), key=lambda p: p[1]):
        entry = ck.by_path.get(path) if isinstance(path, str) else None
        if entry is None or entry.group != group or path in ck.storage:
            raise ck.corrupt(f"{where}: path {str(path)[:200]!r} is not a parameter of this "
                             "group, or appears twice")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < end \
                or offset + entry.size > length or (
                item["state"] == "int8" and offset % BLOCK):
            raise ck.corrupt(f"{where}: {path!r} at offset {offset} overlaps, lies outside "
                             f"the buffer of {length} or breaks int8 block alignment")
        end = offset + entry.size
        placed.append((path, offset))
    slots = ck.schema.slots
    for name in slots:
        full = array_name(group, number, name)
        if full in ck.arrays:
            state_dtype = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2"),
                           "int8": np.dtype("u1")}[item["state"]]
            names[name] = (state_dtype, length)
            if item["state"] == "int8":
                names[f"{name}.absmax"] = (np.dtype("<f4"), -(-length // BLOCK))
    full_names = {}
    for name, (dtype, size) in names.items():
        full = array_name(group, number, name)
        saved = ck.arrays.get(full)
        if saved is None or saved.dtype != dtype or saved.shape != (size,):
            raise ck.corrupt(f"{where}: array {name!r} should be {dtype} of {size} values, "
                             f"is {'missing' if saved is None else f'{saved.dtype} {saved.shape}'}"
                             f" (its dtype is the storage's {item['param']!r}/"
                             f"{item['state']!r})")
        full_names[name] = full
    for path, offset in placed:
        ck.storage[path] = (desc, item["draws"], full_names, offset)


def array_problem(name: str, values: np.ndarray) -> str | None:
    """Why a stored array of the file cannot be what a save wrote (block scales negative or
    NaN; an infinite one is a block that held an inf), or None: ``load`` and ``verify`` make
    the same check."""
    if name.startswith(STORAGE_KEY + NEST) and name.endswith(".absmax"):
        problem = _lossless.scales_problem(values)
        return None if problem is None else f"storage array {name!r} {problem}"
    return None


def check_arrays(ck, arrays) -> None:
    """:func:`array_problem` over the file's extra arrays (by stored name)."""
    for name, values in arrays.items():
        problem = array_problem(name, values)
        if problem:
            raise ck.corrupt(problem)


def saved_records(ck, opt, matches, arrays, float32_entry, convert: bool) -> dict:
    """``_lossless.Saved`` for each (live info, saved entry) whose live buffer is coded or
    whose saved one is: from the stored arrays for a coded saved buffer (master weights and
    compensation of every parameter, with state or without), from the float32 view
    (``float32_entry(entry) -> (params, state entry or None)``) for a plain one."""
    out = {}
    for info, entry in matches:
        stored = ck.storage.get(entry.path)
        if stored is None:
            params, state = float32_entry(entry)
            out[info.path] = _lossless.Saved(_lossless.plain(entry.dtype), state, params)
            continue
        desc, draws, names, offset = stored
        window = slice(offset, offset + entry.size)
        dtype = numpy_dtype(desc["param"])
        params = arrays[names["params"]][window].view(dtype).reshape(entry.shape)
        state = None
        if ck.schema.stateful(entry.columns):
            state = {name: entry.columns[name] for name in ck.schema.state_dict_columns}
            for name in ck.schema.slots:
                if name not in names:
                    continue
                flat = arrays[names[name]][window]
                if desc["state"] == "bfloat16":
                    flat = flat.view(numpy_dtype("bfloat16"))
                if desc["state"] == "int8":
                    first = offset // BLOCK
                    scales = arrays[names[f"{name}.absmax"]]
                    state[name] = {"codes": flat.reshape(entry.shape), "absmax": scales[
                        first:first + _lossless.blocks(entry.size)]}
                else:
                    state[name] = flat.reshape(entry.shape)
        extras = {name: arrays[names[name]][window].view(
            dtype if name == "compensation" else np.float32).reshape(entry.shape)
            for name in _lossless.EXTRAS if name in names}
        out[info.path] = _lossless.Saved(desc, state, params, draws, extras)
    return out


def group_storage(ck, group: int) -> list[dict]:
    """What ``inspect`` shows of a group's storage: each coded buffer's settings in words."""
    seen, out = set(), []
    for path, (desc, draws, names, _) in ck.storage.items():
        key = names["params"]
        if ck.by_path[path].group == group and key not in seen:
            seen.add(key)
            out.append({"storage": _lossless.fmt(desc), **desc, "draws": draws})
    return out
