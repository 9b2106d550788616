"""Reduced-precision buffers held losslessly outside the optimizer (state dicts, checkpoints):
each buffer's storage described, each parameter's stored arrays taken out as they are (16-bit
bit patterns, 8-bit codes with their block scales, master weights, Kahan compensation),
checked, converted through float32 values when asked, and put back all at once.

A lossless entry of one parameter (``state_dict()["state"][path]`` of a coded buffer) holds
its state-dict columns, each state slot as stored (a float32 or ``ml_dtypes.bfloat16`` array
of the slot's shape; for int8 a dict ``{"codes": uint8 array, "absmax": float32 array}``, one
scale per 256-element block from the parameter's first element), and ``master`` (float32) and
``compensation`` (the parameter's 16-bit dtype) where the buffer keeps them. Those two are
kept for every parameter of such a buffer, with state or without (SGD without momentum): they
are the parameter's value beyond its 16 bits, so a parameter without state has an entry that
holds only them (:func:`split`).

Converted (``convert=True``), a parameter takes the best float32 value saved for it: its
master weights, else its 16-bit value plus its Kahan compensation (the 16-bit value alone
without one); a 16-bit target gets that value rounded to nearest and, with Kahan summation,
what the rounding lost as its compensation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _codec
from ._storage import FLOAT32, dtype_name, numpy_dtype
from .kernels.coded import TABLES
from .kernels.storage import BLOCK, DYNAMIC_SIGNED, DYNAMIC_UNSIGNED

EXTRAS = ("master", "compensation")
COMPARED = ("param", "state", "master", "rounding", "seed")
"""The storage settings a lossless load needs equal (the gradient dtype holds no state)."""
FLOAT_NAMES = ("float32", "float64", "bfloat16", "float16")
"""The dtypes a storage description may name (``numpy_dtype`` gives each)."""


def describe(buf) -> dict[str, Any]:
    """A buffer's storage as JSON-able settings (a plain buffer: everything its dtype)."""
    s = buf.storage
    if s is None:
        name = buf.dtype.name
        return {"param": name, "grad": name, "state": name, "master": False,
                "rounding": "nearest", "seed": 0}
    return {"param": dtype_name(s.param), "grad": dtype_name(s.grad), "state": s.state,
            "master": bool(s.master), "rounding": s.rounding, "seed": int(s.seed)}


def plain(dtype_text: str) -> dict[str, Any]:
    return {"param": dtype_text, "grad": dtype_text, "state": dtype_text, "master": False,
            "rounding": "nearest", "seed": 0}


def fmt(desc: Mapping) -> str:
    """A storage description in words (for errors and ``inspect``)."""
    parts = [f"params {desc['param']}"]
    if desc.get("grad") not in (None, desc["param"]):
        parts.append(f"grads {desc['grad']}")
    if desc["master"]:
        parts.append("float32 master weights")
    elif desc["param"] in ("bfloat16", "float16"):
        parts.append(f"rounding {desc['rounding']}")
    parts.append(f"state {desc['state']}")
    if desc["param"] in ("bfloat16", "float16") or desc["state"] == "bfloat16":
        parts.append(f"seed {desc['seed']}")
    return ", ".join(parts)


def same(a: Mapping, b: Mapping) -> bool:
    return all(a.get(key) == b.get(key) for key in COMPARED)


