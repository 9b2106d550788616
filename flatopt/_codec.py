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
from ._storage import BFLOAT16, FLOAT16
from .kernels.coded import (BF16, COMPENSATION_AT, DIRECT, F16, KAHAN, MASTER, MASTER_AT,
                            NATIVE, NEAREST, POSITIONS, Q8_SIGNED, Q8_UNSIGNED, STOCHASTIC,
                            TABLES, UNUSED, Layout)
from .kernels.storage import BLOCK

_NO_BYTES = np.empty(0, np.uint8)
_NO_SCALES = np.empty(0, np.float32)


def half_format(dtype: np.dtype) -> int:
    return {BFLOAT16: BF16, FLOAT16: F16}.get(np.dtype(dtype), NATIVE)


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

    def arguments(self, draw: int) -> tuple:
        """The coded walk's leading arguments for the step that draws ``draw``."""
        return (self.stored, self.absmax, TABLES, self.seed, np.uint64(draw))


def coded_plan(buf: FlatBuffer, schema, used) -> CodedPlan:
    """The kernel arguments of ``buf`` whose slots ``used`` are allocated."""
    storage = buf.storage
    if len(schema.rule.slots) > POSITIONS - 4:
        raise TypeError(f"rule {schema.rule.name!r} has more state slots than the codec walk "
                        f"takes ({POSITIONS - 4})")
    stored = [_NO_BYTES] * POSITIONS
    formats = [UNUSED] * POSITIONS
    absmax = [_NO_SCALES] * POSITIONS
    stored[0], formats[0] = buf.params.view(np.uint8), half_format(storage.param)
    stored[1], formats[1] = buf.grads.view(np.uint8), half_format(storage.grad)
    for position, name in enumerate(schema.rule.slots, start=2):
        if name in used:
            stored[position] = buf.state[name].view(np.uint8)
            formats[position] = slot_format(buf, schema, name)
            absmax[position] = buf.absmax.get(name, _NO_SCALES)
    if buf.master is not None:
        stored[MASTER_AT], formats[MASTER_AT] = buf.master.view(np.uint8), NATIVE
    if buf.compensation is not None:
        stored[COMPENSATION_AT] = buf.compensation.view(np.uint8)
        formats[COMPENSATION_AT] = formats[0]
    mode = MASTER if storage.master else KAHAN if storage.rounding == "kahan" else DIRECT
    rounding = STOCHASTIC if storage.rounding == "stochastic" else NEAREST
    return CodedPlan(tuple(stored), tuple(absmax), Layout(tuple(formats), mode, rounding),
                     np.uint64(storage.seed))


def new_slot(buf: FlatBuffer, schema, name: str, initial: float) -> np.ndarray:
    """Slot ``name`` of ``buf`` holding ``initial`` everywhere, in its stored format (an int8
    slot's block scales go into ``buf.absmax[name]``)."""
    flat, scales = fresh_slot(buf, schema, name, initial)
    if scales is not None:
        buf.absmax[name] = scales
    return flat


def fresh_slot(buf: FlatBuffer, schema, name: str, initial: float):
    """``(stored array, int8 block scales or None)`` of slot ``name`` of ``buf`` holding
    ``initial`` everywhere; ``buf`` is left as it is (a restore builds its arrays aside)."""
    length = buf.layout(name).length
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
        values = TABLES[fmt - Q8_SIGNED][flat] * scales
    else:
        values = flat.astype(np.float32)
    return values.reshape(buf.shapes[slot])


def master_values(buf: FlatBuffer, slot: int) -> np.ndarray | None:
    """Parameter ``slot``'s float32 master weights (a view), or None without them."""
    return None if buf.master is None else buf.view(buf.master, slot)


def reset_parameter(buf: FlatBuffer, slot: int) -> None:
    """After a parameter's 16-bit values were written from outside: its master copy takes
    them and its Kahan compensation is cleared."""
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
    """``Optimizer.memory``: bytes by kind over ``buffers``, and their total."""
    totals = {"params": 0, "grads": 0, "master": 0, "state": 0}
    for buf in buffers:
        for kind, size in buf.memory().items():
            totals[kind] += size
    totals["total"] = sum(totals.values())
    return totals
