"""The sharded step: gradient averaging in rank order, each rank's shard of every buffer, the
parameter gather."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .. import _codec, _stepping
from ..errors import NonFiniteGradientWarning
from .._layout import WalkLayout, aligned_zeros, chunk_table
from ..kernels import MAX_ABS
from ..kernels import backend as kernel_backend
from ._common import (DistributedError, RankMismatchError, canonical, differences,
                      digest_of, error_record, mpi, mpi_type, raise_collected,
                      settings_differences, settings_text, structure,
                      structure_differences)
from ._coded import average_half, shard_coded, wire


# ------------------------------------------------------------------------ sharding
class BufferShard:
    """One rank's part of one flat buffer: the element range ``[lo, hi)`` it steps (chunk
    aligned), its state for that range only, and the layout of the range that the CPU walk
    takes (offsets relative to ``lo``, sizes clipped to the range; parameter slots keep their
    buffer-wide numbers, so per-parameter columns are shared with the whole buffer)."""

    def __init__(self, buf, rank: int, size: int, replicated: bool, comm=None):
        self.buffer = buf
        self.comm = comm  # the reduce pass gathers every rank's partial totals
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
        # a reduced-precision buffer's 8-bit block scales, master weights and compensation
        # for the range (``_coded.py``)
        self.absmax: dict[str, np.ndarray] = {}
        self.master = self.compensation = None
        self.arrays: tuple | None = None
        self.arrays_plan = None
        self._scratch: dict = {}
        if buf.coded:
            shard_coded(self, buf)
        elif buf.state:  # eager state built whole at construction: keep this rank's range
            for name, flat in buf.state.items():
                self.state[name] = aligned_zeros(self.slot_length(name), buf.dtype)
                self.state[name][...] = self.range_of(name, flat)
            buf.state.clear()

    def range_of(self, name: str, flat: np.ndarray) -> np.ndarray:
        """This rank's range of the whole state slot ``name`` (``flat``): the whole of it
        when the rule runs replicated (a shaped slot has its own length)."""
        return flat if self.replicated else flat[self.lo:self.hi]

    def slot_length(self, name: str) -> int:
        """Elements of this rank's part of state slot ``name``."""
        return self.buffer.layout(name).length if self.replicated else self.length

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
        self.segments = WalkLayout(np.zeros(len(slots), np.uint8), np.array(starts, np.int64),
                                np.array(sizes, np.int64),
                                chunk_table(np.array(starts, np.int64),
                                            np.array(sizes, np.int64), self.length,
                                            self.chunk_size),
                                self.chunk_size, self.length)

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds for the buffer (8-bit block scales
        included)."""
        return sum(flat.nbytes for flat in (*self.state.values(), *self.absmax.values()))

    @property
    def params(self) -> np.ndarray:
        return self.local(self.buffer.params)

    @property
    def grads(self) -> np.ndarray:
        return self.local(self.buffer.grads)

    def memory(self) -> dict[str, int]:
        """``FlatBuffer.memory`` on this rank: all the parameters and gradients, the state
        and master weights (and compensation) of the range."""
        buf = self.buffer
        return {"params": buf.params.nbytes, "grads": buf.grads.nbytes,
                "master": sum(a.nbytes for a in (self.master, self.compensation)
                              if a is not None),
                "state": self.nbytes}

    def reset_parameter(self, slot: int) -> None:
        """``_codec.reset_parameter`` over the range: the master copy takes the parameter's
        16-bit values, its compensation is cleared."""
        start, stop = int(self.offsets[slot]), int(self.offsets[slot] + self.sizes[slot])
        if self.master is not None:
            self.master[start:stop] = self.params[start:stop].astype(np.float32)
        if self.compensation is not None:
            self.compensation[start:stop] = 0

    def scratch(self, dtype=None) -> np.ndarray:
        """Room for the other ranks' pieces of this rank's range, allocated once (per
        dtype: 16-bit arrays travel as ``uint16``)."""
        dtype = np.dtype(self.buffer.dtype if dtype is None else dtype)
        if dtype not in self._scratch:
            length = self.reduce_hi - self.reduce_lo
            self._scratch[dtype] = aligned_zeros((len(self.counts) - 1) * length, dtype)
        return self._scratch[dtype]

    def local(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.lo:self.hi]

    def take_presence(self) -> None:
        """The walk's presence: the buffer's present parameters that overlap the range."""
        np.bitwise_and(self.buffer.present, self.overlaps, out=self.present)

    def reduce(self, kernels, plan, arrays: tuple, multiplier, scale: bool) -> None:
        """The rule's reduce pass over this range (``kernels``: the CPU's), each segment's
        partial totals gathered from every rank and added per parameter in chunk order, rank
        by rank: the order one process adds them in, so ``plan.sums`` holds one process's
        bits."""
        buf = self.buffer
        self.take_presence()
        segments, slots = self.segments, self.segment_slots
        segments.present[...] = buf.present[slots]
        partial = np.zeros((len(slots), plan.sums.shape[1]))
        kernels.reduce(arrays, plan.scalars,
                       tuple(column[slots] for column in buf.kernel_columns), plan.flags,
                       segments, partial, multiplier, scale)
        plan.sums[...] = 0.0
        for rank_slots, rank_partial in self.comm.allgather((slots, partial)):
            for k, values in zip(rank_slots, rank_partial):  # chunk order, rank by rank
                plan.sums[k] += values


class Sharding:
    """An optimizer's distributed side: its communicator and one shard per flat buffer."""

    def __init__(self, opt, comm):
        self.opt = opt
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.shards: list[BufferShard] = []
        self.replicated = opt.schema.rule.per_parameter is not None
        self.host = opt.buffer_device  # the update's kernels (host buffers only)
        self.cpu = kernel_backend("cpu")  # the gradient norm's partials
        self._settings_text: list = [None, None]  # (settings list's group objects, text)
        self._structure: tuple = (-1, "")
        self.timings = {"exchange": 0.0, "reduce": 0.0, "step": 0.0, "gather": 0.0}
        self.sync_shards()

    def sync_shards(self) -> None:
        """Shards for the buffers ``add_param_group`` added since the last call."""
        for buf in self.opt.buffers[len(self.shards):]:
            self.shards.append(BufferShard(buf, self.rank, self.size, self.replicated,
                                           self.comm))

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
            self._structure = (len(self.opt.index), digest_of(structure(self.opt)))
        return self._structure[1]

    def _settings_digest(self, settings: list[dict]) -> tuple[str, list]:
        cached_groups, cached = self._settings_text
        if cached_groups is None or len(cached_groups) != len(settings) or any(
                a is not b for a, b in zip(cached_groups, settings)):
            text = settings_text(settings)
            self._settings_text = [list(settings), (digest_of(text), text)]
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
            mine = (None, self._structure_digest(), digest, canonical(options), presence)
        except Exception as error:
            record, failure = error_record(error), error
            mine = (record, None, None, None, None)
        gathered = self.comm.allgather(mine)
        if record is not None:
            raise failure
        raise_collected([g[0] for g in gathered], f"{type(self.opt).__name__}.step()")
        lines = []
        if len({g[1] for g in gathered}) > 1:
            lines.append("the parameters differ (paths, shapes, dtypes or groups; was "
                         "add_param_group called on some ranks only?)")
        if len({g[2] for g in gathered}) > 1:
            texts = self.comm.allgather(text)  # every rank saw the same mismatch
            lines += settings_differences(texts)
        lines += differences("step options (max_grad_norm, norm_type, grad_scale, "
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
        if buf.grads.dtype != buf.dtype:  # 16-bit gradients
            average_half(self.comm, shard, rank, size)
            return
        length = shard.reduce_hi - shard.reduce_lo
        scratch = shard.scratch()
        kind = mpi_type(buf.dtype)
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
        MPI = mpi()
        flat, kind = wire(flat) if flat is not None else (None, wire(piece)[1])
        piece = None if piece is None else wire(piece)[0]
        where = (shard.counts, shard.displs)
        if root is None:
            mine = shard.scratch(flat.dtype)[:shard.reduce_hi - shard.reduce_lo]
            mine[...] = flat[shard.reduce_lo:shard.reduce_hi]
            self.comm.Alltoallv([mine, (shard.mine_counts, shard.zero_displs), kind],
                                [flat, (shard.others_counts, shard.displs), kind])
        elif self.rank == root:
            self.comm.Gatherv(MPI.IN_PLACE, [flat, where, kind], root=root)
        else:
            self.comm.Gatherv([piece, kind], None, root=root)

    def reduce_present(self, mode: int, power: float) -> tuple[float, int]:
        """``HostDevice.reduce_present`` over every rank's averaged gradients: per-chunk partials
        computed where the chunk lives, gathered, combined in chunk order (its bits)."""
        mine = []
        for shard in self.shards:
            buf = shard.buffer
            if shard.stop_chunk == shard.first_chunk:
                mine.append((np.zeros(0), 0))
                continue
            if buf.grads.dtype != buf.dtype:  # 16-bit gradients
                partial, bad = self.cpu.coded_gradient_chunk_partials(
                    shard.hi - shard.lo, buf.grads.view(np.uint8),
                    _codec.half_format(buf.grads.dtype), buf.present, buf.offsets, buf.sizes,
                    buf.chunk_first, buf.chunk_size, buf.length, power, mode,
                    shard.first_chunk, shard.stop_chunk)
            else:
                partial, bad = self.cpu.gradient_chunk_partials(
                    shard.hi - shard.lo, buf.grads, buf.present, buf.offsets, buf.sizes,
                    buf.chunk_first, buf.chunk_size, power, mode, shard.first_chunk,
                    shard.stop_chunk)
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
                    if mode == MAX_ABS:
                        value = x if not (x <= value) else value
                    else:
                        value += x
            if mode == MAX_ABS:
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
        if buf.coded:  # the state in its stored format, the walk over the range
            for name in plan.used:
                if name not in shard.state:
                    shard.state[name] = _codec.new_slot(
                        buf, opt.schema, name, opt.schema.initial_value(name, plan.settings),
                        shard.length, shard.absmax)
            shard.arrays = _codec.coded_plan(buf, opt.schema, plan.used, shard)
            shard.arrays_plan = plan
            return shard.arrays
        for name in plan.used:
            if name not in shard.state:
                flat = aligned_zeros(shard.slot_length(name), buf.dtype)
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
        """``Optimizer.step`` on every rank: the exchange and the gradient average, then the
        optimizer's own update (``Optimizer.update_buffers``) with this layer running it over
        the rank's range of each buffer, then the parameter gather."""
        opt = self.opt
        clock = time.perf_counter()

        def check():
            settings = opt.settings()
            opt.check_step(settings)
            if grads is not None:
                opt.stage_gradients(grads)
            _stepping.check_counters(opt, settings)
            if grad_scale is not None:
                _stepping.positive("grad_scale", grad_scale)
            if max_grad_norm is not None:
                _stepping.positive("max_grad_norm", max_grad_norm)
                _stepping.norm_mode(norm_type)
            self.sync_shards()
            return settings, (max_grad_norm, norm_type, grad_scale, bool(skip_nonfinite),
                              bool(error_if_nonfinite))

        settings = self.exchange(check)
        clock = self._timed("exchange", clock)
        active = [shard for shard in self.shards if shard.buffer.present.any()]
        for shard in active:
            self.average_gradients(shard)
            if shard.replicated:
                self.gather(shard, shard.buffer.grads)
        multiplier, result = _stepping.gradient_multiplier(
            self.reduce_present, max_grad_norm=max_grad_norm, norm_type=norm_type,
            grad_scale=grad_scale, skip_nonfinite=skip_nonfinite,
            error_if_nonfinite=error_if_nonfinite)
        clock = self._timed("reduce", clock)
        if result.skipped:
            return result
        settings = opt.advance(settings)
        opt.update_buffers(settings, multiplier, self)
        opt.after_step(settings)
        if result.nonfinite:
            opt.warn_once(_stepping.NONFINITE_WARNING, 4, NonFiniteGradientWarning)
        clock = self._timed("step", clock)
        for shard in active:
            if not shard.replicated:
                self.gather(shard, shard.buffer.params)
        self._timed("gather", clock)
        if not active:
            opt.warn_once("no gradient is marked present on any rank, so nothing was updated "
                          "(said once per optimizer)", 4)
        return result

    def _timed(self, what: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[what] += now - since
        return now

    # -------------------------------------------------------------- the update's layer
    # Optimizer.update_buffers calls these for each buffer: the host device's own update,
    # over this rank's range (``part=`` its BufferShard).
    def arrays(self, buf, plan) -> tuple | None:
        """The shard's kernel arrays for ``plan`` (None when no rank has a gradient)."""
        if not buf.present.any():
            return None
        return self._arrays(self.shards[buf.number], plan)

    def prepare(self, buf, plan) -> int:
        return self.host.prepare(buf, plan)

    def update(self, buf, plan, arrays: tuple, multiplier, scale: bool) -> None:
        shard = self.shards[buf.number]
        shard.take_presence()
        self.host.update(buf, plan, arrays, multiplier, scale, shard)

    def reduce_pass(self, buf, plan, arrays: tuple, multiplier, scale: bool) -> None:
        self.host.reduce_pass(buf, plan, arrays, multiplier, scale, self.shards[buf.number])

    def read_sums(self, staged: list) -> None:
        """Every rank holds the gathered totals already (``BufferShard.reduce``)."""

    def step_pass(self, buf, plan, arrays: tuple) -> None:
        self.host.step_pass(buf, plan, arrays, self.shards[buf.number])

    def map_state(self, rule, slots: tuple[str, ...], arguments) -> None:
        """``Optimizer._map_state`` over this rank's range of each buffer (its parameters
        that have state), then the parameters gathered onto every rank. Collective: the
        buffers visited are the same on every rank (their state slots are allocated by the
        same steps everywhere)."""
        opt = self.opt
        kernels = None
        if any(shard.buffer.coded and all(name in shard.state for name in slots)
               for shard in self.shards):  # the same on every rank; nothing changed yet
            raise DistributedError(f"{type(opt).__name__}: {rule.name} over the state is not "
                                   "supported on sharded reduced-precision buffers")
        for shard in self.shards:
            buf = shard.buffer
            args = arguments(buf)
            if args is None or any(name not in shard.state for name in slots):
                continue
            scalars, flags = args
            present = np.asarray(opt.schema.stateful(buf.columns), np.uint8) & shard.overlaps
            layout = WalkLayout(present, shard.offsets, shard.sizes, shard.chunk_first,
                             shard.chunk_size, shard.length)
            kernels = kernels or self.host.backend.compile(rule)
            kernels.step((shard.local(buf.params), shard.local(buf.grads),
                          *(shard.state[name] for name in slots)),
                         scalars, (), flags, layout, buf.dtype.type(1), False)
            if not shard.replicated:
                self.gather(shard, buf.params)


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
        if opt.device != "cpu":
            raise DistributedError(f"{type(opt).__name__}(comm=..., device=...): sharding "
                                   "buffers in GPU memory is not supported yet; leave device= "
                                   "out (host buffers) to run data-parallel")
    except Exception as error:  # every rank must hear of it before raising
        record = error_record(error)
        failure = error
    else:
        failure = None
    shape = None if failure else (structure(opt), settings_text(opt.settings()))
    gathered = comm.allgather((record, None if shape is None else digest_of(shape)))
    if failure is not None:
        raise failure
    raise_collected([r for r, _ in gathered], f"building {type(opt).__name__}")
    if len({digest for _, digest in gathered}) > 1:
        structures = comm.allgather(shape)  # every rank is here: the digests all arrived
        lines = (structure_differences([s for s, _ in structures])
                 + settings_differences([t for _, t in structures]))
        raise RankMismatchError(f"{type(opt).__name__}(comm=...): the ranks built different "
                                "optimizers; every rank must give the same parameters (paths, "
                                "shapes, dtypes, groups) and hyperparameters:\n"
                                + "\n".join(lines))
    if comm.Get_size() == 1:
        return None
    return Sharding(opt, comm)
