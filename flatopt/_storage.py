"""How a group's buffers are stored: the dtypes of its parameters, gradients and state, master
weights and the rounding of 16-bit parameters (see the README, "Reduced precision").

The settings are optimizer keywords and group keys (``master_weights``, ``rounding``,
``state_dtype``, ``grad_dtype``, ``seed``), taken out of the group when it is built and fixed
from then on: :class:`Storage` per group (``opt.storage``), and per buffer the
:class:`BufferStorage` they resolve to for that buffer's parameter dtype and sizes. Kernels
always compute in float32 (float64 for float64 parameters); the storage codec
(``kernels/coded.py``) loads each stored value as that and stores it back with the rounding
chosen here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .errors import HyperparameterError
from .kernels.storage import BLOCK, MIN_8BIT_SIZE

FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
HALF_NAMES = ("float16", "bfloat16")
"""Parameter dtypes stored in 16 bits (computed in float32), by name."""


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (NumPy has none), imported when first needed: importing ml_dtypes
    takes about 0.5 s (it registers its casts with NumPy), which a run without bfloat16 values
    never needs. A user's bfloat16 array has imported it already."""
    return np.dtype(importlib.import_module("ml_dtypes").bfloat16)


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (told by name: no import needed to ask)."""
    return isinstance(dtype, np.dtype) and dtype.name == "bfloat16"


def is_half(dtype: Any) -> bool:
    return isinstance(dtype, np.dtype) and dtype.name in HALF_NAMES


def numpy_dtype(name: str) -> np.dtype:
    """The dtype a storage description names ("float32", "bfloat16", ...)."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)

KEYS = ("master_weights", "rounding", "state_dtype", "grad_dtype", "seed")
"""The storage settings: optimizer keywords and group keys, fixed after construction."""
ROUNDINGS = ("nearest", "stochastic", "kahan")
STATE_DTYPES = ("float32", "bfloat16", "int8")


class StorageProblem(ValueError):
    """A storage setting that cannot be used (the message names it)."""


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


@dataclass(frozen=True)
class Storage:
    """One group's storage settings, as given (defaults: everything as the parameters)."""

    master_weights: bool = False
    """Keep a float32 master copy of 16-bit parameters: the step updates it and writes the
    parameter rounded to nearest."""
    rounding: str = "nearest"
    """How a 16-bit parameter without master weights is written: "nearest", "stochastic"
    (from a counter-based hash of seed, step and element) or "kahan" (a 16-bit compensation
    buffer carries what rounding lost)."""
    state_dtype: str | None = None
    """"float32", "bfloat16" (rounded stochastically) or "int8" (bitsandbytes' blockwise
    dynamic quantization); None: the compute dtype."""
    grad_dtype: str | None = None
    """"float32" keeps 16-bit parameters' gradients in float32; None: the parameter's dtype."""
    seed: int = 0
    """The seed of the stochastic rounding stream."""

    @property
    def default(self) -> bool:
        return self == Storage()

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in KEYS}


def take(values: dict[str, Any]) -> dict[str, Any]:
    """The storage keys of ``values`` (removed from it)."""
    return {key: values.pop(key) for key in KEYS if key in values}


