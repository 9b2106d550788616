"""flatopt's own training state saved with an optimizer: an :class:`~flatopt.EMA` of its
parameters, a :class:`~flatopt.GradScaler` and a :class:`~flatopt.Lookahead` over it
(``save(..., ema=, scaler=, lookahead=)``, ``load(..., ema=, scaler=, lookahead=)``).

Both are stored as extra arrays under the reserved top-level keys (format version 4)::

    flatopt:ema/<group>/<dtype>     the averages, packed as that group's parameter buffer
    flatopt:ema/decay, warmup, num_updates          0-d arrays
    flatopt:scaler/enabled, scale, growth_factor, backoff_factor, growth_interval,
                   _growth_tracker                  0-d arrays
    flatopt:lookahead/<group>/<dtype>   the slow weights, packed as the parameter buffer
    flatopt:lookahead/started           bool, one per index row: its slow weights began
    flatopt:lookahead/alpha, k          0-d; steps: int64, one per param group

so they are checksummed, verified and committed with everything else in the file. A load
maps the averages by path, as it maps parameters (``rename``, ``regroup`` and partial loads
apply); it checks them before anything changes and restores them in the same commit as the
optimizer.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import (CheckpointError, CheckpointMismatch, CheckpointOptionError,
                      HyperparameterError, StateDictError)
from . import precision
from .format import NEST, OWN_PREFIX

EMA_KEY = OWN_PREFIX + "ema"
SCALER_KEY = OWN_PREFIX + "scaler"
LOOKAHEAD_KEY = OWN_PREFIX + "lookahead"
EMA_SETTINGS = ("decay", "warmup", "num_updates")
SCALER_SETTINGS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker")


def _buffer_key(group: int, dtype: str, key: str = EMA_KEY) -> str:
    return NEST.join((key, str(group), dtype))


def check_companions(opt, ema: Any, scaler: Any, lookahead: Any, action: str) -> None:
    """CheckpointOptionError unless ``ema`` is an EMA of ``opt``, ``scaler`` a GradScaler and
    ``lookahead`` a Lookahead over ``opt`` (each or None): save and load (``action``: "saved"
    or "loaded") refuse the same, before any file is touched. An EMA or Lookahead of another
    optimizer with the same paths and shapes would load without complaint otherwise."""
    if ema is not None and (getattr(ema, "opt", None) is not opt or not callable(
            getattr(ema, "state_dict", None))):
        raise CheckpointOptionError(
            f"ema= takes a flatopt.EMA of the optimizer being {action}, got "
            f"{type(ema).__name__}{' of another optimizer' if hasattr(ema, 'opt') else ''}")
    if scaler is not None and (not callable(getattr(scaler, "state_dict", None))
                               or not callable(getattr(scaler, "is_enabled", None))):
        raise CheckpointOptionError(f"scaler= takes a flatopt.GradScaler, got "
                                    f"{type(scaler).__name__}")
    if lookahead is not None and getattr(lookahead, "optimizer", None) is not opt:
        raise CheckpointOptionError(f"lookahead= takes a flatopt.Lookahead over the optimizer "
                                    f"being {action}, got {type(lookahead).__name__}")


def own_arrays(opt, ema: Any, scaler: Any, lookahead: Any = None) -> dict[str, np.ndarray]:
    """The arrays that store ``ema`` (an EMA of ``opt``), ``scaler`` and ``lookahead`` (a
    Lookahead over ``opt``); CheckpointOptionError for anything else (nothing is written)."""
    check_companions(opt, ema, scaler, lookahead, "saved")
    out: dict[str, np.ndarray] = {}
    if ema is not None:
        try:
            state = ema.state_dict()
        except HyperparameterError as exc:   # the optimizer gained a group after the EMA
            raise CheckpointOptionError(f"ema=: {exc}") from None
        for key in EMA_SETTINGS:
            out[NEST.join((EMA_KEY, key))] = np.asarray(state[key])
        out.update(_packed_averages(opt, state["averages"]))
    if scaler is not None:
        state = scaler.state_dict()
        out[NEST.join((SCALER_KEY, "enabled"))] = np.asarray(bool(scaler.is_enabled()))
        for key in SCALER_SETTINGS if state else ():
            out[NEST.join((SCALER_KEY, key))] = np.asarray(state[key])
    if lookahead is not None:
        state = lookahead.state_dict()
        out[NEST.join((LOOKAHEAD_KEY, "alpha"))] = np.asarray(state["alpha"], np.float64)
        out[NEST.join((LOOKAHEAD_KEY, "k"))] = np.asarray(state["k"], np.int64)
        out[NEST.join((LOOKAHEAD_KEY, "steps"))] = np.asarray(state["steps"], np.int64)
        out[NEST.join((LOOKAHEAD_KEY, "started"))] = np.array(
            [info.path in state["slow"] for info in opt.index], bool)
        for buf in opt.buffers:
            packed = np.zeros(buf.length, buf.dtype)
            for path in buf.paths:
                if path in state["slow"]:
                    info = opt.index[path]
                    packed[info.offset:info.offset + info.size] = state["slow"][path].ravel()
            out[_buffer_key(buf.group, buf.dtype.name, LOOKAHEAD_KEY)] = packed
    return out


def _packed_averages(opt, averages: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The EMA's averages packed as the file's index packs the parameters: each buffer as it
    is, or for an optimizer with reduced-precision buffers the float32 view's packing (one
    buffer per group and compute dtype, which such an optimizer may split)."""
    out = {}
    if precision.coded(opt):
        for group, dtype, members, layout in precision.view_packing(opt):
            packed = np.zeros(layout.length, dtype)
            for k, (buf, slot) in enumerate(members):
                start = int(layout.offsets[k])
                packed[start:start + int(layout.sizes[k])] = \
                    averages[buf.paths[slot]].ravel()
            out[_buffer_key(group, dtype)] = packed
        return out
    for buf in opt.buffers:
        packed = np.zeros(buf.length, buf.dtype)
        for path in buf.paths:
            info = opt.index[path]
            packed[info.offset:info.offset + info.size] = averages[path].ravel()
        out[_buffer_key(buf.group, buf.dtype.name)] = packed
    return out


