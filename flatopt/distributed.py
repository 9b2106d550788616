"""Data-parallel training over MPI (mpi4py): ZeRO stage 1 over flatopt's flat buffers.

Every rank builds the same optimizer with ``comm=`` (an mpi4py communicator) and passes its own
gradients; ``step()`` then

1. exchanges, in one small ``allgather``, every rank's local validation result (a bad
   gradient or hyperparameter on one rank makes every rank raise, and none waits in a
   collective the failing rank never reaches), a digest of the parameter layout, the groups'
   settings, the step's options and the gradient presence;
2. combines presence: a gradient present on some rank counts as zeros on the ranks where it is
   missing; one missing on every rank is skipped (no state, no step count), as torch DDP with
   ``find_unused_parameters=True`` averages in zeros for unused parameters;
3. averages the gradients: an ``Alltoallv`` hands every rank the pieces of its own shard from
   every other rank, which it sums in rank order, ``((g0 + g1) + g2) + ...``, then divides by
   the world size. MPI's reduce-scatter is not used: its summation order depends on the
   implementation, the rank and the message size, so it is not bit-identical at 3 or more
   ranks;
4. steps only its shard of every flat buffer. Shards are contiguous ranges whose boundaries are
   multiples of the CPU walk's chunk, so each rank's chunks are chunks of the single-process
   walk: totals that walk combines per chunk (the clipping norm, non-finite counts, LAMB's
   per-parameter norms) are computed per chunk on the owning rank, gathered, and combined in
   chunk order on every rank, which gives the single-process bits. Per-parameter columns (step
   counts, bias corrections) are small and kept on every rank. State is allocated for the
   shard only, so optimizer memory per rank falls as 1/P;
5. all-gathers the parameters (an ``Alltoallv`` of each rank's range to every other rank,
   see ``Sharding.gather``), so every rank holds all of them.

The result is bit-identical to one process stepping on the mean gradient summed in rank order,
at any world size, for every rule with an element-wise span. Rules that work on whole matrices
(``Rule.per_parameter``, Muon) run replicated instead: the averaged gradients are all-gathered
and every rank updates every parameter with full state (memory does not fall for them).

After a distributed step ``opt.grads`` holds the averaged gradients only inside the rank's own
shard (the rest holds its local gradients, zeroed where they were missing). Under a world size
above one the state is spread over the ranks, so ``state_dict()``, ``state_of()``,
``load_state_dict()`` and ``restore()`` are refused with a pointer to :func:`consolidated`,
``flatopt.save`` and ``flatopt.load``, which are collective. A world size of one behaves
exactly as ``comm=None``.
"""

from __future__ import annotations

import hashlib
import numbers
import time
import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
from numba import njit, prange

from . import _stepping, errors
from ._layout import aligned_zeros, chunk_table
from .errors import FlatoptError
from .kernels import cpu


class DistributedError(FlatoptError):
    """A distributed step or build failed on some rank (raised on every rank, naming it)."""


class RankMismatchError(DistributedError, ValueError):
    """The ranks disagree about the parameters, the groups' hyperparameters or the options of
    a step: they must build the same optimizer and step it the same way."""


def world_size(comm) -> int:
    return 1 if comm is None else comm.Get_size()


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as error:  # pragma: no cover - the mpi extra is not installed
        raise DistributedError("comm= needs mpi4py: pip install 'flatopt[mpi]'") from error
    return MPI


