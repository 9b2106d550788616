"""Errors, the MPI handle, and the collective agreement checks every rank runs before it
waits in a collective: one small allgather of what each rank has and would do."""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import numpy as np

from .. import errors
from ..errors import FlatoptError


class DistributedError(FlatoptError):
    """A distributed step or build failed on some rank (raised on every rank, naming it)."""


class RankMismatchError(DistributedError, ValueError):
    """The ranks disagree about the parameters, the groups' hyperparameters or the options of
    a step: they must build the same optimizer and step it the same way."""


def world_size(comm) -> int:
    return 1 if comm is None else comm.Get_size()


def mpi():
    try:
        from mpi4py import MPI
    except ImportError as error:  # pragma: no cover - the mpi extra is not installed
        raise DistributedError("comm= needs mpi4py: pip install 'flatopt[mpi]'") from error
    return MPI


def mpi_type(dtype: np.dtype):
    MPI = mpi()
    return {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[np.dtype(dtype)]


# ------------------------------------------------------------------------ agreement and errors
def error_record(error: BaseException) -> tuple[str, str, str | None]:
    return type(error).__name__, str(error), getattr(error, "path", None)


def raise_collected(records: list, where: str) -> None:
    """Raise on every rank when some rank failed: that rank re-raises its own error, the
    others an error of the same flatopt type (DistributedError otherwise) naming the rank, so
    one ``except flatopt.CheckpointError`` (say) works on every rank. (Their error carries the
    message only: a CheckpointMismatch's ``differences`` are on the failing rank's.)"""
    failed = [(rank, record) for rank, record in enumerate(records) if record is not None]
    if not failed:
        return
    rank, (kind, message, path) = failed[0]
    error_type = getattr(errors, kind, None)
    if not (isinstance(error_type, type) and issubclass(error_type, FlatoptError)):
        error_type = DistributedError
    others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    named = {"path": path} if issubclass(error_type, errors.CheckpointError) else {}
    raise error_type(f"{where} failed on rank {rank}{others}, so it was stopped on every rank "
                     f"before any rank changed anything:\n{kind}: {message}", **named)


def structure(opt) -> tuple:
    """What every rank must agree on about the parameters: (path, shape, dtype, group)."""
    return tuple((info.path, info.shape, info.dtype.str, info.group) for info in opt.index)


def digest_of(value: Any) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()


def differences(what: str, values: list) -> list[str]:
    """Lines naming where ranks' values of ``what`` differ from rank 0's."""
    lines = []
    for rank, value in enumerate(values[1:], start=1):
        if value != values[0]:
            lines.append(f"{what}: rank {rank} has {value}, rank 0 has {values[0]}")
    return lines


def structure_differences(structures: list[tuple]) -> list[str]:
    lines = []
    first = {entry[0]: entry for entry in structures[0]}
    for rank, structure in enumerate(structures[1:], start=1):
        mine = {entry[0]: entry for entry in structure}
        for path in [p for p in first if p not in mine][:5]:
            lines.append(f"parameter {path!r} is on rank 0 but not on rank {rank}")
        for path in [p for p in mine if p not in first][:5]:
            lines.append(f"parameter {path!r} is on rank {rank} but not on rank 0")
        for path in [p for p in mine if p in first and mine[p] != first[p]][:5]:
            _, shape, dtype, group = mine[path]
            _, shape0, dtype0, group0 = first[path]
            lines.append(f"parameter {path!r}: shape {shape}, dtype {dtype}, group {group} on "
                         f"rank {rank}; shape {shape0}, dtype {dtype0}, group {group0} on rank 0")
        if structure != structures[0] and sorted(structure) == sorted(structures[0]):
            lines.append(f"rank {rank} gives the parameters in another order than rank 0")
    return lines


def canonical(value: Any) -> str:
    """A value's text for comparing ranks: numbers by value (np.float64(0.1) and 0.1 agree),
    tuples and lists item by item, anything else by repr."""
    if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, str):
        return repr(value if not isinstance(value, np.bool_) else bool(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(canonical(item) for item in value) + ")"
    return repr(value)


def settings_text(settings: list[dict]) -> list[dict[str, str]]:
    return [{key: canonical(value) for key, value in sorted(group.items())}
            for group in settings]


def settings_differences(texts: list) -> list[str]:
    lines = []
    for rank, groups in enumerate(texts[1:], start=1):
        if len(groups) != len(texts[0]):
            lines.append(f"rank {rank} has {len(groups)} param groups, rank 0 has "
                         f"{len(texts[0])}")
            continue
        for number, (mine, first) in enumerate(zip(groups, texts[0])):
            for key in sorted(set(mine) | set(first)):
                if mine.get(key) != first.get(key):
                    lines.append(f"param group {number}: {key} is {mine.get(key)} on rank "
                                 f"{rank}, {first.get(key)} on rank 0")
    return lines
