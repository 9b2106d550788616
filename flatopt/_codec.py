"""The host side of reduced-precision buffers (``FlatBuffer.coded``): their kernel arguments
for ``kernels/coded.py``, fresh state in its stored format, and float32 values read back.

The formats themselves are ``kernels/storage.py``'s (bfloat16 and float16 bit patterns,
bitsandbytes' 8-bit blockwise codes); what reads them in NumPy here gives the same float32
values the kernels load.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._layout import FlatBuffer, aligned_zeros
from ._storage import is_bfloat16
from .kernels.coded import (BF16, COMPENSATION_AT, DIRECT, F16, KAHAN, MASTER, MASTER_AT,
                            NATIVE, NEAREST, POSITIONS, Q8_SIGNED, Q8_UNSIGNED, STOCHASTIC,
                            TABLES, UNUSED, Layout)
from .kernels.storage import BLOCK

_NO_BYTES = np.empty(0, np.uint8)
_NO_SCALES = np.empty(0, np.float32)


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of a Numba (device) array holding ``dtype``: bfloat16 as its uint16 bit
    patterns (Numba has no bfloat16), every other dtype as it is."""
    return np.dtype(np.uint16) if is_bfloat16(np.dtype(dtype)) else np.dtype(dtype)


def as_bits(array: np.ndarray) -> np.ndarray:
    """``array`` viewed as :func:`bits_dtype` of its dtype."""
    return array.view(bits_dtype(array.dtype))


def half_format(dtype: np.dtype) -> int:
    return {"bfloat16": BF16, "float16": F16}.get(np.dtype(dtype).name, NATIVE)


def slot_format(buf: FlatBuffer, schema, name: str) -> int:
    """How slot ``name`` of ``buf`` is stored (a ``kernels.coded`` format)."""
    state = buf.storage.state
    if state == "bfloat16":
        return BF16
    if state == "int8":
        return Q8_UNSIGNED if schema.slots[name].nonnegative else Q8_SIGNED
    return NATIVE


class CodedPlan(NamedTuple):
    """The parts of a coded buffer's kernel arguments that stay while its plan does: the
    ``POSITIONS`` stored arrays as bytes, their block scales, and their :class:`Layout`
    (which picks the compiled walk)."""

    stored: tuple
    absmax: tuple
    layout: Layout
    seed: np.uint64
    base: np.uint64 = np.uint64(0)
    """The buffer element of the arrays' first (a ZeRO-1 rank's range starts there)."""
    tables: np.ndarray = TABLES
    """The 8-bit code tables where the arrays live."""

    def arguments(self, draw: int) -> tuple:
        """The coded walk's leading arguments for the step that draws ``draw``."""
        return (self.stored, self.absmax, self.tables, self.seed, np.uint64(draw), self.base)


class HostArrays(NamedTuple):
    """What a plan over host arrays stands in for unused positions, and its code tables."""

    no_bytes: np.ndarray = _NO_BYTES
    no_scales: np.ndarray = _NO_SCALES
    tables: np.ndarray = TABLES


def coded_plan(buf: FlatBuffer, schema, used, part=None, device=None) -> CodedPlan:
    """The kernel arguments of ``buf`` whose slots ``used`` are allocated; with ``part`` (a
    ZeRO-1 ``BufferShard``), of its range: its views of the parameters and gradients, its
    state, block scales, master weights and compensation, and its first element as ``base``;
    with ``device`` (a ``flatopt._device_buffers.DeviceBuffer``: the same names, and ``empty``, a
    :class:`HostArrays` of device arrays), of its device arrays."""
    storage = buf.storage
    if len(schema.rule.slots) > POSITIONS - 4:
        raise TypeError(f"rule {schema.rule.name!r} has more state slots than the codec walk "
                        f"takes ({POSITIONS - 4})")
    base = 0 if part is None else part.lo
    src = device if device is not None else buf if part is None else part  # the same names
    empty = HostArrays() if device is None else device.empty
    stored = [empty.no_bytes] * POSITIONS
    formats = [UNUSED] * POSITIONS
    absmax = [empty.no_scales] * POSITIONS
    stored[0], formats[0] = src.params.view(np.uint8), half_format(storage.param)
    stored[1], formats[1] = src.grads.view(np.uint8), half_format(storage.grad)
    for position, name in enumerate(schema.rule.slots, start=2):
        if name in used:
            stored[position] = src.state[name].view(np.uint8)
            formats[position] = slot_format(buf, schema, name)
            absmax[position] = src.absmax.get(name, empty.no_scales)
    if src.master is not None:
        stored[MASTER_AT], formats[MASTER_AT] = src.master.view(np.uint8), NATIVE
    if src.compensation is not None:
        stored[COMPENSATION_AT] = src.compensation.view(np.uint8)
        formats[COMPENSATION_AT] = formats[0]
    mode = MASTER if storage.master else KAHAN if storage.rounding == "kahan" else DIRECT
    rounding = STOCHASTIC if storage.rounding == "stochastic" else NEAREST
    return CodedPlan(tuple(stored), tuple(absmax), Layout(tuple(formats), mode, rounding),
                     np.uint64(storage.seed), np.uint64(base), empty.tables)