def split(arrays: Mapping[str, np.ndarray]) -> tuple[dict, dict]:
    """The file's extra arrays by stored name: (the user's, flatopt's own)."""
    user = {k: v for k, v in arrays.items() if not k.startswith(OWN_PREFIX)}
    return user, {k: v for k, v in arrays.items() if k.startswith(OWN_PREFIX)}


def _scalar(own: Mapping, key: str):
    value = own.get(key)
    if not isinstance(value, np.ndarray) or value.shape != ():
        raise StateDictError(f"{key} is missing or not a single value")
    return value.item()


def ema_state(ck, own: Mapping, ema, matches) -> dict:
    """The EMA state dict the file gives ``ema``: saved averages for the matched parameters
    (live info, saved parameter), the live ones for the rest."""
    state = {key: _scalar(own, NEST.join((EMA_KEY, key))) for key in EMA_SETTINGS}
    averages = {path: None for path in ema.params}
    for info, saved in matches:
        averages[info.path] = _saved_slice(own, EMA_KEY, saved, info, "EMA averages")
    live = ema.state_dict()["averages"] if any(v is None for v in averages.values()) else {}
    state["averages"] = {path: live[path] if value is None else value
                         for path, value in averages.items()}
    return state


def _saved_slice(own: Mapping, key: str, saved, info, what: str) -> np.ndarray:
    packed = own.get(_buffer_key(saved.group, saved.dtype, key))
    if packed is None or packed.ndim != 1 or packed.size < saved.offset + saved.size:
        raise StateDictError(f"the {what} of group {saved.group} ({saved.dtype}) are missing "
                             f"or too short for {saved.path!r}")
    return packed[saved.offset:saved.offset + saved.size].reshape(info.shape)


