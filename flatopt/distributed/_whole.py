"""The state as a whole: its size on this rank, and the plain (unsharded) copies that
checkpoints and consolidation go through."""

from __future__ import annotations

from .._layout import aligned_zeros
from ._coded import consolidate_coded, take_range


# ------------------------------------------------------------------------ state as a whole
def state_nbytes(opt) -> int:
    """Bytes of optimizer state (the state slots) held by this rank: its shards' when
    sharded, the whole state otherwise."""
    if opt.sharding is not None:
        return opt.sharding.state_nbytes
    return sum(flat.nbytes for buf in opt.buffers for flat in buf.state.values())


def plain_copy(opt):
    """A plain single-process optimizer of ``opt``'s class, groups, settings and parameter
    values, with fresh state (what a load starts from: a load replaces every state it does
    not reset). Groups keep their storage settings (reduced precision)."""
    settings = opt.settings()
    groups = [{**values, **({} if storage.default else storage.as_dict()),
               "params": {path: opt.params[path] for path in group["params"]}}
              for values, group, storage in zip(settings, opt.param_groups, opt.storage)]
    twin = type(opt)(groups)
    twin.defaults = dict(opt.defaults)
    return twin


def consolidated(opt, root: int | None = None):
    """A plain single-process optimizer equal to ``opt``: same class, groups, settings,
    parameters, per-parameter columns and the full state, gathered from every rank. A
    collective: call it on every rank. With ``root``, only that rank gets it (the state is
    gathered there alone) and the others get None. ``opt`` itself when it is not sharded."""
    sharding = opt.sharding
    if sharding is None:
        return opt
    sharding.sync_shards()  # buffers added by add_param_group since the last step
    here = root is None or sharding.rank == root
    twin = plain_copy(opt) if here else None
    for shard, mine in zip(sharding.shards, opt.buffers):
        buf = twin.buffers[mine.number] if here else None
        if here:
            for name, column in mine.columns.items():
                buf.columns[name][...] = column
            buf.state.clear()
            buf.draws = mine.draws  # the stochastic rounding's step count
        if mine.coded:
            consolidate_coded(sharding, shard, buf, root)
            continue
        for name in opt.schema.rule.slots:  # slots are allocated alike on every rank
            if name not in shard.state:
                continue
            flat = aligned_zeros(mine.layout(name).length, mine.dtype) if here else None
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
    sharding = opt.sharding
    for number, group in enumerate(twin.param_groups):
        opt.param_groups[number].update({k: v for k, v in group.items() if k != "params"})
    for shard, buf, mine in zip(sharding.shards, twin.buffers, opt.buffers):
        mine.params[...] = buf.params
        for name, column in buf.columns.items():
            mine.columns[name][...] = column
        shard.state.clear()
        mine.draws = buf.draws  # the stochastic rounding's step count
        if mine.coded:  # the state as stored, its block scales, the master weights
            take_range(shard, buf)
        for name, flat in buf.state.items() if not mine.coded else ():
            shard.state[name] = aligned_zeros(shard.slot_length(name), buf.dtype)
            shard.state[name][...] = shard.range_of(name, flat)
        shard.arrays = shard.arrays_plan = None
    opt.invalidate_plans()
