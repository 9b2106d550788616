"""Comparing a checkpoint with a live optimizer by path, and the policy of which load option
accepts which difference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import _lossless
from ..optimizer import Optimizer
from ..schema import describe_group, same_kind
from .difference import Difference
from .reader import Contents, SavedParam


PATH_MATCHING = "path matching"   # reported for information, never blocking
PARTIAL = "strict=False"
REGROUP = "regroup=True"
HYPER = "hyperparameters='saved' or 'live'"
CONVERT = "convert=True"


@dataclass
class Comparison:
    """The differences found, and what a load would do: the matched (live, saved) pairs, the
    saved paths nothing uses, and each live group's values from the file (or None)."""

    differences: list[Difference] = field(default_factory=list)
    matches: list[tuple[Any, SavedParam]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    new_settings: list[dict | None] = field(default_factory=list)


def _renamed(ck: Contents, rename, diffs: list[Difference]) -> dict[str, SavedParam]:
    """Saved parameters under the paths ``rename`` gives them."""
    mapped: dict[str, SavedParam] = {}
    used_keys = set()
    for entry in ck.params:
        new = entry.path
        if rename is not None:
            if callable(rename):
                new = rename(entry.path)
            elif entry.path in rename:
                new = rename[entry.path]
                used_keys.add(entry.path)
            if new is None:
                continue  # dropped on purpose
            if not isinstance(new, str) or not new:
                diffs.append(Difference("rename", entry.path, entry.path, new,
                                        note="rename must give a non-empty string or None"))
                continue
        if new in mapped:
            diffs.append(Difference("rename", new, [mapped[new].path, entry.path], new,
                                    note="two saved paths map to the same path"))
            continue
        mapped[new] = entry
    if rename is not None and not callable(rename):
        for key in rename:
            if key not in used_keys:
                diffs.append(Difference("rename", str(key), None, rename[key],
                                        note="this rename entry matches no saved path"))
    return mapped


def _match_paths(mapped: dict[str, SavedParam], opt: Optimizer, result: Comparison) -> None:
    diffs = result.differences
    for info in opt.index:
        entry = mapped.get(info.path)
        if entry is None:
            diffs.append(Difference("missing", info.path, None, info.shape, relaxed_by=PARTIAL))
            continue
        bad = False
        if entry.shape != info.shape:
            diffs.append(Difference("shape", info.path, entry.shape, info.shape))
            bad = True
        computed = opt.buffers[info.buffer].dtype.name  # a 16-bit one's: the storage's
        if entry.dtype != computed:
            diffs.append(Difference("dtype", info.path, entry.dtype, computed))
            bad = True
        if entry.group != info.group:
            diffs.append(Difference("group", info.path, entry.group, info.group,
                                    note="the parameter moved group", relaxed_by=REGROUP))
        elif entry.id != info.id:
            diffs.append(Difference("id", info.path, entry.id, info.id,
                                    note="built in a different order or a parameter was added "
                                         "or removed; state follows the path",
                                    relaxed_by=PATH_MATCHING))
        if not bad:
            result.matches.append((info, entry))
    live_paths = set(opt.index.paths)
    result.unused = [path for path in mapped if path not in live_paths]
    for path in result.unused:
        diffs.append(Difference("unexpected", path, mapped[path].shape, None,
                                relaxed_by=PARTIAL))


def _compare_groups(ck: Contents, opt: Optimizer, result: Comparison, *, hyperparameters,
                    regroup: bool, scheduler) -> None:
    """Hyperparameters per live group, against every saved group its parameters came from.
    Values the scheduler owns (``scheduler.owned_hyperparameters``, e.g. lr) are restored from
    the file with the scheduler's state, not reported, unless ``hyperparameters="live"``; the
    optimizer's per-group state (``Hyperparameter.state``) is always restored from the file,
    never reported."""
    diffs = result.differences
    owned = set(getattr(scheduler, "owned_hyperparameters", ())) \
        if scheduler is not None and ck.scheduler_state is not None else set()
    hint = ("; the file holds a scheduler's state: pass scheduler= to restore the values it "
            "sets" if scheduler is None and ck.scheduler_state is not None else "")
    if len(ck.groups) != len(opt.param_groups):
        diffs.append(Difference("groups", "file", len(ck.groups), len(opt.param_groups),
                                note="number of param groups", relaxed_by=REGROUP))
    contributors: list[set[int]] = [set() for _ in opt.param_groups]
    for info, entry in result.matches:
        contributors[info.group].add(entry.group)
    if not regroup:
        for number in range(min(len(ck.groups), len(opt.param_groups))):
            contributors[number].add(number)
    schema = opt.schema
    kind = same_kind(ck.schema, schema)
    state = set(schema.group_state) if kind else set()
    for number, values in enumerate(opt.settings()):
        where = describe_group(number, values)
        live = {k: v for k, v in values.items() if k != "label"}
        chosen: dict[str, Any] = {}
        for saved_number in sorted(contributors[number]):
            saved = ck.groups[saved_number]["hyperparameters"]
            label = (f" (saved group {saved_number})"
                     if saved_number != number or regroup else "")
            for key in sorted(set(saved) | set(live)):
                if not kind and key not in schema.hyperparameters:
                    continue
                s, l = saved.get(key), live.get(key)
                if key in owned and key in saved and hyperparameters != "live":
                    chosen[key] = s  # restored with the scheduler that sets it
                    continue
                counter = key in state  # the optimizer's own state: restored, not compared
                if s != l and not counter:
                    hyper = schema.hyperparameters.get(key)
                    diffs.append(Difference("flag" if hyper and hyper.is_flag
                                            else "hyperparameter", f"{where} {key}{label}", s, l,
                                            relaxed_by=HYPER,
                                            note=hint.lstrip("; ") if key == "lr" else ""))
                if (hyperparameters == "saved" or counter) and key in saved:
                    if key in chosen and chosen[key] != s:
                        diffs.append(Difference(
                            "hyperparameter", f"{where} {key}", chosen[key], s,
                            note="its parameters come from saved groups that disagree" +
                                 ("" if counter else "; use hyperparameters='live'")))
                    chosen[key] = s
        result.new_settings.append(chosen or None)


def _compare_storage(ck: Contents, opt: Optimizer, result: Comparison) -> None:
    """Each matched parameter's saved storage (reduced precision, or its dtype) against the
    live buffer's: a load needs them equal, or ``convert=True``."""
    for info, entry in result.matches:
        stored = ck.storage.get(entry.path)
        saved = stored[0] if stored is not None else _lossless.plain(entry.dtype)
        live = _lossless.describe(opt.buffers[info.buffer])
        if not _lossless.same(saved, live):
            result.differences.append(Difference(
                "storage", info.path, _lossless.fmt(saved), _lossless.fmt(live),
                relaxed_by=CONVERT, note="load(..., convert=True) converts through float32 "
                                         "values"))


def compare(ck: Contents, opt: Optimizer, *, rename, hyperparameters: str | None,
            regroup: bool, scheduler) -> Comparison:
    """Every difference between ``ck`` and ``opt``, and the load plan."""
    result = Comparison()
    if not same_kind(ck.schema, opt.schema):
        redefined = ck.schema.name == opt.schema.name  # flatopt.define_optimizer replaced it
        result.differences.append(Difference(
            "optimizer", "file", ck.schema.name, opt.schema.name,
            note=("this optimizer's class was defined again since it was made (a user rule "
                  "of the same name replaced it): make the optimizer from the current class"
                  if redefined else "state of one optimizer kind cannot be loaded into "
                                    "another")))
    _match_paths(_renamed(ck, rename, result.differences), opt, result)
    _compare_storage(ck, opt, result)
    _compare_groups(ck, opt, result, hyperparameters=hyperparameters, regroup=regroup,
                    scheduler=scheduler)
    if scheduler is not None and ck.scheduler_state is None:
        result.differences.append(Difference("scheduler", "file", None,
                                             type(scheduler).__name__,
                                             note="the checkpoint holds no scheduler state",
                                             relaxed_by=PARTIAL))
    return result


def is_relaxed(diff: Difference, *, strict: bool, hyperparameters, regroup: bool,
               convert: bool = False) -> bool:
    """Whether the options given accept ``diff``. ``strict`` governs only missing and
    unexpected parameters and scheduler state; a changed id never blocks (state follows the
    path) and is listed in ``LoadResult.differences``."""
    if diff.relaxed_by == PATH_MATCHING:
        return True
    if diff.relaxed_by == PARTIAL:
        return not strict
    if diff.relaxed_by == REGROUP:
        return regroup
    if diff.relaxed_by == CONVERT:
        return convert
    if diff.relaxed_by == HYPER:
        return hyperparameters in ("saved", "live")
    return False


def mismatch_message(name: str, opt: Optimizer, blocking: list, relaxed: list) -> str:
    lines = [f"checkpoint {name} does not match this {type(opt).__name__} optimizer: "
             f"{len(blocking)} difference{'s' if len(blocking) != 1 else ''}; nothing was "
             "loaded, the optimizer is unchanged"]
    limit = 200
    for diff in blocking[:limit]:
        lines.append(f"  {diff}")
    if len(blocking) > limit:
        lines.append(f"  ... and {len(blocking) - limit} more (see .differences)")
    if relaxed:
        lines.append(f"accepted by the options given: {len(relaxed)} more")
    hints = sorted({d.relaxed_by for d in blocking
                    if d.relaxed_by and d.relaxed_by != PATH_MATCHING})
    if any(d.kind in ("missing", "unexpected") for d in blocking):
        hints.append("rename={old: new} (or a function) maps refactored paths")
    if hints:
        lines.append("options that accept some of these: " + "; ".join(hints))
    return "\n".join(lines)
