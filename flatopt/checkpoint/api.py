"""The public ``save``, ``load`` and ``read``, decided once: one optimizer (``writer``,
``loader``, ``offline``; a sharded optimizer's directory through them) or a dict of several
(``run``: one directory committed at once)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import CheckpointMismatch, CheckpointOptionError
from ..lookahead import Lookahead
from ..optimizer import Optimizer
from . import loader, offline, precision, run, sharded, writer
from .format import check_flags
from .loader import LoadResult
from .offline import CheckpointData
from .writer import SaveHandle


def save(path: str | os.PathLike, opt, *, scheduler: Any = None, schedulers: Any = None,
         metadata: Any = None, arrays: Mapping[str, Any] | None = None, ema: Any = None,
         scaler: Any = None, lookahead: Any = None,
         background: bool = False) -> "str | SaveHandle":
    """Save an optimizer, or a dict ``{name: optimizer}`` of several, to ``path``.

    One optimizer: see :func:`flatopt.checkpoint.writer.save` (a file; a directory for an
    optimizer sharded over ranks). Several (``flatopt.save(path, {"muon": muon, "adamw":
    adamw}, schedulers={"muon": s1, "adamw": s2}, ema=[ema1, ema2], scaler=scaler)``): the
    directory ``path`` holds one file per optimizer and a commit file written last, so the run
    is saved whole or not at all (see :mod:`flatopt.checkpoint.run`); ``ema=`` takes an EMA,
    a list of EMAs (each stored with the optimizer it averages) or a dict by name;
    ``metadata``, ``arrays`` and ``scaler`` are the run's. A :class:`~flatopt.Lookahead` is
    saved with its optimizer (``save(path, la)``, or ``lookahead=la`` beside the optimizer; in
    a run, as the member itself). Returns the absolute path.
    """
    opt, lookahead = unwrapped(opt, lookahead)
    if _several(opt, scheduler, schedulers, lookahead):
        return run.save(path, opt, schedulers=schedulers, metadata=metadata, arrays=arrays,
                        ema=ema, scaler=scaler, background=background)
    if _sharded(opt):   # comm= over several ranks: collective
        _no_training_state(ema, scaler, "save")
        save_sharded = sharded.save_consolidated if precision.coded(opt) else sharded.save
        return save_sharded(path, opt, scheduler=scheduler, metadata=metadata, arrays=arrays,
                            background=background)
    return writer.save(path, opt, scheduler=scheduler, metadata=metadata, arrays=arrays,
                       ema=ema, scaler=scaler, lookahead=lookahead, background=background)


def load(source, opt, *, strict: bool = True, rename=None, hyperparameters: str | None = None,
         regroup: bool = False, scheduler: Any = None, schedulers: Any = None, ema: Any = None,
         scaler: Any = None, lookahead: Any = None, staging: int | None = None,
         convert: bool = False) -> "LoadResult | dict[str, LoadResult]":
    """Load a checkpoint into an optimizer, or a run's into a dict ``{name: optimizer}``.

    One optimizer: see :func:`flatopt.checkpoint.loader.load`. Several: every optimizer given
    must be in the run (and, unless ``strict=False``, every saved one given); all are
    verified and compared first, then loaded in one commit (any failure puts every optimizer,
    scheduler, EMA and scaler back). Returns ``{name: LoadResult}``; the run's metadata and
    arrays are in its first optimizer's result. ``convert=True`` (one optimizer) converts
    parameters saved with another storage (reduced precision) through float32 values.
    """
    opt, lookahead = unwrapped(opt, lookahead)
    check_flags(convert=convert)
    if convert and (isinstance(opt, Mapping) or _sharded(opt) and not precision.coded(opt)):
        raise CheckpointOptionError("convert=True is for one optimizer (or a sharded one with "
                                    "reduced-precision buffers); nothing was loaded")
    options = dict(strict=strict, rename=rename, hyperparameters=hyperparameters,
                   regroup=regroup, ema=ema, scaler=scaler, staging=staging)
    if _several(opt, scheduler, schedulers, lookahead):
        return run.load(source, opt, schedulers=schedulers, **options)
    if run.is_run(source):
        names = [entry["name"] for entry in run.read_run(source)["members"]]
        raise CheckpointMismatch(f"checkpoint {source} is a run of the optimizers {names[:20]}: "
                                 "load it with flatopt.load(path, {name: optimizer, ...})",
                                 path=str(source))
    if _sharded(opt):   # comm= over several ranks: collective
        _no_training_state(ema, scaler, "load")
        if precision.coded(opt):
            return sharded.load_whole(source, opt, scheduler=scheduler, convert=convert,
                                      **options)
        loader.check_options(opt, rename, hyperparameters, staging)
        check_flags(strict=strict, regroup=regroup)
        return sharded.load(source, opt, strict=strict, rename=rename,
                            hyperparameters=hyperparameters, regroup=regroup,
                            scheduler=scheduler, staging=staging)
    return loader.load(source, opt, scheduler=scheduler, lookahead=lookahead, convert=convert,
                       **options)


def _several(opt, scheduler, schedulers, lookahead) -> bool:
    """Whether ``opt`` is a dict of several optimizers (a run), its options checked: a run
    takes ``schedulers=`` and Lookaheads as members, one optimizer ``scheduler=``."""
    if not isinstance(opt, Mapping):
        if schedulers is not None:
            raise CheckpointOptionError("schedulers= is for a dict of optimizers; with one, "
                                        "pass scheduler=")
        return False
    if scheduler is not None:
        raise CheckpointOptionError("with several optimizers, pass schedulers={name: "
                                    "scheduler} (scheduler= is for one optimizer)")
    if lookahead is not None:
        raise CheckpointOptionError("with several optimizers, give each Lookahead as its "
                                    "member ({name: lookahead}), not lookahead=")
    return True


def unwrapped(opt, lookahead):
    """(the optimizer, its Lookahead or None) for ``opt`` given as a Lookahead or not."""
    if isinstance(opt, Lookahead):
        if lookahead is not None and lookahead is not opt:
            raise CheckpointOptionError("lookahead= names another Lookahead than the one given")
        return opt.optimizer, opt
    return opt, lookahead


def _sharded(opt) -> bool:
    return isinstance(opt, Optimizer) and opt.sharding is not None


def _no_training_state(ema, scaler, what: str) -> None:
    if ema is not None or scaler is not None:
        raise CheckpointOptionError(f"{what}(ema=, scaler=) with an optimizer sharded over "
                                    "ranks is not supported yet: keep their state_dict() in "
                                    "arrays= and metadata=")


def read(source, *, state: bool = False, arrays: bool = True
         ) -> "CheckpointData | dict[str, CheckpointData]":
    """What a checkpoint holds, without an optimizer (see
    :func:`flatopt.checkpoint.offline.read`); for a run, ``{name: CheckpointData}``."""
    if run.is_run(source):
        with run.open_members(source) as members:
            paths = {name: ck.name for name, ck in members.items()}
        return {name: offline.read(path, state=state, arrays=arrays)
                for name, path in paths.items()}
    return offline.read(source, state=state, arrays=arrays)