def check(given: Mapping[str, Any], base: Storage, where: str) -> Storage:
    """``base`` with the storage keys ``given`` (checked); raises :class:`StorageProblem`."""
    values = base.as_dict()
    values.update(given)
    master, rounding = values["master_weights"], values["rounding"]
    state, grad, seed = values["state_dtype"], values["grad_dtype"], values["seed"]
    if not isinstance(master, (bool, np.bool_)):
        raise StorageProblem(f"{where}: master_weights must be True or False, got {master!r}")
    if rounding not in ROUNDINGS:
        raise StorageProblem(f"{where}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if state is not None and state not in STATE_DTYPES:
        raise StorageProblem(f"{where}: state_dtype must be one of {STATE_DTYPES}, got "
                             f"{state!r}")
    if grad not in (None, "float32"):
        raise StorageProblem(f"{where}: grad_dtype must be None (the parameter's dtype) or "
                             f"'float32', got {grad!r}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= int(seed) < 1 << 63:
        raise StorageProblem(f"{where}: seed must be an integer in [0, 2**63), got {seed!r}")
    if master and rounding != "nearest":
        raise StorageProblem(f"{where}: rounding={rounding!r} is for 16-bit parameters "
                             "without master weights; with master_weights=True the parameter "
                             "is the master rounded to nearest")
    return Storage(bool(master), rounding, state, grad, int(seed))


@dataclass(frozen=True)
class BufferStorage:
    """What one buffer stores, resolved from its group's :class:`Storage`."""

    param: np.dtype
    grad: np.dtype
    compute: np.dtype
    """What the rule computes in: float32, or float64 for float64 parameters."""
    state: str
    """"float32", "float64", "bfloat16" or "int8"."""
    master: bool
    rounding: str
    seed: int

    @property
    def plain(self) -> bool:
        """Everything stored as it is computed: the buffer steps with the plain kernels."""
        return (self.param == self.grad == self.compute and not self.master
                and self.state == self.compute.name)

    @property
    def half(self) -> bool:
        return is_half(self.param)

    @property
    def alignment(self) -> int | None:
        """Elements each parameter's offset is a multiple of (int8 blocks start at each
        parameter, as bitsandbytes quantizes each tensor), or None for the default."""
        return BLOCK if self.state == "int8" else None

    @property
    def state_array_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.state == "int8" else numpy_dtype(self.state)

    def describe(self) -> str:
        parts = [f"params {dtype_name(self.param)}"]
        if self.grad != self.param:
            parts.append(f"grads {dtype_name(self.grad)}")
        if self.master:
            parts.append("float32 master weights")
        elif self.half:
            parts.append(f"rounding {self.rounding}")
        parts.append(f"state {self.state}")
        return ", ".join(parts)


def resolve(storage: Storage, dtype: np.dtype, size: int, where: str) -> BufferStorage:
    """The storage of a buffer of ``dtype`` parameters (``size``: the parameter's element
    count; int8 state keeps float32 below bitsandbytes' ``min_8bit_size``)."""
    dtype = np.dtype(dtype)
    half = is_half(dtype)
    compute = FLOAT64 if dtype == FLOAT64 else FLOAT32
    if not half and (storage.master_weights or storage.rounding != "nearest"
                     or storage.grad_dtype is not None) and dtype == FLOAT64:
        raise StorageProblem(f"{where}: master_weights, rounding and grad_dtype are for 16-bit "
                             "parameters; this group holds float64 ones")
    state = storage.state_dtype or compute.name
    if state != compute.name and compute == FLOAT64:
        raise StorageProblem(f"{where}: state_dtype={state!r} needs float32 or 16-bit "
                             "parameters (float64 parameters keep float64 state)")
    if state == "int8" and size < MIN_8BIT_SIZE:
        state = "float32"
    grad = FLOAT32 if storage.grad_dtype == "float32" else dtype
    resolved = BufferStorage(dtype, grad, compute, state, storage.master_weights and half,
                             storage.rounding if half and not storage.master_weights
                             else "nearest", storage.seed)
    # a buffer stored as it is computed draws nothing: its seed is no part of what it is
    # (a checkpoint compares plain buffers with seed 0)
    return dataclasses.replace(resolved, seed=0) if resolved.plain else resolved


def rule_problem(schema, storage: Storage) -> str | None:
    """Why ``schema``'s optimizer cannot store its state as ``storage`` says, or None."""
    if storage.default:
        return None
    if schema.rule.per_parameter is not None:
        return (f"{schema.name} updates whole matrices in NumPy; its buffers are float32 or "
                "float64 only (master_weights, rounding, state_dtype and grad_dtype are for the "
                "element-wise rules)")
    if not schema.reduced_precision:
        return (f"{schema.name}'s train()/eval() switch works on float32 and float64 buffers "
                "only (master_weights, rounding, state_dtype and grad_dtype are not available "
                "yet)")
    if storage.state_dtype == "int8" and not schema.int8_state:
        return (f"state_dtype='int8' is bitsandbytes' format for moment estimates; "
                f"{schema.name}'s state ({', '.join(schema.slots)}) has no 8-bit form: use "
                "'bfloat16'")
    return None


def checked(schema, given: Mapping[str, Any], base: Storage, where: str) -> Storage:
    """:func:`check` and :func:`rule_problem` for ``schema``'s optimizer, as a
    HyperparameterError naming ``where``."""
    try:
        storage = check(given, base, where)
    except StorageProblem as exc:
        raise HyperparameterError(str(exc)) from None
    problem = rule_problem(schema, storage)
    if problem:
        raise HyperparameterError(f"{where}: {problem}")
    return storage


def resolve_group(schema, storage: Storage, entries: list, group: int) -> list[BufferStorage]:
    """The buffer storage of each (path, array) entry of group ``group``; a
    HyperparameterError naming the group when a setting fits none of its parameters, or a
    16-bit parameter meets a rule that has no coded form."""
    where = f"param group {group}"
    try:
        storages = [resolve(storage, array.dtype, array.size, where) for _, array in entries]
    except StorageProblem as exc:
        raise HyperparameterError(str(exc)) from None
    coded = [path for (path, _), s in zip(entries, storages) if not s.plain]
    problem = rule_problem(schema, Storage(master_weights=True)) if coded else None
    if problem:
        raise HyperparameterError(f"{where}: {coded[0]!r} is 16-bit, but {problem}")
    half_only = [key for key in ("master_weights", "grad_dtype")
                 if getattr(storage, key) not in (False, None)]
    if storage.rounding != "nearest":
        half_only.append("rounding")
    if entries and half_only and not any(s.half for s in storages):
        raise HyperparameterError(
            f"{where}: {', '.join(half_only)} apply to 16-bit parameters (np.float16 or "
            "ml_dtypes.bfloat16 arrays) and this group has none")
    return storages
