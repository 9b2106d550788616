"""``load``: a checkpoint into a live optimizer, verified and compared before anything changes;
``open_checkpoint`` for tools."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, StateDictError
from ..optimizer import BufferState, Optimizer
from . import validate
from .compare import Comparison, Difference, compare, is_relaxed, mismatch_message
from .reader import Contents, open_file, parse_structure


@dataclass
class LoadResult:
    """What :func:`load` did."""

    path: str
    loaded: list[str]
    """Live paths whose parameter and state came from the checkpoint."""
    fresh: list[str]
    """Live paths absent from the checkpoint (strict=False): their state was reset, their
    parameter values kept."""
    unused: list[str]
    """Saved paths (after renaming) that match no live parameter (strict=False)."""
    differences: list[Difference]
    """Differences the chosen options accepted."""
    metadata: Any
    scheduler_state: Any
    info: dict = field(default_factory=dict)


def parse(source) -> Contents:
    """Open and check a checkpoint: structure, digest, meaning (no buffer data read)."""
    file, name, size = open_file(source)
    try:
        ck = parse_structure(file, name, size)
        validate.interpret(ck)
        return ck
    except CheckpointError:
        file.close()
        raise
    except Exception as exc:  # anything h5py or numpy raise on a damaged file
        file.close()
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt "
                                f"checkpoint: {type(exc).__name__}: {exc}", path=name) from exc


class open_checkpoint:
    """Context manager: a checked, parsed checkpoint (for tools); data read on demand."""

    def __init__(self, source):
        self.contents = parse(source)

    def __enter__(self) -> Contents:
        return self.contents

    def __exit__(self, *exc) -> None:
        try:
            self.contents.file.close()
        except Exception:
            pass


def read_verified(ck: Contents) -> dict:
    """Every buffer of the file, its checksums verified and its values checked."""
    try:
        staged = ck.read_all()
    except CheckpointError:
        raise
    except Exception as exc:
        raise ck.corrupt(f"{type(exc).__name__}: {exc}") from exc
    validate.check_data(ck, staged)
    return staged


def _restore_arguments(ck: Contents, opt: Optimizer, plan: Comparison, staged: dict):
    """What to hand to ``opt.restore``: whole buffers where the saved layout is the live one,
    per-path values elsewhere."""
    schema = opt.schema
    by_buffer: dict[int, list] = {}
    for info, entry in plan.matches:
        by_buffer.setdefault(info.buffer, []).append((info, entry))
    buffers: dict[int, BufferState] = {}
    state: dict[str, dict] = {}
    params: dict[str, np.ndarray] = {}
    for number, pairs in by_buffer.items():
        buf = opt.buffers[number]
        keys = {(entry.group, entry.dtype) for _, entry in pairs}
        if len(keys) == 1 and len(pairs) == len(buf):
            key = next(iter(keys))
            saved = ck.buffers[key]
            ordered = sorted(pairs, key=lambda pair: pair[0].slot)
            if saved.length == buf.length and len(saved.members) == len(buf) and all(
                    info.slot == k and saved.members[k] is entry
                    for k, (info, entry) in enumerate(ordered)):
                buffers[number] = BufferState(
                    staged[key, "params"],
                    {slot: staged[key, slot] for slot in saved.datasets if slot != "params"},
                    {name: np.array([entry.columns[name] for _, entry in ordered],
                                    dtype=buf.columns[name].dtype) for name in schema.columns})
                continue
        for info, entry in pairs:
            key = (entry.group, entry.dtype)
            window = slice(entry.offset, entry.offset + entry.size)
            params[info.path] = staged[key, "params"][window].reshape(info.shape)
            if schema.stateful(entry.columns):
                state[info.path] = {
                    **{name: entry.columns[name] for name in schema.state_dict_columns},
                    **{slot: staged[key, slot][window].reshape(info.shape)
                       for slot in ck.buffers[key].datasets if slot != "params"}}
    return state, params, buffers


def load(source, opt: Optimizer, *, strict: bool = True,
         rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
         hyperparameters: str | None = None, regroup: bool = False,
         scheduler: Any = None) -> LoadResult:
    """Load a checkpoint into ``opt`` in place, matched by path, never by position.

    The whole file is verified (structure, sizes, digests, every buffer's checksums and
    values) and compared with ``opt`` first; every difference is reported in one
    :class:`CheckpointMismatch`, and on any error ``opt`` is left exactly as it was. Options,
    each accepting only its own kind of difference:

    - ``strict=False``: partial loading; parameters missing from the file keep their values
      and get fresh state, saved parameters the optimizer lacks are ignored (see the result),
      and a missing scheduler state is accepted.
    - ``rename``: ``{saved_path: new_path}`` or a function ``saved_path -> new_path | None``
      (None drops that saved parameter) for refactored models.
    - ``hyperparameters``: None (default) reports differing hyperparameters as mismatches;
      ``"saved"`` takes them from the file (torch's behaviour), ``"live"`` keeps the
      optimizer's own.
    - ``regroup=True``: the optimizer may group parameters differently; state follows the path.

    A parameter whose id changed (the model was built in another order) still loads by path,
    whatever ``strict`` says; the change is listed in the result's ``differences``.
    ``source`` is a path, bytes or a binary file object. With ``scheduler``, its
    ``load_state_dict`` receives the saved scheduler state. Returns a :class:`LoadResult`.
    """
    if hyperparameters not in (None, "saved", "live"):
        raise ValueError(f"hyperparameters must be None, 'saved' or 'live', got "
                         f"{hyperparameters!r}")
    if rename is not None and not callable(rename) and not isinstance(rename, Mapping):
        raise TypeError(f"rename must be a dict or a function, got {type(rename).__name__}")
    if not isinstance(opt, Optimizer):
        raise CheckpointError(f"load() takes a flatopt optimizer, got {type(opt).__name__}")
    with opt.lock, open_checkpoint(source) as ck:
        plan = compare(ck, opt, rename=rename, hyperparameters=hyperparameters,
                       regroup=regroup, scheduler=scheduler)
        relaxed, blocking = [], []
        for diff in plan.differences:
            accepted = is_relaxed(diff, strict=strict, hyperparameters=hyperparameters,
                                  regroup=regroup)
            (relaxed if accepted else blocking).append(diff)
        if blocking:
            raise CheckpointMismatch(mismatch_message(ck.name, opt, blocking, relaxed),
                                     path=ck.name, differences=plan.differences)
        settings = _checked_settings(ck, opt, plan)
        staged = read_verified(ck)
        state, params, buffers = _restore_arguments(ck, opt, plan, staged)
        try:
            pending = opt.prepare_restore(state, settings=settings, params=params,
                                          buffers=buffers)
        except StateDictError as exc:
            raise ck.corrupt(str(exc)) from exc
        if scheduler is not None and ck.scheduler_state is not None:
            try:
                scheduler.load_state_dict(ck.scheduler_state)
            except Exception as exc:
                raise CheckpointError(f"checkpoint {ck.name}: scheduler.load_state_dict() "
                                      f"failed: {exc}; the optimizer is unchanged",
                                      path=ck.name) from exc
        pending.apply()
        loaded = {info.path for info, _ in plan.matches}
        return LoadResult(path=ck.name, loaded=[p for p in opt.index.paths if p in loaded],
                          fresh=[p for p in opt.index.paths if p not in loaded],
                          unused=plan.unused, differences=relaxed, metadata=ck.metadata,
                          scheduler_state=ck.scheduler_state, info=dict(ck.header))


def _checked_settings(ck: Contents, opt: Optimizer, plan: Comparison) -> list[dict | None]:
    """The live groups' values with the file's hyperparameters taken in, validated."""
    settings: list[dict | None] = []
    problems = []
    for number, (values, chosen) in enumerate(zip(opt.settings(), plan.new_settings)):
        if not chosen:
            settings.append(None)
            continue
        merged, more = opt.schema.check_group({**values, **chosen},
                                              f"param group {number} with saved values")
        problems += more
        settings.append(merged)
    if problems:
        raise CheckpointMismatch("\n".join(problems), path=ck.name)
    return settings
