"""Layouts read by name inside kernels: a rule's scalars, columns and flags are NamedTuple
classes; :func:`positions` turns one into constant indices (``scalars[S.beta2]``)."""

from __future__ import annotations

import types
from typing import NamedTuple

_positions: dict[type, types.ModuleType] = {}


def positions(layout: type[NamedTuple]) -> types.ModuleType:
    """The layout's fields as constant positions for kernels: ``scalars[S.beta2]``,
    ``columns[C.step]``. A module object, because Numba folds a module attribute into a
    constant index, which a tuple of mixed array types needs. One object per layout, so a
    backend can tell a rule's reads of its flags (``kernels/variants.py``)."""
    holder = _positions.get(layout)
    if holder is None:
        holder = _positions[layout] = types.ModuleType(f"{layout.__name__}Positions")
        for position, name in enumerate(layout._fields):
            setattr(holder, name, position)
    return holder