def blocks(size: int) -> int:
    return -(-int(size) // BLOCK)


def signed(schema, name: str) -> bool:
    return not schema.slots[name].nonnegative


# ----------------------------------------------------------------------------- codecs
def decode(value: Any, state: str, is_signed: bool, size: int) -> np.ndarray:
    """A stored slot value (array, or int8's dict) as float32 values of its shape."""
    if state == "int8":
        codes = np.asarray(value["codes"])
        scales = np.repeat(np.asarray(value["absmax"], np.float32), BLOCK)[:size]
        table = TABLES[0 if is_signed else 1]
        with np.errstate(invalid="ignore"):  # an infinite scale: 0 * inf is NaN, as stepped
            return (table[codes.reshape(-1)] * scales).reshape(codes.shape)
    return np.asarray(value).astype(np.float32)


def _q8_encode(x: np.ndarray, is_signed: bool) -> dict:
    """bitsandbytes' CPU blockwise quantization of ``x`` (float32, per 256-element block from
    its first element): the code nearest to each normalized value on its 1/65535 grid."""
    flat = np.ascontiguousarray(x, np.float32).reshape(-1)
    n = flat.size
    padded = np.zeros(blocks(n) * BLOCK, np.float32)
    padded[:n] = flat
    magnitudes = np.abs(padded.reshape(-1, BLOCK))
    # NaN skipped, an inf kept, as the kernels' q8_block_absmax: never a NaN scale
    absmax = np.where(np.isnan(magnitudes), np.float32(0), magnitudes).max(axis=1) \
        .astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (padded.reshape(-1, BLOCK) * (np.float32(1) / absmax)[:, None]).reshape(-1)[:n]
        c = np.clip(v, np.float32(-1), np.float32(1)).astype(np.float32)
        t = ((c + np.float32(1)) * np.float32(0.5) * np.float32(65535)
             + np.float32(0.5)).astype(np.float32)
    k = np.where(np.isnan(t), 0, np.nan_to_num(t)).astype(np.int64)
    grid = (np.float32(-1) + np.float32(2) * k.astype(np.float32) / np.float32(65535))
    code = (DYNAMIC_SIGNED if is_signed else DYNAMIC_UNSIGNED).astype(np.float32)
    mid = (np.float32(0.5) * (code[:-1] + code[1:])).astype(np.float32)
    codes = np.searchsorted(mid, grid.astype(np.float32), side="left").astype(np.uint8)
    return {"codes": codes.reshape(x.shape), "absmax": absmax}


def encode(values: np.ndarray, state: str, is_signed: bool) -> Any:
    """float32 ``values`` in the stored format ``state`` (nearest rounding)."""
    if state == "int8":
        return _q8_encode(values, is_signed)
    return np.asarray(values, np.float32).astype(numpy_dtype(state))


# ----------------------------------------------------------------------------- out
def path_entry(opt, buf, slot: int, columns: Mapping[str, Any] | None = None) -> dict:
    """Parameter ``slot`` of coded ``buf``: its state-dict columns and stored arrays (copies)."""
    schema = opt.schema
    entry = dict(columns) if columns is not None else {
        name: buf.columns[name][slot].item() for name in schema.state_dict_columns}
    start, size = int(buf.offsets[slot]), int(buf.sizes[slot])
    for name in schema.slots:
        if name not in buf.state:
            continue
        view = buf.state[name][start:start + size].reshape(buf.shapes[slot]).copy()
        if name in buf.absmax:
            first = start // BLOCK
            entry[name] = {"codes": view,
                           "absmax": buf.absmax[name][first:first + blocks(size)].copy()}
        else:
            entry[name] = view
    entry.update(extras_entry(buf, slot))
    return entry


def extras_entry(buf, slot: int) -> dict:
    """Parameter ``slot``'s master weights and compensation where ``buf`` keeps them
    (copies): the entry of a parameter without state."""
    return {name: buf.view(getattr(buf, name), slot).copy() for name in EXTRAS
            if getattr(buf, name) is not None}


def split(schema, entry: Any) -> tuple[Any, dict]:
    """A saved entry of a coded buffer as (its state, or None for a parameter without state;
    its master weights and compensation): an entry holding nothing but those is a parameter
    without state (state holds a column or a slot; only an eager schema's entries are state
    whatever they hold)."""
    if not isinstance(entry, Mapping):
        return entry, {}
    extras = {key: value for key, value in entry.items() if key in EXTRAS}
    state = {key: value for key, value in entry.items() if key not in EXTRAS}
    if extras and not state and not schema.eager:
        return None, extras
    return state, extras


# ----------------------------------------------------------------------------- checks
def scales_problem(absmax: np.ndarray) -> str | None:
    """Why ``absmax`` are not int8 block scales a step writes: each the largest magnitude of
    its block, >= 0 and never NaN, but inf for a block that holds an inf (torch keeps an
    infinite momentum too: it is saved and loaded as it is)."""
    if not (absmax >= 0).all():  # False for NaN
        return "has block scales that are negative or NaN"
    return None


def _array_problem(value: Any, shape: tuple, dtype: np.dtype) -> str | None:
    if not isinstance(value, np.ndarray):
        return f"must be an array, got {type(value).__name__}"
    if value.dtype != dtype or tuple(value.shape) != tuple(shape):
        return (f"must be {dtype_name(dtype)} of shape {tuple(shape)}, is "
                f"{dtype_name(value.dtype)} {tuple(value.shape)}")
    return None


def entry_problems(opt, path: str, entry: Any, desc: Mapping, shape: tuple,
                   settings: Mapping) -> list[str]:
    """Why ``entry`` (without master weights and compensation, see :func:`split`) is not a
    lossless entry of a parameter of ``shape`` stored as ``desc`` (its stored arrays' dtypes
    and shapes, int8 codes and scales, then the schema's own checks of the decoded float32
    values)."""
    schema = opt.schema
    if not isinstance(entry, Mapping):
        return [f"state for {path!r} must be a dict, got {type(entry).__name__}"]
    problems = []
    size = int(np.prod(shape, dtype=np.int64))
    decoded = dict(entry)
    for name in schema.slots:
        value = entry.get(name)
        if value is None:
            continue
        where = f"state for {path!r}: {name}"
        if desc["state"] == "int8":
            if not isinstance(value, Mapping) or set(value) != {"codes", "absmax"}:
                problems.append(f"{where} must be a dict with 'codes' and 'absmax' (int8)")
                continue
            problem = (_array_problem(value["codes"], shape, np.dtype(np.uint8))
                       or _array_problem(value["absmax"], (blocks(size),), FLOAT32)
                       or scales_problem(value["absmax"]))
        else:
            problem = _array_problem(value, shape, numpy_dtype(desc["state"]))
        if problem:
            problems.append(f"{where} {problem}")
            continue
        decoded[name] = decode(value, desc["state"], signed(schema, name), size)
    if problems:
        return problems
    return schema.state_problems(path, decoded, shape, FLOAT32, settings)


def extras_problems(path: str, extras: Mapping, desc: Mapping, shape: tuple) -> list[str]:
    """Why ``extras`` are not the master weights and compensation a parameter of ``shape``
    stored as ``desc`` keeps (exactly those it keeps, each of its shape and dtype)."""
    problems = []
    wanted = {"master": desc["master"], "compensation": desc["rounding"] == "kahan"}
    for name, kept in wanted.items():
        dtype = FLOAT32 if name == "master" else numpy_dtype(desc["param"])
        if not kept:
            if name in extras:
                problems.append(f"state for {path!r} has {name!r}, which {fmt(desc)} lacks")
        elif name not in extras:
            problems.append(f"state for {path!r} lacks {name!r} ({fmt(desc)})")
        else:
            problem = _array_problem(extras[name], shape, dtype)
            if problem:
                problems.append(f"state for {path!r}: {name} {problem}")
    return problems


def to_float32(opt, entry: Mapping, desc: Mapping, shape: tuple) -> dict:
    """A checked lossless entry (without master weights and compensation) as the float32
    entry a plain buffer keeps."""
    size = int(np.prod(shape, dtype=np.int64))
    out = {key: value for key, value in entry.items()
           if key not in EXTRAS and key not in opt.schema.slots}
    for name in opt.schema.slots:
        if entry.get(name) is not None:
            out[name] = decode(entry[name], desc["state"], signed(opt.schema, name), size)
    return out


def from_float32(opt, entry: Mapping, desc: Mapping) -> dict:
    """A float32 entry in the stored format ``desc`` (conversion; its slots encoded)."""
    out = {key: value for key, value in entry.items() if key not in opt.schema.slots}
    for name in opt.schema.slots:
        if entry.get(name) is not None:
            out[name] = encode(np.asarray(entry[name], np.float32), desc["state"],
                               signed(opt.schema, name))
    return out


# ----------------------------------------------------------------------------- in
class Staged:
    """New contents of one coded buffer, built aside from its live arrays; :meth:`commit`
    puts them in (it cannot fail)."""

    def __init__(self, opt, buf, settings: Mapping):
        self.buf = buf
        self.params = buf.params.copy()
        self.master = None if buf.master is None else buf.master.copy()
        self.compensation = None if buf.compensation is None else buf.compensation.copy()
        # a parameter's constants (Optimizer.path_columns: a chain's masks) are not state
        self.columns = {name: column.copy() if name in opt.path_columns
                        else np.zeros_like(column) for name, column in buf.columns.items()}
        self.draws = buf.draws
        self.loaded = False
        """Whether a saved buffer's draws were taken (the largest of them is kept)."""
        self.state: dict[str, np.ndarray] = {}
        self.absmax: dict[str, np.ndarray] = {}
        self.opt, self.settings = opt, settings
        for name in buf.state:
            self._fresh(name)

    def _fresh(self, name: str) -> None:
        initial = self.opt.schema.initial_value(name, self.settings) \
            if self.opt.schema.eager else 0.0
        self.state[name], scales = _codec.fresh_slot(self.buf, self.opt.schema, name, initial)
        if scales is not None:
            self.absmax[name] = scales

    def set_params(self, slot: int, values: np.ndarray, master: np.ndarray | None = None,
                   compensation: np.ndarray | None = None) -> None:
        """A parameter's stored values (its dtype's bits); master weights and compensation
        as given, else from the values and zero."""
        buf = self.buf
        buf.view(self.params, slot)[...] = values
        if self.master is not None:
            buf.view(self.master, slot)[...] = (master if master is not None
                                                else buf.view(self.params, slot).astype(FLOAT32))
        if self.compensation is not None:
            buf.view(self.compensation, slot)[...] = (0 if compensation is None
                                                      else compensation)

    def set_state(self, slot: int, entry: Mapping) -> None:
        """A checked lossless entry (in this buffer's format) for parameter ``slot``."""
        buf, schema = self.buf, self.opt.schema
        if schema.marker is not None:
            self.columns[schema.marker][slot] = 1
        for key, value in entry.items():
            if key in self.columns:
                self.columns[key][slot] = value
        start, size = int(buf.offsets[slot]), int(buf.sizes[slot])
        for name in schema.slots:
            value = entry.get(name)
            if value is None:
                continue
            if name not in self.state:
                self._fresh(name)
            if isinstance(value, Mapping):
                self.state[name][start:start + size] = np.asarray(value["codes"]).reshape(-1)
                first = start // BLOCK
                self.absmax[name][first:first + blocks(size)] = value["absmax"]
            else:
                self.state[name][start:start + size] = np.asarray(value).reshape(-1)

    def commit(self) -> None:
        buf = self.buf
        np.copyto(buf.params, self.params)  # the views handed out stay valid
        for name in EXTRAS:
            if getattr(buf, name) is not None:
                np.copyto(getattr(buf, name), getattr(self, name))
        for name, column in buf.columns.items():
            column[...] = self.columns[name]
        # into the live arrays where they exist, as a float32 restore writes: the views
        # handed out (state_of records, the plans) keep seeing the state
        for live, new in ((buf.state, self.state), (buf.absmax, self.absmax)):
            for name, flat in new.items():
                held = live.get(name)
                if held is not None and held.shape == flat.shape and held.dtype == flat.dtype:
                    np.copyto(held, flat)
                else:
                    live[name] = flat
            for name in [name for name in live if name not in new]:
                del live[name]
        buf.draws = int(self.draws)


def commit(opt, staged: Mapping[int, Staged]) -> None:
    """Every staged buffer in, then the plans rebuilt (they hold the old arrays)."""
    for item in staged.values():
        item.commit()
    if staged:
        opt.invalidate_plans()


# ----------------------------------------------------------------------------- loads
class Saved:
    """One saved parameter as a load hands it over: its storage ``desc``, its state ``entry``
    (lossless in ``desc``'s format, without master weights and compensation; float32 values
    for a plain one) or None, its stored parameter values (``params``, ``desc["param"]``'s
    dtype; None: keep the live ones), the ``draws`` of the buffer it was saved from (None: a
    plain buffer) and its ``extras``: master weights and compensation as saved (checked
    against ``desc``; None: nothing was saved for the parameter, the live ones are kept)."""

    def __init__(self, desc: Mapping, entry: Any = None, params: np.ndarray | None = None,
                 draws: int | None = None, extras: Mapping | None = None):
        self.desc, self.entry, self.params, self.draws = desc, entry, params, draws
        self.extras = extras


def mismatch(path: str, saved: Mapping, live: Mapping, what: str) -> str:
    return (f"{path!r}: {what} stores {fmt(saved)}, this optimizer {fmt(live)}; pass "
            "convert=True to convert through float32 values")


def stage(opt, saved: Mapping[str, Saved], settings, convert: bool, problems: list,
          what: str = "the state dict") -> tuple[dict[int, Staged], dict[str, Any],
                                                dict[str, np.ndarray]]:
    """``(staged coded buffers, state entries and parameter values for the plain buffers)``
    for a load of ``saved`` (path -> :class:`Saved`); every coded buffer is staged
    (parameters without a saved entry get fresh state). A storage that differs from the
    live one is a problem naming the path and both formats unless ``convert``; converted
    into a plain buffer, a parameter takes the best float32 value saved (the module
    docstring)."""
    live_settings = opt.settings()
    effective = [new if new is not None else old
                 for new, old in zip(settings or [None] * len(live_settings), live_settings)]
    staged = {buf.number: Staged(opt, buf, effective[buf.group])
              for buf in opt.buffers if buf.coded}
    plain_state: dict[str, Any] = {}
    plain_params: dict[str, np.ndarray] = {}
    for path, item in saved.items():
        info = opt.index.get(path) if isinstance(path, str) else None
        if info is None:
            continue  # the caller reports unknown paths
        buf = opt.buffers[info.buffer]
        live = describe(buf)
        if not buf.coded and item.draws is None:
            if item.entry is not None:
                plain_state[path] = item.entry
            if item.params is not None:
                plain_params[path] = item.params
            continue
        exact = same(item.desc, live)
        if not exact and not convert:
            problems.append(mismatch(path, item.desc, live, what))
            continue
        found = _take(opt, buf, info, item, live, exact, effective[info.group], problems)
        if found is None:
            continue
        entry, params, master, compensation = found
        if not buf.coded:
            if entry is not None:
                plain_state[path] = entry
            if params is not None:
                plain_params[path] = params
            continue
        target = staged[buf.number]
        if params is not None or master is not None or compensation is not None:
            values = params if params is not None else buf.view(buf.params, info.slot)
            target.set_params(info.slot, values, master, compensation)
        if entry is not None:
            target.set_state(info.slot, entry)
        if item.draws is not None:
            target.draws = max(target.draws if target.loaded else 0, item.draws)
            target.loaded = True
    return staged, plain_state, plain_params


def _take(opt, buf, info, item: Saved, live: Mapping, exact: bool, settings,
          problems: list):
    """``(entry, params, master, compensation)`` of one saved parameter in the live format
    (converted through float32 values unless ``exact``), or None after adding its problems."""
    entry, desc, extras = item.entry, item.desc, item.extras or {}
    if item.draws is not None and (entry is not None or item.extras is not None):
        more = [] if entry is None else entry_problems(opt, info.path, entry, desc,
                                                       info.shape, settings)
        more += extras_problems(info.path, extras, desc, info.shape)
        if more:
            problems += more
            return None
    if exact:
        return entry, item.params, extras.get("master"), extras.get("compensation")
    values = _best_values(buf, info, item.params, extras)
    if entry is not None and item.draws is not None:
        entry = to_float32(opt, entry, desc, info.shape)
    if not buf.coded:
        if entry is not None:
            entry = {key: (np.asarray(value).astype(buf.dtype) if key in opt.schema.slots
                           else value) for key, value in entry.items()}
        return entry, None if values is None else values.astype(buf.dtype), None, None
    if entry is not None:
        more = opt.schema.state_problems(info.path, entry, info.shape, FLOAT32, settings)
        if more:
            problems += more
            return None
        entry = from_float32(opt, entry, live)
    if values is None:
        master = buf.view(buf.params, info.slot).astype(FLOAT32) if live["master"] else None
        return entry, None, master, None
    dtype = numpy_dtype(live["param"])
    params = values.astype(dtype)
    compensation = None
    if live["rounding"] == "kahan":  # what rounding to nearest lost, carried on
        compensation = (values - params.astype(FLOAT32)).astype(dtype)
    return entry, params, (values if live["master"] else None), compensation


def _best_values(buf, info, params: np.ndarray | None, extras: Mapping) -> np.ndarray | None:
    """The best float32 values saved for a parameter: its master weights; else its 16-bit
    values plus their Kahan compensation (a state dict holds no parameters: the live ones,
    which a state-dict load takes for the saved ones); else its values; None: nothing."""
    if extras.get("master") is not None:
        return np.array(extras["master"], FLOAT32)
    compensation = extras.get("compensation")
    if params is None and compensation is not None:
        params = buf.view(buf.params, info.slot)
    if params is None:
        return None
    values = np.asarray(params).astype(FLOAT32)
    if compensation is not None:
        values = values + np.asarray(compensation).astype(FLOAT32)  # one float32 rounding
    return values
