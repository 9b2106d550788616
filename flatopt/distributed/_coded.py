"""ZeRO-1 for reduced-precision buffers (``FlatBuffer.coded``): what a rank keeps of them, how
their 16-bit arrays travel, and how 16-bit gradients are averaged.

A rank keeps, for its range ``[lo, hi)`` only, the state in its stored format (bfloat16, or
8-bit codes with their block scales), the float32 master weights and the Kahan compensation;
every rank keeps all the 16-bit parameters (gathered after each step) and gradients. Range
boundaries are chunk boundaries, multiples of the 256-element block, so no 8-bit block
straddles two ranks and a rank's block scales are the buffer's blocks ``lo // 256`` on. The
rank's arrays are indexed from ``lo``; the coded walk gets ``lo`` as its ``base``, so
stochastic rounding hashes each element's index in the whole buffer, as one process does.
"""

from __future__ import annotations

import numpy as np

from .._layout import aligned_zeros
from ..kernels.storage import BLOCK
from ._common import DistributedError, mpi


def wire(array: np.ndarray) -> tuple[np.ndarray, object]:
    """``array`` as MPI sends it, and its MPI datatype: float32 and float64 as they are,
    16-bit floats as their bit patterns (bfloat16 has no MPI datatype), 8-bit codes as bytes."""
    MPI = mpi()
    kinds = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
             np.dtype(np.uint8): MPI.UINT8_T}
    if array.dtype in kinds:
        return array, kinds[array.dtype]
    if array.dtype.itemsize == 2:
        return array.view(np.uint16), MPI.UINT16_T
    raise DistributedError(f"no MPI datatype for {array.dtype} arrays")


def _copy(flat: np.ndarray) -> np.ndarray:
    out = aligned_zeros(flat.size, flat.dtype)
    out[...] = flat
    return out


def blocks_of(lo: int, hi: int) -> slice:
    """The 8-bit blocks of elements ``[lo, hi)`` (``lo`` a multiple of the block)."""
    return slice(lo // BLOCK, -(-hi // BLOCK))


def take_range(shard, source) -> None:
    """Copies of ``shard``'s range of ``source``'s (a buffer of the same layout) state in its
    stored format, block scales, master weights and compensation."""
    lo, hi = shard.lo, shard.hi
    shard.state = {name: _copy(flat[lo:hi]) for name, flat in source.state.items()}
    shard.absmax = {name: scales[blocks_of(lo, hi)].copy()
                    for name, scales in source.absmax.items()}
    shard.master = None if source.master is None else _copy(source.master[lo:hi])
    shard.compensation = (None if source.compensation is None
                          else _copy(source.compensation[lo:hi]))


def shard_coded(shard, buf) -> None:
    """At construction: ``shard`` takes its range of ``buf``'s state, master weights and
    compensation, which ``buf`` then drops (``buf.part`` points to the shard, so writing a
    parameter resets the rank's range of its master copy)."""
    if shard.lo % BLOCK or shard.hi % BLOCK and shard.hi != buf.length:
        raise DistributedError(f"buffer {buf.number}: ZeRO-1 ranges of reduced-precision "
                               f"buffers must be multiples of {BLOCK} elements (the chunk "
                               f"size is {buf.chunk_size})")
    take_range(shard, buf)
    buf.state.clear()
    buf.absmax.clear()
    buf.master = buf.compensation = None
    buf.part = shard


def average_half(comm, shard, rank: int, size: int) -> None:
    """``Sharding.average_gradients`` for 16-bit gradients: the pieces travel as bit patterns
    and are summed in float32 in rank order, ``((g0 + g1) + g2) + ...``, divided by the world
    size in float32 and rounded to nearest in the gradient dtype."""
    buf = shard.buffer
    length = shard.reduce_hi - shard.reduce_lo
    grads, kind = wire(buf.grads)
    scratch = shard.scratch(grads.dtype)
    comm.Alltoallv([grads, (shard.others_counts, shard.displs), kind],
                   [scratch, (shard.mine_counts, shard.slot_displs), kind])
    mine = buf.grads[shard.reduce_lo:shard.reduce_hi]
    pieces = [mine if q == rank else
              scratch[shard.slot_displs[q]:shard.slot_displs[q] + length].view(mine.dtype)
              for q in range(size)]
    total = pieces[0].astype(np.float32)
    for piece in pieces[1:]:
        np.add(total, piece.astype(np.float32), out=total)
    np.divide(total, np.float32(size), out=total)
    mine[...] = total.astype(mine.dtype)


def consolidate_coded(sharding, shard, buf, root: int | None) -> None:
    """``consolidated`` for a reduced-precision buffer: every rank's range of its stored
    state, block scales, master weights and compensation into ``buf`` (the plain twin's, on
    the ranks that get it; None elsewhere)."""
    here = buf is not None
    for name in sorted(shard.state):  # slots are allocated alike on every rank
        piece = shard.state[name]
        flat = aligned_zeros(shard.buffer.length, piece.dtype) if here else None
        if here:
            flat[shard.lo:shard.hi] = piece
        sharding.gather(shard, flat, root=root, piece=piece)
        scales = (sharding.comm.allgather(shard.absmax.get(name)) if root is None else
                  sharding.comm.gather(shard.absmax.get(name), root=root))
        if here:
            buf.state[name] = flat
            if scales[0] is not None:
                buf.absmax[name] = np.concatenate(scales)
    for kind in ("master", "compensation"):
        piece = getattr(shard, kind)
        if piece is None:
            continue
        flat = aligned_zeros(shard.buffer.length, piece.dtype) if here else None
        if here:
            flat[shard.lo:shard.hi] = piece
        sharding.gather(shard, flat, root=root, piece=piece)
        if here:
            getattr(buf, kind)[...] = flat
