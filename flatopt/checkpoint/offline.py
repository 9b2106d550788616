"""``read``: a checkpoint's contents without an optimizer (evaluation, export, inspection),
verified by the same reader and the same checks as ``load``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import files
from .format import check_flags, nested_arrays
from .loader import guarded, open_checkpoint, saved_state_entry, verify_one


@dataclass
class CheckpointData:
    """What :func:`read` returns."""

    path: str
    optimizer: str
    """The registry name of the optimizer that wrote the file ("Adam", "SGD", ...)."""
    params: dict[str, np.ndarray]
    """Parameter values by path, with their saved shapes and dtypes."""
    groups: list[dict]
    """Per param group, in order: ``label``, ``hyperparameters`` (validated, with
    ``initial_lr`` when saved) and ``paths`` (in id order)."""
    metadata: Any
    scheduler_state: Any
    state: dict[str, dict] | None = None
    """With ``read(state=True)``: path -> ``{column: value, slot: array}`` as in
    ``opt.state_dict()["state"]``, for each parameter with state; otherwise None."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """The extra arrays saved with ``save(arrays=...)``, nested as saved (with flatopt's own,
    ``save(ema=, scaler=)``, under the keys ``"flatopt:ema"`` and ``"flatopt:scaler"``)."""
    info: dict = field(default_factory=dict)
    """The file's header: format and library versions, optimizer, schema version."""


def read(source, *, state: bool = False, arrays: bool = True) -> CheckpointData:
    """Read a checkpoint without building an optimizer: the parameters by path (and, with
    ``state=True``, each parameter's optimizer state), the extra arrays, the metadata, the
    scheduler state and each group's hyperparameters.

    The file goes through ``load``'s reader and checks (structure, commit digest, meaning
    against the optimizer's schema); every buffer read is verified (its block checksums, and
    the state's values), so every byte returned has been checked. ``source`` is a path,
    bytes or a binary file object. Raises ``CheckpointCorrupt`` for a damaged file,
    ``CheckpointMismatch`` for one written by a newer flatopt.

    Each array returned is a view into a flat buffer read for this call (nothing else holds
    it); buffers of state slots are read only with ``state=True``, extra arrays only with
    ``arrays=True``."""
    check_flags(state=state, arrays=arrays)
    with open_checkpoint(source) as ck, files.pool() as workers:
        schema = ck.schema
        staged = {(key, slot): verify_one(ck, key, slot, workers)
                  for key, saved in sorted(ck.buffers.items()) for slot in saved.datasets
                  if state or slot == "params"}
        params, states = {}, {} if state else None
        for entry in ck.params:
            key = (entry.group, entry.dtype)
            window = slice(entry.offset, entry.offset + entry.size)
            params[entry.path] = staged[key, "params"][window].reshape(entry.shape)
            if state and schema.stateful(entry.columns):
                states[entry.path] = saved_state_entry(ck, entry, staged, entry.shape)
        groups = [{"label": group["label"], "hyperparameters": dict(group["hyperparameters"]),
                   "paths": [e.path for e in sorted(ck.params, key=lambda e: e.id)
                             if e.group == number]}
                  for number, group in enumerate(ck.groups)]
        extra = guarded(ck, lambda: nested_arrays({name: ck.read_array(name, workers)
                                                   for name in ck.arrays})) if arrays else {}
        return CheckpointData(path=ck.name, optimizer=schema.name, params=params,
                              groups=groups, metadata=ck.metadata,
                              scheduler_state=ck.scheduler_state, state=states,
                              arrays=extra, info=dict(ck.header))