def _mpi_type(dtype: np.dtype):
    MPI = _mpi()
    return {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[np.dtype(dtype)]


# ------------------------------------------------------------------------ agreement and errors
def _error_record(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _raise_collected(records: list, where: str) -> None:
    """Raise on every rank when some rank failed: that rank re-raises its own error, the
    others an error of the same flatopt type (DistributedError otherwise) naming the rank."""
    failed = [(rank, record) for rank, record in enumerate(records) if record is not None]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    error_type = getattr(errors, kind, None)
    if not (isinstance(error_type, type) and issubclass(error_type, FlatoptError)) or \
            error_type in (errors.CheckpointError, errors.CheckpointMismatch,
                           errors.CheckpointCorrupt):
        error_type = DistributedError
    others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    raise error_type(f"{where} failed on rank {rank}{others}, so it was stopped on every rank "
                     f"before any rank changed anything:\n{kind}: {message}")


def _structure(opt) -> tuple:
    """What every rank must agree on about the parameters: (path, shape, dtype, group)."""
    return tuple((info.path, info.shape, info.dtype.str, info.group) for info in opt.index)


def _digest(value: Any) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()


def _differences(what: str, values: list) -> list[str]:
    """Lines naming where ranks' values of ``what`` differ from rank 0's."""
    lines = []
    for rank, value in enumerate(values[1:], start=1):
        if value != values[0]:
            lines.append(f"{what}: rank {rank} has {value}, rank 0 has {values[0]}")
    return lines


def _structure_differences(structures: list[tuple]) -> list[str]:
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


def _canonical(value: Any) -> str:
    """A value's text for comparing ranks: numbers by value (np.float64(0.1) and 0.1 agree),
    tuples and lists item by item, anything else by repr."""
    if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, str):
        return repr(value if not isinstance(value, np.bool_) else bool(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_canonical(item) for item in value) + ")"
    return repr(value)


def _settings_text(settings: list[dict]) -> list[dict[str, str]]:
    return [{key: _canonical(value) for key, value in sorted(group.items())}
            for group in settings]


def _settings_differences(texts: list) -> list[str]:
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


def build_together(opt, comm, build: Callable[[], None]) -> "Sharding | None":
    """Run ``build`` (the optimizer's construction) on every rank, then agree: any rank's
    error, or differing parameters or hyperparameters, raise on every rank. Returns the
    optimizer's sharding (None at world size 1, which is then a plain optimizer)."""
    if comm is None:
        build()
        return None
    for method in ("Get_size", "Get_rank", "allgather", "Alltoallv", "Allgatherv"):
        if not callable(getattr(comm, method, None)):
            raise DistributedError(f"comm must be an mpi4py communicator (such as "
                                   f"mpi4py.MPI.COMM_WORLD), got {type(comm).__name__}")
    record = None
    try:
        build()
        if getattr(opt, "_device", None) is not None:
            raise DistributedError(f"{type(opt).__name__}(comm=..., device=...): sharding "
                                   "buffers in GPU memory is not supported yet; leave device= "
                                   "out (host buffers) to run data-parallel")
    except Exception as error:  # every rank must hear of it before raising
        record = _error_record(error)
        failure = error
    else:
        failure = None
    shape = None if failure else (_structure(opt), _settings_text(opt.settings()))
    gathered = comm.allgather((record, None if shape is None else _digest(shape)))
    if failure is not None:
        raise failure
    _raise_collected([r for r, _ in gathered], f"building {type(opt).__name__}")
    if len({digest for _, digest in gathered}) > 1:
        structures = comm.allgather(shape)  # every rank is here: the digests all arrived
        lines = (_structure_differences([s for s, _ in structures])
                 + _settings_differences([t for _, t in structures]))
        raise RankMismatchError(f"{type(opt).__name__}(comm=...): the ranks built different "
                                "optimizers; every rank must give the same parameters (paths, "
                                "shapes, dtypes, groups) and hyperparameters:\n"
                                + "\n".join(lines))
    if comm.Get_size() == 1:
        return None
    return Sharding(opt, comm)


# ------------------------------------------------------------------------ kernels
@njit(parallel=True, cache=True, error_model="numpy")
def _gradient_chunk_partials(g, present, offsets, sizes, chunk_first, chunk_size, power, mode,
                             first_chunk, stop_chunk):
    """cpu.reduce_gradients' per-chunk partial values and non-finite counts for the chunks
    ``[first_chunk, stop_chunk)`` of the buffer, left for the caller to combine in order."""
    n = stop_chunk - first_chunk
    partial = np.zeros(n)
    bad = np.zeros(n, np.int64)
    for j in prange(n):
        partial[j], bad[j] = cpu._reduce_chunk(g, present, offsets, sizes, chunk_first,
                                               chunk_size, power, mode, first_chunk + j)
    return partial, bad


# ------------------------------------------------------------------------ sharding
class _Layout(NamedTuple):
    """What the CPU backend's walks read of a buffer's layout."""

    present: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    chunk_first: np.ndarray
    chunk_size: int
    length: int


class BufferShard:
    """One rank's part of one flat buffer: the element range ``[lo, hi)`` it steps (chunk
    aligned), its state for that range only, and the layout of the range that the CPU walk
    takes (offsets relative to ``lo``, sizes clipped to the range; parameter slots keep their
    buffer-wide numbers, so per-parameter columns are shared with the whole buffer)."""

    def __init__(self, buf, rank: int, size: int, replicated: bool):
        self.buffer = buf
        n_chunks = buf.chunk_first.size
        chunk_bounds = [(n_chunks * r) // size for r in range(size + 1)]
        bounds = np.array([min(c * buf.chunk_size, buf.length) for c in chunk_bounds],
                          np.int64)
        # gradients are averaged over these ranges; each rank's own range is also what it
        # steps, unless the rule is replicated (it then steps the whole buffer)
        self.counts = np.diff(bounds)
        self.displs = bounds[:-1].copy()
        self.rank = rank
        self.first_chunk, self.stop_chunk = chunk_bounds[rank], chunk_bounds[rank + 1]
        self.reduce_lo, self.reduce_hi = int(bounds[rank]), int(bounds[rank + 1])
        # the counts of the two exchanges (nothing to or from this rank itself): every other
        # rank's range, and this rank's range length once per other rank, which lands in
        # ``scratch()`` at ``slot_displs``
        length = self.reduce_hi - self.reduce_lo
        self.others_counts = self.counts.copy()
        self.others_counts[rank] = 0
        self.mine_counts = np.full(size, length, np.int64)
        self.mine_counts[rank] = 0
        self.slot_displs = np.zeros(size, np.int64)
        for slot, q in enumerate(q for q in range(size) if q != rank):
            self.slot_displs[q] = slot * length
        self.zero_displs = np.zeros(size, np.int64)
        self.replicated = replicated
        self.lo, self.hi = (0, buf.length) if replicated else (self.reduce_lo, self.reduce_hi)
        self.length = self.hi - self.lo
        starts = np.clip(buf.offsets - self.lo, 0, self.length)
        ends = np.clip(buf.offsets + buf.sizes - self.lo, 0, self.length)
        self.offsets = starts.astype(np.int64)
        self.sizes = (ends - starts).astype(np.int64)
        self.chunk_size = buf.chunk_size
        self.chunk_first = chunk_table(self.offsets, self.sizes, self.length, self.chunk_size)
        self.overlaps = (self.sizes > 0).astype(np.uint8)
        self._segments()
        self.present = np.zeros(len(buf), np.uint8)
        self.state: dict[str, np.ndarray] = {}
        self.arrays: tuple | None = None
        self.arrays_plan = None
        self._scratch: np.ndarray | None = None
        if buf.state:  # eager state built whole at construction: keep this rank's range
            for name, flat in buf.state.items():
                self.state[name] = aligned_zeros(self.length, buf.dtype)
                self.state[name][...] = flat[self.lo:self.hi]
            buf.state.clear()

    def _segments(self) -> None:
        """Every (chunk, parameter) overlap of the range, in chunk order, as a layout of its
        own ("segment slots"): the CPU backend's own reduce kernel run over it gives each
        segment's partial totals apart (a segment's total is 0 + its partial), computed by the
        very machine code that one process runs, so they can be combined in chunk order
        across ranks. (A separately compiled kernel gave float32 LAMB norms differing in the
        last bits.)"""
        starts, sizes, slots = [], [], []
        for lo in range(0, self.length, self.chunk_size):
            hi = min(lo + self.chunk_size, self.length)
            k = int(self.chunk_first[lo // self.chunk_size])
            while k < len(self.offsets) and self.offsets[k] < hi:
                a, b = max(lo, self.offsets[k]), min(hi, self.offsets[k] + self.sizes[k])
                if b > a:
                    starts.append(a)
                    sizes.append(b - a)
                    slots.append(k)
                k += 1
        self.segment_slots = np.array(slots, np.int64)
        self.segments = _Layout(np.zeros(len(slots), np.uint8), np.array(starts, np.int64),
                                np.array(sizes, np.int64),
                                chunk_table(np.array(starts, np.int64),
                                            np.array(sizes, np.int64), self.length,
                                            self.chunk_size),
                                self.chunk_size, self.length)

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds for the buffer."""
        return sum(flat.nbytes for flat in self.state.values())

    def scratch(self) -> np.ndarray:
        """Room for the other ranks' pieces of this rank's range, allocated once."""
        size = len(self.counts)
        if self._scratch is None:
            length = self.reduce_hi - self.reduce_lo
            self._scratch = aligned_zeros((size - 1) * length, self.buffer.dtype)
        return self._scratch

    def local(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.lo:self.hi]


class Sharding:
    """An optimizer's distributed side: its communicator and one shard per flat buffer."""

    def __init__(self, opt, comm):
        self.opt = opt
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.shards: list[BufferShard] = []
        self.replicated = opt.schema.rule.per_parameter is not None
        self._settings_text: list = [None, None]  # (settings list's group objects, text)
        self._structure: tuple = (-1, "")
        self.timings = {"exchange": 0.0, "reduce": 0.0, "step": 0.0, "gather": 0.0}
        self._sync_shards()

    def _sync_shards(self) -> None:
        for buf in self.opt.buffers[len(self.shards):]:  # add_param_group added buffers
            self.shards.append(BufferShard(buf, self.rank, self.size, self.replicated))

    @property
    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank (every buffer's shard)."""
        return sum(shard.nbytes for shard in self.shards)

    def refuse(self, what: str) -> None:
        """Raise for an operation that needs the whole state in this process."""
        raise DistributedError(
            f"{type(self.opt).__name__}.{what} needs the whole optimizer state, which is spread "
            f"over {self.size} ranks: call flatopt.distributed.consolidated(opt) on every rank "
            "for a single-process copy, or flatopt.save / flatopt.load on every rank")

    def refuse_before_averaging(self, what: str) -> None:
        """Raise for a gradient operation that needs the averaged gradients, which exist only
        inside ``step()``."""
        raise DistributedError(
            f"{what} on {type(self.opt).__name__} sharded over {self.size} ranks would see this "
            "rank's own gradients, not their average across ranks (which step() computes): "
            "pass max_grad_norm= (and norm_type=) to opt.step() instead, which clips the "
            "averaged gradients")

    # -------------------------------------------------------------- the exchange
    def _structure_digest(self) -> str:
        count, digest = self._structure
        if count != len(self.opt.index):
            self._structure = (len(self.opt.index), _digest(_structure(self.opt)))
        return self._structure[1]

    def _settings_digest(self, settings: list[dict]) -> tuple[str, list]:
        cached_groups, cached = self._settings_text
        if cached_groups is None or len(cached_groups) != len(settings) or any(
                a is not b for a, b in zip(cached_groups, settings)):
            text = _settings_text(settings)
            self._settings_text = [list(settings), (_digest(text), text)]
        return self._settings_text[1]

    def exchange(self, check: Callable[[], tuple[list, tuple]]) -> list:
        """Run the local checks of a step, then one allgather of (error, layout digest,
        settings, options, presence); raise on every rank if any rank failed or the ranks
        disagree. Returns the settings; sets every buffer's presence to the combination."""
        record = settings = None
        try:
            settings, options = check()
            digest, text = self._settings_digest(settings)
            presence = b"".join(buf.present.tobytes() for buf in self.opt.buffers)
            mine = (None, self._structure_digest(), digest, _canonical(options), presence)
        except Exception as error:
            record, failure = _error_record(error), error
            mine = (record, None, None, None, None)
        gathered = self.comm.allgather(mine)
        if record is not None:
            raise failure
        _raise_collected([g[0] for g in gathered], f"{type(self.opt).__name__}.step()")
        lines = []
        if len({g[1] for g in gathered}) > 1:
            lines.append("the parameters differ (paths, shapes, dtypes or groups; was "
                         "add_param_group called on some ranks only?)")
        if len({g[2] for g in gathered}) > 1:
            texts = self.comm.allgather(text)  # every rank saw the same mismatch
            lines += _settings_differences(texts)
        lines += _differences("step options (max_grad_norm, norm_type, grad_scale, "
                              "skip_nonfinite, error_if_nonfinite)", [g[3] for g in gathered])
        if lines:
            raise RankMismatchError(f"{type(self.opt).__name__}.step(): the ranks disagree, so "
                                    "no rank stepped:\n" + "\n".join(lines))
        combined = np.zeros(len(gathered[0][4]), np.uint8)
        for g in gathered:
            np.bitwise_or(combined, np.frombuffer(g[4], np.uint8), out=combined)
        position = 0
        for buf in self.opt.buffers:
            mine_present = buf.present.copy()
            buf.present[:] = combined[position:position + len(buf)]
            position += len(buf)
            for k in np.flatnonzero(buf.present > mine_present):  # present elsewhere only
                buf.view(buf.grads, k)[...] = 0
        return settings

    # -------------------------------------------------------------- collectives
    def average_gradients(self, shard: BufferShard) -> None:
        """The rank-order sum of every rank's gradients over this rank's range, divided by
        the world size, written into the range of the gradient buffer."""
        buf, rank, size = shard.buffer, self.rank, self.size
        length = shard.reduce_hi - shard.reduce_lo
        scratch = shard.scratch()
        kind = _mpi_type(buf.dtype)
        self.comm.Alltoallv([buf.grads, (shard.others_counts, shard.displs), kind],
                            [scratch, (shard.mine_counts, shard.slot_displs), kind])
        mine = buf.grads[shard.reduce_lo:shard.reduce_hi]
        pieces = [mine if q == rank else
                  scratch[shard.slot_displs[q]:shard.slot_displs[q] + length]
                  for q in range(size)]
        total = scratch[:length]  # the first other rank's piece, consumed by the first sum
        np.add(pieces[0], pieces[1], out=total)
        for piece in pieces[2:]:
            np.add(total, piece, out=total)
        np.divide(total, buf.dtype.type(size), out=mine)

    def gather(self, shard: BufferShard, flat: np.ndarray | None, root: int | None = None,
               piece: np.ndarray | None = None) -> None:
        """Every rank's range of ``flat`` (a whole-buffer array) onto every rank, in place;
        with ``root``, onto that rank only (the others send ``piece``, their range).

        The all-gather is an Alltoallv of this rank's range (copied to the scratch, as MPI
        refuses overlapping send and receive buffers) to every other rank: with 4 ranks on 2
        cores MPICH's Allgatherv took 232 ms for 16M float32 elements and 444 ms for 64M,
        this 36 and 113 ms (at 2 ranks 20/74 ms against 32/46 ms); the bytes moved are the
        same."""
        MPI, kind = _mpi(), _mpi_type(shard.buffer.dtype)
        where = (shard.counts, shard.displs)
        if root is None:
            mine = shard.scratch()[:shard.reduce_hi - shard.reduce_lo]
            mine[...] = flat[shard.reduce_lo:shard.reduce_hi]
            self.comm.Alltoallv([mine, (shard.mine_counts, shard.zero_displs), kind],
                                [flat, (shard.others_counts, shard.displs), kind])
        elif self.rank == root:
            self.comm.Gatherv(MPI.IN_PLACE, [flat, where, kind], root=root)
        else:
            self.comm.Gatherv([piece, kind], None, root=root)

    def reduce_present(self, opt, mode: int, power: float) -> tuple[float, int]:
        """_stepping.reduce_present over every rank's averaged gradients: per-chunk partials
        computed where the chunk lives, gathered, combined in chunk order (its bits)."""
        mine = []
        for shard in self.shards:
            buf = shard.buffer
            if shard.stop_chunk == shard.first_chunk:
                mine.append((np.zeros(0), 0))
                continue
            partial, bad = _gradient_chunk_partials(
                buf.grads, buf.present, buf.offsets, buf.sizes, buf.chunk_first,
                buf.chunk_size, power, mode, shard.first_chunk, shard.stop_chunk)
            mine.append((partial, int(bad.sum())))
        gathered = self.comm.allgather(mine)
        total, bad = 0.0, 0
        for number, buf in enumerate(self.opt.buffers):
            if not buf.chunk_first.size:
                continue
            value = 0.0
            for rank_values in gathered:
                partial, count = rank_values[number]
                bad += count
                for x in partial:  # chunk order, as cpu.reduce_gradients combines them
                    if mode == cpu.MAX_ABS:
                        value = x if not (x <= value) else value
                    else:
                        value += x
            if mode == cpu.MAX_ABS:
                total = value if not (value <= total) else total
            else:
                total += value
        return total, bad

    # -------------------------------------------------------------- the step
    def _arrays(self, shard: BufferShard, plan) -> tuple:
        """The shard's kernel arrays for ``plan``, allocating the state slots it uses (for
        this rank's range only)."""
        if shard.arrays is not None and shard.arrays_plan is plan:
            return shard.arrays
        opt, buf = self.opt, shard.buffer
        for name in plan.used:
            if name not in shard.state:
                flat = aligned_zeros(shard.length, buf.dtype)
                initial = opt.schema.initial_value(name, plan.settings)
                if initial:
                    flat.fill(initial)
                shard.state[name] = flat
        grads = shard.local(buf.grads)
        shard.arrays = (shard.local(buf.params), grads,
                        *(shard.state[name] if name in plan.used else grads
                          for name in opt.schema.rule.slots))
        shard.arrays_plan = plan
        return shard.arrays

    def step(self, grads, *, max_grad_norm, norm_type, grad_scale, skip_nonfinite,
             error_if_nonfinite):
        opt = self.opt
        clock = time.perf_counter()

        def check():
            settings = opt.settings()
            if grads is not None:
                opt._stage_gradients(grads)
            if grad_scale is not None:
                _stepping._positive("grad_scale", grad_scale)
            if max_grad_norm is not None:
                _stepping._positive("max_grad_norm", max_grad_norm)
                _stepping.norm_mode(norm_type)
            self._sync_shards()
            return settings, (max_grad_norm, norm_type, grad_scale, bool(skip_nonfinite),
                              bool(error_if_nonfinite))

        settings = self.exchange(check)
        now = time.perf_counter()
        self.timings["exchange"] += now - clock
        clock = now
        active = [shard for shard in self.shards if shard.buffer.present.any()]
        for shard in active:
            self.average_gradients(shard)
            if shard.replicated:
                self.gather(shard, shard.buffer.grads)
        multiplier, result = _stepping.gradient_multiplier(
            opt, max_grad_norm=max_grad_norm, norm_type=norm_type, grad_scale=grad_scale,
            skip_nonfinite=skip_nonfinite, error_if_nonfinite=error_if_nonfinite,
            reduce=self.reduce_present)
        now = time.perf_counter()
        self.timings["reduce"] += now - clock
        clock = now
        if result.skipped:
            return result
        scale = multiplier != 1.0
        kernels = opt._kernels
        for shard in active:
            buf = shard.buffer
            plan = opt._plans[buf.number]
            if plan is None or plan.settings is not settings[buf.group]:
                plan = opt._plan(buf, settings[buf.group])
            arrays = self._arrays(shard, plan)
            kernels.prepare(buf.present, buf.kernel_columns, plan.prepare_scalars, plan.flags)
            self._update(shard, plan, arrays, buf.dtype.type(multiplier) if scale
                         else plan.one, scale)
        now = time.perf_counter()
        self.timings["step"] += now - clock
        clock = now
        for shard in active:
            if not shard.replicated:
                self.gather(shard, shard.buffer.params)
        self.timings["gather"] += time.perf_counter() - clock
        if not active and not opt._warned_no_gradient:
            opt._warned_no_gradient = True
            warnings.warn(f"{type(opt).__name__}.step(): no gradient is marked present on any "
                          "rank, so nothing was updated (said once per optimizer)", stacklevel=3)
        return result

    def _update(self, shard: BufferShard, plan, arrays: tuple, multiplier, scale: bool):
        """Optimizer._update over this rank's range (see there)."""
        opt, buf = self.opt, shard.buffer
        kernels, rule = opt._kernels, opt.schema.rule
        np.bitwise_and(buf.present, shard.overlaps, out=shard.present)
        if rule.per_parameter is not None:  # replicated: the range is the whole buffer
            for k in np.flatnonzero(buf.present):
                if scale:
                    buf.view(buf.grads, k)[...] *= multiplier
                rule.per_parameter(buf.view(buf.params, k), buf.view(buf.grads, k),
                                   {name: buf.view(shard.state[name], k) for name in plan.used},
                                   plan.settings)
            return
        if rule.reduce is not None:
            segments, slots = shard.segments, shard.segment_slots
            segments.present[...] = buf.present[slots]
            partial = np.zeros((len(slots), plan.sums.shape[1]))
            kernels.reduce(arrays, plan.scalars,
                           tuple(column[slots] for column in buf.kernel_columns), plan.flags,
                           segments, partial, multiplier, scale)
            plan.sums[...] = 0.0
            for rank_slots, rank_partial in self.comm.allgather((slots, partial)):
                for k, values in zip(rank_slots, rank_partial):  # chunk order, rank by rank
                    plan.sums[k] += values
            kernels.finalize(buf.present, buf.kernel_columns, plan.prepare_scalars, plan.flags,
                             plan.sums)
            scale = False  # the reduce pass scaled the gradients
        kernels.step(arrays, plan.scalars, buf.kernel_columns, plan.flags, shard, multiplier,
                     scale)


# ------------------------------------------------------------------------ state as a whole
def state_nbytes(opt) -> int:
    """Bytes of optimizer state (the state slots) held by this rank: its shards' when
    sharded, the whole state otherwise."""
    sharding = getattr(opt, "_sharding", None)
    if sharding is not None:
        return sharding.state_nbytes
    return sum(flat.nbytes for buf in opt.buffers for flat in buf.state.values())


def plain_copy(opt):
    """A plain single-process optimizer of ``opt``'s class, groups, settings and parameter
    values, with fresh state (what a load starts from: a load replaces every state it does
    not reset)."""
    settings = opt.settings()
    groups = [{**values, "params": {path: opt.params[path] for path in group["params"]}}
              for values, group in zip(settings, opt.param_groups)]
    twin = type(opt)(groups)
    twin.defaults = dict(opt.defaults)
    return twin


def consolidated(opt, root: int | None = None):
    """A plain single-process optimizer equal to ``opt``: same class, groups, settings,
    parameters, per-parameter columns and the full state, gathered from every rank. A
    collective: call it on every rank. With ``root``, only that rank gets it (the state is
    gathered there alone) and the others get None. ``opt`` itself when it is not sharded."""
    sharding = getattr(opt, "_sharding", None)
    if sharding is None:
        return opt
    sharding._sync_shards()  # buffers added by add_param_group since the last step
    here = root is None or sharding.rank == root
    twin = plain_copy(opt) if here else None
    for shard, mine in zip(sharding.shards, opt.buffers):
        buf = twin.buffers[mine.number] if here else None
        if here:
            for name, column in mine.columns.items():
                buf.columns[name][...] = column
            buf.state.clear()
        for name in opt.schema.rule.slots:  # slots are allocated alike on every rank
            if name not in shard.state:
                continue
            flat = aligned_zeros(mine.length, mine.dtype) if here else None
            if shard.replicated:
                if here:
                    flat[...] = shard.state[name]
            else:
                if here:
                    flat[shard.lo:shard.hi] = shard.state[name]
                sharding.gather(shard, flat, root=root, piece=shard.state[name])
            if here:
                buf.state[name] = flat
    return twin


def take_from(opt, twin) -> None:
    """Copy a plain optimizer's parameters, columns, group values and (this rank's range of)
    state into the sharded ``opt`` of the same layout (after a load into ``twin``)."""
    sharding = opt._sharding
    for number, group in enumerate(twin.param_groups):
        opt.param_groups[number].update({k: v for k, v in group.items() if k != "params"})
    for shard, buf, mine in zip(sharding.shards, twin.buffers, opt.buffers):
        mine.params[...] = buf.params
        for name, column in buf.columns.items():
            mine.columns[name][...] = column
        shard.state.clear()
        for name, flat in buf.state.items():
            shard.state[name] = aligned_zeros(shard.length, buf.dtype)
            shard.state[name][...] = flat[shard.lo:shard.hi]
        shard.arrays = shard.arrays_plan = None
    opt._plans = [None] * len(opt.buffers)


__all__ = ["DistributedError", "RankMismatchError", "Sharding", "BufferShard", "consolidated",
           "plain_copy", "state_nbytes", "build_together", "world_size"]