def new_slot(buf: FlatBuffer, schema, name: str, initial: float, length: int | None = None,
             absmax: dict | None = None) -> np.ndarray:
    """Slot ``name`` of ``buf`` holding ``initial`` everywhere, in its stored format (an int8
    slot's block scales go into ``absmax[name]``, by default ``buf.absmax``); ``length``
    elements and ``absmax`` for a ZeRO-1 rank's range."""
    flat, scales = fresh_slot(buf, schema, name, initial, length)
    if scales is not None:
        (buf.absmax if absmax is None else absmax)[name] = scales
    return flat


def fresh_slot(buf: FlatBuffer, schema, name: str, initial: float, length: int | None = None):
    """``(stored array, int8 block scales or None)`` of slot ``name`` of ``buf`` holding
    ``initial`` everywhere (``length`` elements, by default the slot's); ``buf`` is left as it
    is (a restore builds its arrays aside)."""
    length = buf.layout(name).length if length is None else length
    fmt = slot_format(buf, schema, name)
    if fmt in (Q8_SIGNED, Q8_UNSIGNED):
        codes = aligned_zeros(length, np.uint8)
        scales = np.zeros(-(-length // BLOCK), np.float32)
        table = TABLES[fmt - Q8_SIGNED]
        zero = int(np.argmin(np.abs(table)))
        codes.fill(zero)
        if initial:
            scales.fill(abs(np.float32(initial)))
            codes.fill(int(np.argmin(np.abs(table - np.sign(initial)))))
        return codes, scales
    flat = aligned_zeros(length, buf.storage.state_array_dtype)
    if initial:
        flat.fill(initial)
    return flat, None


def read_slot(buf: FlatBuffer, schema, name: str, slot: int) -> np.ndarray:
    """Parameter ``slot``'s entry of state slot ``name`` as float32 values (a new array)."""
    start, size = int(buf.offsets[slot]), int(buf.sizes[slot])
    flat = buf.state[name][start:start + size]
    fmt = slot_format(buf, schema, name)
    if fmt in (Q8_SIGNED, Q8_UNSIGNED):
        scales = np.repeat(buf.absmax[name][start // BLOCK:-(-(start + size) // BLOCK)],
                           BLOCK)[:size]
        with np.errstate(invalid="ignore"):  # an infinite scale: 0 * inf is NaN, as stepped
            values = TABLES[fmt - Q8_SIGNED][flat] * scales
    else:
        values = flat.astype(np.float32)
    return values.reshape(buf.shapes[slot])


def master_values(buf: FlatBuffer, slot: int) -> np.ndarray | None:
    """Parameter ``slot``'s float32 master weights (a view), or None without them."""
    return None if buf.master is None else buf.view(buf.master, slot)


def reset_parameter(buf: FlatBuffer, slot: int) -> None:
    """After a parameter's 16-bit values were written from outside: its master copy takes
    them and its Kahan compensation is cleared (under ZeRO-1, ``buf.part``'s range of them)."""
    if buf.part is not None:
        buf.part.reset_parameter(slot)
        return
    if buf.master is not None:
        buf.view(buf.master, slot)[...] = buf.view(buf.params, slot).astype(np.float32)
    if buf.compensation is not None:
        buf.view(buf.compensation, slot).fill(0)


def scale_gradients(buf: FlatBuffer, factor: float) -> None:
    """Multiply the present 16-bit gradients of ``buf`` by ``factor`` (in float32, rounded to
    nearest)."""
    for slot in np.flatnonzero(buf.present):
        view = buf.view(buf.grads, slot)
        view[...] = (view.astype(np.float32) * np.float32(factor)).astype(view.dtype)


def memory(buffers) -> dict[str, int]:
    """``Optimizer.memory``: bytes by kind over ``buffers`` (or ZeRO-1 shards, which count
    their rank's state and master weights), and their total."""
    totals = {"params": 0, "grads": 0, "master": 0, "state": 0}
    for buf in buffers:
        for kind, size in buf.memory().items():
            totals[kind] += size
    totals["total"] = sum(totals.values())
    return totals
