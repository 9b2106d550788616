"""Checkpoints of a sharded optimizer (``comm=`` with more than one rank, flatopt.distributed).

``flatopt.save(path, opt)`` and ``flatopt.load(path, opt)`` come here for a sharded optimizer;
both are collective (every rank calls them with the same arguments).

The route taken is the simple, sound one: a save gathers the state to rank 0 (``Gatherv``),
which writes the ordinary single file with every guarantee of a plain save (checked first,
written to a temporary file, checksummed, fsynced, renamed over ``path``). A rank killed during
the save leaves the previous checkpoint in place: rank 0 renames only a complete file. A load
reads and verifies the whole file on every rank into a plain copy of the optimizer (all of
flatopt's load checks and options apply), and each rank keeps its range of the state. Because
the file is the single-process format, a checkpoint saved at any world size loads at any other,
into a plain optimizer too, and a plain optimizer's checkpoint loads into a sharded one.

What it costs: rank 0 holds a whole copy of the parameters and state while it saves, and every
rank holds one while it loads (state gathered for the save; for a load only the file's); the
file is read by every rank. (Per-rank files with a manifest, read in ranges, would avoid both;
not built yet.)
"""

from __future__ import annotations

from typing import Any

from .. import distributed
from ..distributed._common import _error_record, _raise_collected


def _collectively(comm, action, where: str, root: int | None = None):
    """``action()`` on every rank (or on ``root`` only); any rank's failure raises on every
    rank. Returns the action's value (``root``'s, broadcast, when only it acts)."""
    record = failure = value = None
    if root is None or comm.Get_rank() == root:
        try:
            value = action()
        except Exception as error:  # every rank must hear of it before raising
            record, failure = _error_record(error), error
    records = comm.allgather(record)
    if failure is not None:
        raise failure
    _raise_collected(records, where)
    return value if root is None else comm.bcast(value, root=root)


def save(path, opt, *, scheduler: Any = None, metadata: Any = None,
         arrays: dict | None = None, background: bool = False):
    """flatopt.save for a sharded optimizer: rank 0 writes the whole state (see above)."""
    from .writer import save as save_plain
    comm = opt.comm
    if background:
        raise distributed.DistributedError(
            f"flatopt.save(..., background=True) is not available for {type(opt).__name__} "
            "sharded over ranks: save in the foreground (rank 0 writes the gathered state)")
    with opt.lock:
        twin = distributed.consolidated(opt, root=0)
        return _collectively(comm, lambda: save_plain(path, twin, scheduler=scheduler,
                                                      metadata=metadata, arrays=arrays),
                             f"flatopt.save({str(path)!r})", root=0)


def load(source, opt, **options: Any):
    """flatopt.load for a sharded optimizer: every rank loads and verifies the file into a
    plain copy of the optimizer, then keeps its own range of the state."""
    from .loader import load as load_plain
    with opt.lock:
        # live state never survives a load (state comes from the file or is reset), so the
        # copy needs this optimizer's parameter values and settings only, not its state
        twin = distributed.plain_copy(opt)
        result = _collectively(opt.comm, lambda: load_plain(source, twin, **options),
                               f"flatopt.load({str(source)[:200]!r})")
        distributed.take_from(opt, twin)
    return result