def lookahead_state(own: Mapping, lookahead, matches) -> dict:
    """The Lookahead state dict the file gives ``lookahead``: slow weights by live path for
    the matched parameters whose slow weights had begun."""
    steps = own.get(NEST.join((LOOKAHEAD_KEY, "steps")))
    started = own.get(NEST.join((LOOKAHEAD_KEY, "started")))
    if not isinstance(steps, np.ndarray) or steps.ndim != 1 or steps.dtype.kind not in "iu":
        raise StateDictError("Lookahead steps are missing or not integers")
    if not isinstance(started, np.ndarray) or started.ndim != 1 or started.dtype != bool:
        raise StateDictError("Lookahead 'started' flags are missing or not booleans")
    slow = {}
    for info, saved in matches:
        if saved.row >= started.size:
            raise StateDictError(f"Lookahead 'started' flags stop before {saved.path!r}")
        if started[saved.row]:
            slow[info.path] = _saved_slice(own, LOOKAHEAD_KEY, saved, info,
                                           "Lookahead slow weights").copy()
    return {"alpha": _scalar(own, NEST.join((LOOKAHEAD_KEY, "alpha"))),
            "k": _scalar(own, NEST.join((LOOKAHEAD_KEY, "k"))),
            "steps": [int(s) for s in steps], "slow": slow}


def scaler_state(own: Mapping) -> dict:
    enabled = _scalar(own, NEST.join((SCALER_KEY, "enabled")))
    return {key: _scalar(own, NEST.join((SCALER_KEY, key))) for key in SCALER_SETTINGS} \
        if enabled else {}


def wanted_states(ck, own: Mapping, matches, *, strict: bool, ema: Any = None,
                  scaler: Any = None, scheduler: Any = None,
                  lookahead: Any = None) -> list[tuple]:
    """What a load takes from the file ``ck`` besides the optimizer: (what, object, state)
    for the scheduler, EMA and scaler, each state read and checked now (``matches``: the
    load's (live info, saved parameter) pairs). Raises CheckpointMismatch for one the file
    lacks (unless ``strict=False``: that one keeps its state) and CheckpointCorrupt for a
    saved state that cannot be read."""
    wanted = []
    if scheduler is not None and ck.scheduler_state is not None:
        wanted.append((f"checkpoint {ck.name}: scheduler", scheduler, ck.scheduler_state))
    for name, target, key, option in (("EMA", ema, EMA_KEY, "ema="),
                                      ("GradScaler", scaler, SCALER_KEY, "scaler="),
                                      ("Lookahead", lookahead, LOOKAHEAD_KEY, "lookahead=")):
        if target is None:
            continue
        if not any(k.startswith(key + NEST) for k in own):
            if strict:
                raise CheckpointMismatch(
                    f"checkpoint {ck.name} holds no {name} state (it was saved without "
                    f"{option}); pass strict=False to keep "
                    f"the live {name}'s state; nothing was changed", path=ck.name)
            continue
        try:
            state = (ema_state(ck, own, ema, matches) if target is ema else
                     scaler_state(own) if target is scaler else
                     lookahead_state(own, lookahead, matches))
        except StateDictError as exc:
            raise ck.corrupt(f"its {name} state: {exc}") from exc
        wanted.append((f"checkpoint {ck.name}: {name}", target, state))
    return wanted


def load_states(wanted: list[tuple], path: str) -> None:
    """``load_state_dict`` of every (what, object, state) of :func:`wanted_states`, the last
    thing a load does before it commits: if one fails, those done are put back as they were
    and CheckpointError says which failed."""
    done = []
    try:
        for what, target, state in wanted:
            before = target.state_dict()
            try:
                target.load_state_dict(state)
            except Exception as exc:
                raise CheckpointError(f"{what}.load_state_dict() failed: {exc}; the optimizer "
                                      "is unchanged", path=path) from exc
            done.append((target, before))
    except BaseException:
        for target, before in reversed(done):
            target.load_state_dict(before)
        raise
