"""One difference between a checkpoint and an optimizer (or between a file and what this
flatopt reads): the record ``compare`` builds, ``reader`` raises for a newer file, and
``CheckpointMismatch.differences`` holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .format import jsonable


@dataclass(frozen=True)
class Difference:
    """One way a checkpoint differs from the optimizer it is loaded into."""

    kind: str
    """format, optimizer, missing, unexpected, shape, dtype, id, group, groups, hyperparameter,
    flag, rename, scheduler"""
    where: str
    """The parameter path, the group, or "file"."""
    saved: Any = None
    live: Any = None
    relaxed_by: str | None = None
    """The load option that accepts this difference, or None if nothing does."""
    note: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "saved": jsonable(self.saved),
                "live": jsonable(self.live), "relaxed_by": self.relaxed_by, "note": self.note}

    def __str__(self) -> str:
        text = f"{self.kind:<14} {self.where}: "
        if self.kind == "missing":
            text += "in the optimizer, not in the checkpoint"
        elif self.kind == "unexpected":
            text += "in the checkpoint, not in the optimizer"
        else:
            text += f"saved {_show(self.saved)}, live {_show(self.live)}"
        if self.note:
            text += f" ({self.note})"
        if self.relaxed_by:
            text += f"  [{self.relaxed_by}]"
        return text


def _show(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, (int, np.integer)) for v in value):
        return str(tuple(int(v) for v in value))
    return repr(value) if isinstance(value, str) else str(value)
