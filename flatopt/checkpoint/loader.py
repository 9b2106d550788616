"""``load``: a checkpoint into a live optimizer, verified and compared before anything changes;
``open_checkpoint`` for tools."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .._layout import aligned_zeros
from .. import _lossless
from .._restore import Fill
from ..errors import (CheckpointCorrupt, CheckpointError, CheckpointMismatch,
                      CheckpointOptionError, StateDictError)
from ..optimizer import BufferState, Optimizer
from . import extras, files, manifest, precision, validate
from .compare import Comparison, Difference, compare, is_relaxed, mismatch_message
from .format import DTYPES, check_flags, nested_arrays
from .files import open_file
from .datasets import read_structure
from .reader import Contents


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
    arrays: dict[str, Any] = field(default_factory=dict)
    """The extra arrays saved with ``save(arrays=...)``: name -> a fresh array of the saved
    dtype and shape (verified like every buffer), nested as they were saved."""

    @classmethod
    def of(cls, ck, opt, plan, relaxed: list, arrays: dict) -> "LoadResult":
        """What a load of ``ck`` into ``opt`` following ``plan`` did (``arrays``: the file's
        extra arrays by stored name)."""
        loaded = {info.path for info, _ in plan.matches}
        return cls(path=ck.name, loaded=[p for p in opt.index.paths if p in loaded],
                   fresh=[p for p in opt.index.paths if p not in loaded], unused=plan.unused,
                   differences=relaxed, metadata=ck.metadata,
                   scheduler_state=ck.scheduler_state, info=dict(ck.header),
                   arrays=nested_arrays(extras.split(arrays)[0]))


SUPERSEDED_RETRIES = 3


def parse(source) -> Contents:
    """Open and check a checkpoint (a file, or a sharded checkpoint's directory): structure,
    digest, meaning (no buffer data read). A sharded checkpoint whose save was superseded
    while it was being opened is opened again: the newer save is read."""
    for attempt in range(SUPERSEDED_RETRIES):
        try:
            return _parse_once(source)
        except manifest.Superseded:
            if attempt == SUPERSEDED_RETRIES - 1:
                raise


def _parse_once(source) -> Contents:
    if manifest.is_sharded(source):
        ck = manifest.open_sharded(source)
        read = manifest.read_structure
    else:
        file, name, size, raw = open_file(source)
        ck, read = Contents(name, file, size, raw), read_structure
    name = ck.name
    try:
        read(ck)
        validate.interpret(ck)
        return ck
    except CheckpointError:
        ck.close()
        raise
    except Exception as exc:  # anything h5py or numpy raise on a damaged file
        ck.close()
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt "
                                f"checkpoint: {type(exc).__name__}: {exc}", path=name) from exc


class open_checkpoint:
    """Context manager: a checked, parsed checkpoint (for tools); data read on demand."""

    def __init__(self, source):
        self.contents = parse(source)

    def __enter__(self) -> Contents:
        return self.contents

    def __exit__(self, *exc) -> None:
        self.contents.close()


def guarded(ck: Contents, read: Callable):
    """Run ``read()``; anything but a CheckpointError (h5py, numpy, the OS on a damaged or
    vanishing file) becomes CheckpointCorrupt, but too little memory for what a sound file
    holds, which is a CheckpointError."""
    try:
        return read()
    except CheckpointError:
        raise
    except MemoryError as exc:
        raise CheckpointError(f"checkpoint {ck.name}: not enough memory to read it "
                              f"({type(exc).__name__}: {exc}); nothing was changed; read it "
                              "where more memory is available", path=ck.name) from exc
    except Exception as exc:
        raise ck.corrupt(f"{type(exc).__name__}: {exc}") from exc


def largest_buffer(ck: Contents) -> int:
    """Bytes of the file's largest buffer (one state slot of one group and dtype)."""
    return max((length * DTYPES[saved.dtype].itemsize for saved in ck.buffers.values()
                for length in saved.lengths.values()), default=0)


class Scratch:
    """One reusable array per dtype, grown to the largest buffer passed through it: buffers
    that are verified and dropped cost the memory of the largest one, not of them all."""

    def __init__(self):
        self.arrays: dict[np.dtype, np.ndarray] = {}

    def get(self, saved, slot: str) -> np.ndarray:
        dtype, length = DTYPES[saved.dtype], saved.lengths[slot]
        held = self.arrays.get(dtype)
        if held is None or held.size < length:
            self.arrays[dtype] = None  # drop the smaller one first
            held = self.arrays[dtype] = aligned_zeros(max(length, 1), dtype)
        return held[:length]


def verify_one(ck: Contents, key, slot: str, workers, scratch: Scratch | None = None):
    """One slot of one buffer read (into ``scratch``, or a fresh array) and verified as
    ``load`` and ``flatopt verify`` verify it: its checksums, then its state values."""
    if scratch is None:
        flat = guarded(ck, lambda: ck.read(key, slot, workers))
    else:
        flat = guarded(ck, lambda: ck.read_into(key, slot, scratch.get(ck.buffers[key], slot),
                                                workers))
    validate.check_data(ck, {(key, slot): flat})
    return flat


def verify_buffers(ck: Contents, keys, workers, keep: set = frozenset()) -> dict:
    """Read and verify every slot of the buffers ``keys`` (checksums, then the state values
    as ``flatopt verify`` checks them); returns the slots named in ``keep`` as fresh arrays,
    the others pass through one scratch array of the largest one's size and are dropped."""
    staged, scratch = {}, Scratch()
    for key in keys:
        saved = ck.buffers[key]
        for slot in saved.datasets:
            if (key, slot) in keep:
                staged[key, slot] = verify_one(ck, key, slot, workers)
            else:
                verify_one(ck, key, slot, workers, scratch)
    return staged


def _fill(ck: Contents, key: tuple[int, str], slot: str, workers) -> Fill:
    """A buffer of the file read straight into the optimizer's array during the restore."""
    saved = ck.buffers[key]
    return Fill(saved.lengths[slot], DTYPES[saved.dtype],
                lambda out, keep=None, landed=None: guarded(
                    ck, lambda: ck.read_into(key, slot, out, workers, keep, landed)),
                saved.datasets[slot].name, blockwise=True)


def whole_matches(ck: Contents, opt: Optimizer, plan: Comparison) -> dict[int, tuple]:
    """Live buffers that one saved buffer holds exactly (the same members in the same packing,
    every slot of the live length): buffer number -> (saved key, its (live info, saved entry)
    pairs in slot order). Such a buffer is read whole, in place."""
    by_buffer: dict[int, list] = {}
    for info, entry in plan.matches:
        by_buffer.setdefault(info.buffer, []).append((info, entry))
    found = {}
    for number, pairs in by_buffer.items():
        buf = opt.buffers[number]
        keys = {(entry.group, entry.dtype) for _, entry in pairs}
        if len(keys) != 1 or len(pairs) != len(buf):
            continue
        key = next(iter(keys))
        saved = ck.buffers[key]
        ordered = sorted(pairs, key=lambda pair: pair[0].slot)
        if saved.length == buf.length and len(saved.members) == len(buf) and all(
                info.slot == k and saved.members[k] is entry
                for k, (info, entry) in enumerate(ordered)) and all(
                saved.layouts[slot].length == buf.layout(slot).length
                for slot in saved.datasets):
            found[number] = (key, ordered)
    return found


def saved_columns(ck: Contents, buf, ordered: list) -> dict[str, np.ndarray]:
    """A whole-matched buffer's per-parameter columns from the file, in the live dtype."""
    return {name: np.array([entry.columns[name] for _, entry in ordered],
                           dtype=buf.columns[name].dtype) for name in ck.schema.columns}


def _restore_arguments(ck: Contents, opt: Optimizer, plan: Comparison, workers):
    """What to hand to ``opt.restore``: whole buffers (read into place while the restore is
    applied) where the saved layout is the live one, per-path values (read and verified
    here) elsewhere. Every other buffer of the file is verified here too."""
    buffers: dict[int, BufferState] = {}
    whole: set = set()
    matched = whole_matches(ck, opt, plan)
    for number, (key, ordered) in matched.items():
        saved = ck.buffers[key]
        buffers[number] = BufferState(
            _fill(ck, key, "params", workers),
            {slot: _fill(ck, key, slot, workers) for slot in saved.datasets if slot != "params"},
            saved_columns(ck, opt.buffers[number], ordered))
        whole.add(key)
    per_path = [(info, entry) for info, entry in plan.matches if info.buffer not in matched]
    needed = {(entry.group, entry.dtype) for _, entry in per_path}
    keep = {(key, slot) for key in needed for slot in ck.buffers[key].datasets}
    staged = verify_buffers(ck, [key for key in sorted(ck.buffers) if key not in whole],
                            workers, keep)
    state: dict[str, dict] = {}
    params: dict[str, np.ndarray] = {}
    for info, entry in per_path:
        key = (entry.group, entry.dtype)
        window = slice(entry.offset, entry.offset + entry.size)
        params[info.path] = staged[key, "params"][window].reshape(info.shape)
        if ck.schema.stateful(entry.columns):
            state[info.path] = saved_state_entry(ck, entry, staged, info.shape)
    return state, params, buffers


def saved_values(ck: Contents, entry, staged: dict, slot: str) -> np.ndarray | None:
    """A saved parameter's flat values in ``slot`` from the verified buffers in ``staged``,
    placed by the slot's own layout (a shaped slot such as Adafactor's row_var packs other
    entries than the parameters), or None where it has no entry."""
    key = (entry.group, entry.dtype)
    saved = ck.buffers[key]
    layout, position = saved.layouts[slot], saved.positions[entry.row]
    if layout.shapes[position] is None:
        return None
    start = int(layout.offsets[position])
    return staged[key, slot][start:start + int(layout.sizes[position])]


def saved_state_entry(ck: Contents, entry, staged: dict, shape) -> dict:
    """A saved parameter's state as ``state_dict()`` holds it (its state-dict columns and
    each saved slot, shaped), from the verified buffers in ``staged``."""
    state = {name: entry.columns[name] for name in ck.schema.state_dict_columns}
    for slot in ck.buffers[entry.group, entry.dtype].datasets:
        values = None if slot == "params" else saved_values(ck, entry, staged, slot)
        if values is not None:
            state[slot] = values.reshape(ck.schema.slots[slot].entry_shape(shape))
    return state


def load(source, opt: Optimizer, *, strict: bool = True,
         rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
         hyperparameters: str | None = None, regroup: bool = False,
         scheduler: Any = None, ema: Any = None, scaler: Any = None,
         lookahead: Any = None, staging: int | None = None, convert: bool = False
         ) -> LoadResult:
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
    - ``convert=True``: a parameter saved with another storage than the live one (16-bit
      parameters, master weights, bfloat16 or int8 state; see ``flatopt.checkpoint.precision``)
      is converted through float32 values: the saved state decoded and encoded in the live
      format; the best float32 value saved for the parameter (its master weights, else its
      value plus its Kahan compensation) the live parameter (rounded to nearest) and master,
      a live Kahan compensation what that rounding lost. Without it such a parameter is a
      mismatch naming both formats;
      with the same storage a load is lossless (stored arrays, the rounding stream's draws).

    A parameter whose id changed (the model was built in another order) still loads by path,
    whatever ``strict`` says; the change is listed in the result's ``differences``.
    ``source`` is a path, bytes or a binary file object, or the directory of a sharded
    checkpoint (saved by an optimizer sharded over ranks; see ``flatopt.checkpoint.sharded``).
    With ``scheduler``, its ``load_state_dict`` receives the saved scheduler state; ``ema``
    and ``scaler`` (an :class:`~flatopt.EMA` of ``opt``, a :class:`~flatopt.GradScaler`) get
    what ``save(ema=, scaler=)`` stored, in the same commit (a file without them is a
    mismatch unless ``strict=False``). Returns a :class:`LoadResult` (with the extra arrays
    saved by ``save(arrays=...)``).

    Memory: a buffer whose saved layout is the live one is read straight into the optimizer's
    array (or into the state slot the load allocates), checked as it lands; to put the
    optimizer back if anything fails, the load keeps a copy of each array it overwrites, in
    memory up to ``staging`` bytes (default: the size of the file's largest buffer) and in an
    unnamed temporary file in the temporary directory (tempfile's: ``$TMPDIR``) beyond that.
    Peak memory is the live state plus ``staging`` (plus the buffers a partial, renamed or
    regrouped load takes per path).
    """
    check_options(opt, rename, hyperparameters, staging)
    check_flags(strict=strict, regroup=regroup, convert=convert)
    extras.check_companions(opt, ema, scaler, lookahead, "loaded")
    if opt.sharding is not None:
        raise CheckpointOptionError("loader.load() loads an optimizer that holds all of its "
                                    "state; flatopt.load sends a sharded one to sharded.load")
    with opt.lock, open_checkpoint(source) as ck, files.pool() as workers:
        prepared = Prepared.of(ck, opt, workers, strict=strict, rename=rename,
                               hyperparameters=hyperparameters, regroup=regroup,
                               scheduler=scheduler, ema=ema, scaler=scaler,
                               lookahead=lookahead, convert=convert)
        prepared.apply(staging, lambda: extras.load_states(prepared.wanted, ck.name))
        return prepared.result()


@dataclass
class Prepared:
    """A load of ``ck`` into ``opt``, compared, read as far as it can be before the first
    change, and validated; :meth:`apply` makes it."""

    ck: Contents
    opt: Optimizer
    plan: Comparison
    relaxed: list
    arrays: dict
    pending: Any
    wanted: list
    """(what, object, state) for the scheduler, EMA and scaler (``extras.wanted_states``)."""
    staged: dict = field(default_factory=dict)
    """The reduced-precision buffers' new contents (``_lossless.stage``), committed last."""

    @classmethod
    def of(cls, ck: Contents, opt: Optimizer, workers, *, strict: bool, rename,
           hyperparameters, regroup: bool, scheduler, ema=None, scaler=None,
           lookahead=None, convert: bool = False) -> "Prepared":
        plan, relaxed, settings = checked_plan(ck, opt, strict=strict, rename=rename,
                                               hyperparameters=hyperparameters,
                                               regroup=regroup, scheduler=scheduler,
                                               convert=convert)
        arrays = guarded(ck, lambda: ck.read_arrays())
        precision.check_arrays(ck, arrays)
        wanted = extras.wanted_states(ck, extras.split(arrays)[1], plan.matches, strict=strict,
                                      ema=ema, scaler=scaler, scheduler=scheduler,
                                      lookahead=lookahead)
        # coded on either side: from the stored arrays (a plain live buffer converts from
        # them, so that it gets the master weights, not the float32 view's rounded values)
        coded, plain_matches = [], []
        for match in plan.matches:
            is_coded = opt.buffers[match[0].buffer].coded or match[1].path in ck.storage
            (coded if is_coded else plain_matches).append(match)
        plain = Comparison(plan.differences, plain_matches, plan.unused, plan.new_settings)
        state, params, buffers = _restore_arguments(ck, opt, plain, workers)
        problems: list[str] = []
        opt.host_buffers()  # CUDA: what the load keeps is staged from the mirror
        records = precision.saved_records(ck, opt, coded, arrays,
                                          _float32_entries(ck, workers), convert)
        staged, converted, values = _lossless.stage(opt, records, settings, convert,
                                                    problems, f"checkpoint {ck.name}")
        try:
            if problems:
                raise StateDictError("; ".join(problems[:20]))
            pending = opt.prepare_restore({**state, **converted}, settings=settings,
                                          params={**params, **values}, buffers=buffers)
        except StateDictError as exc:
            raise ck.corrupt(str(exc)) from exc
        return cls(ck, opt, plan, relaxed, arrays, pending, wanted, staged)

    def apply(self, staging: int | None, before_commit) -> None:
        """Make the load; ``before_commit`` runs last (its error undoes the load too)."""
        ck = self.ck
        budget = largest_buffer(ck) if staging is None else int(min(staging, 1 << 62))
        try:
            # the spill goes to tempfile's directory ($TMPDIR): the checkpoint's own may be
            # read-only or full, and a load must not write beside what it reads
            with self.opt.host_side():  # CUDA: the device gets both parts
                self.pending.apply(staging=budget, spill_dir=None,
                                   before_commit=before_commit)
                _lossless.commit(self.opt, self.staged)  # assignments only: cannot fail
        except StateDictError as exc:  # a value check of data read into place
            raise ck.corrupt(str(exc)) from exc
        except (OSError, MemoryError) as exc:  # the undo copy: a full disk, or memory
            hint = ("a smaller staging= to keep less of the copy in memory"
                    if isinstance(exc, MemoryError) else
                    "a larger staging= to keep the copy in memory")
            raise CheckpointError(f"could not load checkpoint {ck.name}: keeping a copy "
                                  f"of the state to undo a failed load failed "
                                  f"({type(exc).__name__}: {exc}); the optimizer is "
                                  f"unchanged; pass {hint}", path=ck.name) from exc

    def result(self) -> LoadResult:
        return LoadResult.of(self.ck, self.opt, self.plan, self.relaxed, self.arrays)


def _float32_entries(ck: Contents, workers) -> Callable:
    """``entry -> (parameter values, state entry or None)`` from the file's float32 buffers
    (for a plain saved parameter loaded into a reduced-precision buffer), read and verified
    once per buffer when first asked."""
    staged: dict = {}

    def values(entry):
        key = (entry.group, entry.dtype)
        if (key, "params") not in staged:
            staged.update(verify_buffers(ck, [key], workers, {
                (key, slot) for slot in ck.buffers[key].datasets}))
        window = slice(entry.offset, entry.offset + entry.size)
        params = staged[key, "params"][window].reshape(entry.shape)
        state = (saved_state_entry(ck, entry, staged, entry.shape)
                 if ck.schema.stateful(entry.columns) else None)
        return params, state
    return values


def check_options(opt, rename, hyperparameters, staging) -> None:
    if hyperparameters not in (None, "saved", "live"):
        raise CheckpointOptionError(f"hyperparameters must be None, 'saved' or 'live', got "
                                    f"{hyperparameters!r}")
    if rename is not None and not callable(rename) and not isinstance(rename, Mapping):
        raise CheckpointOptionError(f"rename must be a dict or a function, got "
                                    f"{type(rename).__name__}")
    if staging is not None and not _is_byte_count(staging):
        raise CheckpointOptionError(f"staging must be a number of bytes >= 0, got {staging!r}")
    if not isinstance(opt, Optimizer):
        raise CheckpointError(f"load() takes a flatopt optimizer, got {type(opt).__name__}")


def _is_byte_count(value: Any) -> bool:
    """A real number >= 0 (a NumPy integer too; infinity: no limit), not a bool or NaN."""
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and value >= 0)


def load_scheduler(ck: Contents, scheduler) -> None:
    """The saved scheduler state into ``scheduler`` (when both are there)."""
    if scheduler is not None and ck.scheduler_state is not None:
        try:
            scheduler.load_state_dict(ck.scheduler_state)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {ck.name}: scheduler.load_state_dict() failed: "
                                  f"{exc}; the optimizer is unchanged", path=ck.name) from exc


def checked_plan(ck: Contents, opt: Optimizer, *, strict: bool, rename, hyperparameters,
                 regroup: bool, scheduler, convert: bool = False
                 ) -> tuple[Comparison, list, list[dict | None]]:
    """The file compared with ``opt``: the plan, the differences the options accept, and the
    groups' new values; every other difference raised in one CheckpointMismatch."""
    plan = compare(ck, opt, rename=rename, hyperparameters=hyperparameters, regroup=regroup,
                   scheduler=scheduler)
    relaxed, blocking = [], []
    for diff in plan.differences:
        accepted = is_relaxed(diff, strict=strict, hyperparameters=hyperparameters,
                              regroup=regroup, convert=convert)
        (relaxed if accepted else blocking).append(diff)
    if blocking:
        raise CheckpointMismatch(mismatch_message(ck.name, opt, blocking, relaxed),
                                 path=ck.name, differences=plan.differences)
    return plan, relaxed, _checked_settings(ck, opt, plan)


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
