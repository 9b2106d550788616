"""One checkpoint for several optimizers (Muon for the matrices and AdamW for the rest):
``save(path, {"muon": muon, "adamw": adamw}, schedulers={...})`` and ``load(path, {...})``.

``path`` becomes a directory::

    path/<save_id>.<k>.h5   the k-th optimizer's checkpoint, an ordinary file (format
                            ``flatopt.checkpoint``) holding its scheduler and EMA; the first
                            one also holds the run's metadata, extra arrays and GradScaler
    path/run.json           written last, the save's commit: format ``flatopt.checkpoint.run``
                            version 1, save_id, the members (name, file, the file's commit
                            digest) and a sha256 digest over them

Every member is checked before the first file is written (all the optimizers' locks held), and
a load compares and validates every member against its optimizer before the first one changes;
the members then load in one commit: if any fails, every optimizer, scheduler, EMA and scaler
is put back. Replacing ``run.json`` commits a save (as a sharded checkpoint's manifest): a
crash leaves the previous run, and the member files (and temporary files) of a save that never
committed are removed by the next save. ``inspect``, ``verify`` and ``diff`` show each member.

Saves of one directory take turns (``path/.run.lock``, an ``flock`` held from the first member
written to the last file removed), so a save's clean-up never removes the members of another
save that may still commit. Loads take no lock: members are removed only after a newer
``run.json`` is in place, so a member that cannot be opened while ``run.json`` names another
save is superseded, and the load reads the newer run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
from typing import Any, Mapping

import h5py

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointOptionError
from ..lookahead import Lookahead
from ..optimizer import Optimizer
from . import extras, files

try:
    import fcntl
except ImportError:  # not POSIX: saves of one directory from several processes are not ordered
    fcntl = None
from .format import check_flags
from .loader import Prepared, check_options, parse
from .manifest import MANIFEST
from .tools import diff_checkpoints, inspect_checkpoint, verify_checkpoint
from .writer import Snapshot

RUN_FILE = "run.json"
LOCK_FILE = ".run.lock"
RUN_FORMAT = "flatopt.checkpoint.run"
RUN_VERSION = 1
MAX_OPTIMIZERS = 256
MAX_RUN_BYTES = 1 << 20
_MEMBER = re.compile(r"(?P<save_id>[0-9a-f]{16})\.(?P<k>0|[1-9][0-9]{0,2})\.h5", re.ASCII)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
# each retry follows a newer commit, so many are needed only under a stream of saves
SUPERSEDED_RETRIES = 100


def is_run(source) -> bool:
    """Whether ``source`` is a directory holding a run's commit file."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    try:
        return os.path.isfile(os.path.join(source, RUN_FILE))
    except (TypeError, ValueError):
        return False


def _digest(content: Mapping) -> str:
    text = json.dumps({k: content[k] for k in ("format", "format_version", "save_id",
                                                "members")},
                      sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- checks
def _name_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 1024:
        return f"optimizer names are non-empty strings without NUL (at most 1024), got {name!r}"
    return None


def members_of(optimizers: Any) -> tuple[Any, dict]:
    """``{name: optimizer}`` with each Lookahead replaced by its optimizer, and the
    Lookaheads by name (saved and loaded with their optimizers)."""
    if not isinstance(optimizers, Mapping):
        return optimizers, {}
    lookaheads = {name: o for name, o in optimizers.items() if isinstance(o, Lookahead)}
    return {name: lookaheads[name].optimizer if name in lookaheads else o
            for name, o in optimizers.items()}, lookaheads


def checked_optimizers(optimizers: Any, what: str) -> dict[str, Optimizer]:
    """``{name: optimizer}`` checked: distinct flatopt optimizers, none sharded over ranks."""
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise CheckpointOptionError(f"{what} takes an optimizer or a non-empty dict "
                                    f"{{name: optimizer}}")
    problems = []
    if len(optimizers) > MAX_OPTIMIZERS:
        problems.append(f"{len(optimizers)} optimizers (at most {MAX_OPTIMIZERS})")
    seen: dict[int, str] = {}
    for name, opt in optimizers.items():
        problem = _name_problem(name)
        if problem:
            problems.append(problem)
        elif not isinstance(opt, Optimizer):
            problems.append(f"{name!r} is a {type(opt).__name__}, not a flatopt optimizer")
        elif opt.sharding is not None:
            problems.append(f"{name!r} is sharded over ranks: save a sharded optimizer on its "
                            "own (its checkpoint is a directory of its own)")
        elif id(opt) in seen:
            problems.append(f"{name!r} is the same optimizer as {seen[id(opt)]!r}")
        else:
            seen[id(opt)] = name
    if problems:
        raise CheckpointOptionError(f"{what}: " + "; ".join(problems[:20]))
    return dict(optimizers)


def _per_member(value: Any, optimizers: Mapping[str, Optimizer], what: str) -> dict[str, Any]:
    """``schedulers=`` or ``ema=`` spread over the members: a dict by name (schedulers, or
    EMAs), or EMAs found by the optimizer each averages."""
    if value is None:
        return {}
    if what == "ema" and not isinstance(value, Mapping):
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        owners = {id(opt): name for name, opt in optimizers.items()}
        spread: dict[str, Any] = {}
        for ema in value:
            name = owners.get(id(getattr(ema, "opt", None)))
            if name is None or name in spread:
                raise CheckpointOptionError(
                    "ema= takes EMAs of the optimizers given, at most one each (or a dict "
                    f"{{name: EMA}}); {type(ema).__name__} is not one of them"
                    if name is None else f"ema=: two EMAs of optimizer {name!r}")
            spread[name] = ema
        return spread
    if not isinstance(value, Mapping):
        raise CheckpointOptionError(f"with several optimizers, {what}= takes a dict "
                                    f"{{name: {what}}}, got {type(value).__name__}")
    unknown = [name for name in value if name not in optimizers]
    if unknown:
        raise CheckpointOptionError(f"{what}= names {unknown[:10]}, which are not among the "
                                    f"optimizers {list(optimizers)[:20]}")
    return {name: v for name, v in value.items() if v is not None}


def named(exc: CheckpointError, name: str) -> CheckpointError:
    """``exc`` (kept as it is: its type, path, differences), its message naming the member."""
    exc.args = (f"optimizer {name!r}: {exc.args[0] if exc.args else ''}", *exc.args[1:])
    return exc


@contextlib.contextmanager
def _all_locked(optimizers: Mapping[str, Optimizer]):
    """Every optimizer's lock, taken in one global order (by id), whatever the dict's order:
    two threads naming the same optimizers in different orders cannot deadlock."""
    with contextlib.ExitStack() as stack:
        for opt in sorted(optimizers.values(), key=id):
            stack.enter_context(opt.lock)
        yield


@contextlib.contextmanager
def _directory_locked(final: str):
    """The run directory's save lock (``flock`` on ``LOCK_FILE``, across processes and
    threads), released when the save ends or its process dies. Never a symlink or anything
    but a regular file: a planted one is refused, not followed."""
    if fcntl is None:
        yield
        return
    where = os.path.join(final, LOCK_FILE)
    flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(where, flags, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot save checkpoint {final}: cannot open its lock file "
                              f"{where}: {exc}", path=final) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"cannot save checkpoint {final}: {where} is not a regular "
                                  "file (flatopt keeps its save lock there)", path=final)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {final}: cannot lock {where}: "
                                  f"{exc}", path=final) from exc
        yield
    finally:
        os.close(fd)


def _remove_uncommitted(final: str, keep: set[str]) -> None:
    """Remove the member files whose save id is not in ``keep``, and the temporary files of
    members of any save but ``keep``'s (a killed save's: with the directory locked, no other
    save of it is writing). Called with the directory locked."""
    for entry in os.listdir(final):
        temporary = files.TEMPORARY.fullmatch(entry)
        member = _MEMBER.fullmatch(temporary["name"] if temporary else entry)
        if member and member["save_id"] not in keep:
            files.remove_plain_file(os.path.join(final, entry))


def _committed_save_id(final: str) -> str | None:
    """The save id ``run.json`` commits, or None when there is none (or it is damaged)."""
    try:
        return read_run(final)["save_id"]
    except CheckpointError:
        return None


# ----------------------------------------------------------------------------- save
def save(path, optimizers: Mapping, *, schedulers=None, metadata=None, arrays=None, ema=None,
         scaler=None, background: bool = False) -> str:
    """See ``flatopt.save``: several optimizers in one directory, committed at once."""
    check_flags(background=background)
    optimizers, lookaheads = members_of(optimizers)
    optimizers = checked_optimizers(optimizers, "save()")
    if background:
        raise CheckpointOptionError("save() of several optimizers has no background=True yet: "
                                    "save them in the foreground")
    schedulers = _per_member(schedulers, optimizers, "scheduler")
    emas = _per_member(ema, optimizers, "ema")
    final = files.target_path(path, directory_target=os.path.isdir(files.file_name(path)))
    if os.path.isdir(final) and os.path.exists(os.path.join(final, MANIFEST)):
        raise CheckpointError(f"cannot save checkpoint {final}: it holds a sharded checkpoint; "
                              "choose another path", path=final)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"cannot save checkpoint {final}: it is a file, and a run of "
                              "several optimizers is a directory; choose another path",
                              path=final)
    save_id = secrets.token_hex(8)
    with _all_locked(optimizers):
        snapshots = []
        for k, (name, opt) in enumerate(optimizers.items()):
            try:
                snapshots.append(Snapshot(
                    opt, metadata if k == 0 else None, schedulers.get(name),
                    arrays if k == 0 else None, ema=emas.get(name),
                    lookahead=lookaheads.get(name),
                    scaler=scaler if k == 0 else None))
            except CheckpointError as exc:
                raise named(exc, name)
        try:
            os.makedirs(final, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {final}: {exc}", path=final) from exc
        with _directory_locked(final):
            try:
                committed = _committed_save_id(final)
                # what crashed saves left, before this one needs the space
                _remove_uncommitted(final, {committed, save_id})
                members = [_write_member(final, f"{save_id}.{k}.h5", name, snapshot)
                           for k, (name, snapshot) in enumerate(zip(optimizers, snapshots))]
                _commit(final, save_id, members)
            except OSError as exc:
                raise CheckpointError(f"cannot save checkpoint {final}: {exc}",
                                      path=final) from exc
            _remove_uncommitted(final, {save_id})   # the previous run's members
    return final


def _write_member(final: str, member: str, name: str, snapshot: Snapshot) -> dict:
    """Write one member file; its entry in ``run.json``."""
    where = os.path.join(final, member)
    files.replace_atomically(where, snapshot.write)
    try:
        with h5py.File(where, "r") as f:
            digest = f.attrs["digest"]
    except (OSError, KeyError) as exc:
        raise CheckpointError(f"cannot save checkpoint {final}: member {name!r} ({where}) "
                              f"cannot be read back: {exc}", path=final) from exc
    return {"name": name, "file": member,
            "digest": digest.decode() if isinstance(digest, bytes) else digest}


def _commit(final: str, save_id: str, members: list[dict]) -> None:
    content = {"format": RUN_FORMAT, "format_version": RUN_VERSION, "save_id": save_id,
               "members": members}
    content["digest"] = _digest(content)
    text = json.dumps(content, indent=1, ensure_ascii=True).encode()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as out:
            out.write(text)
    files.replace_atomically(os.path.join(final, RUN_FILE), write)


# ----------------------------------------------------------------------------- read
def read_run(directory: str) -> dict:
    """The commit file of the run at ``directory``, checked: format, version, digest, and
    member files named as this format names them (inside the directory)."""
    where = os.path.join(os.path.abspath(directory), RUN_FILE)

    def corrupt(message: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"checkpoint {where} is damaged or not a flatopt run: "
                                 f"{message}", path=where)
    try:
        with open(where, "rb") as f:
            raw = f.read(MAX_RUN_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {where}: {exc}", path=where) from exc
    if len(raw) > MAX_RUN_BYTES:
        raise corrupt(f"larger than {MAX_RUN_BYTES} bytes")
    try:
        content = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise corrupt(f"not JSON ({exc})") from None
    keys = {"format", "format_version", "save_id", "members", "digest"}
    if not isinstance(content, dict) or set(content) != keys:
        raise corrupt(f"expected the keys {sorted(keys)}")
    if content["format"] != RUN_FORMAT:
        raise corrupt(f"format is {str(content['format'])[:80]!r}, not {RUN_FORMAT!r}")
    version = content["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise corrupt(f"format_version {version!r}")
    if version > RUN_VERSION:
        raise CheckpointMismatch(f"checkpoint {where} has run format version {version}, but "
                                 f"this flatopt reads up to {RUN_VERSION}: upgrade flatopt",
                                 path=where)
    if content["digest"] != _digest(content):
        raise corrupt("its digest does not match (it was modified or damaged)")
    members = content["members"]
    if not isinstance(members, list) or not 0 < len(members) <= MAX_OPTIMIZERS:
        raise corrupt("members is not a list of 1 to 256 entries")
    names = set()
    for k, entry in enumerate(members):
        if not isinstance(entry, dict) or set(entry) != {"name", "file", "digest"}:
            raise corrupt(f"member {k} is not {{name, file, digest}}")
        if _name_problem(entry["name"]) or entry["name"] in names:
            raise corrupt(f"member {k} has a bad or repeated name {str(entry['name'])[:80]!r}")
        names.add(entry["name"])
        if entry["file"] != f"{content['save_id']}.{k}.h5" \
                or not _MEMBER.fullmatch(str(entry["file"])):
            raise corrupt(f"member {k} names the file {str(entry['file'])[:80]!r}")
        if not isinstance(entry["digest"], str) or not _DIGEST.fullmatch(entry["digest"]):
            raise corrupt(f"member {k} has a bad digest")
    return content


@contextlib.contextmanager
def open_members(directory: str):
    """``{name: Contents}`` of every member of the run, each parsed, checked and matched to
    the digest the commit recorded (a run committing meanwhile is read again)."""
    for attempt in range(SUPERSEDED_RETRIES):
        content = read_run(directory)
        opened: dict[str, Any] = {}
        try:
            for entry in content["members"]:
                member = os.path.join(os.path.abspath(directory), entry["file"])
                ck = opened[entry["name"]] = parse(member)
                if ck.digest != entry["digest"]:
                    raise CheckpointCorrupt(
                        f"checkpoint {directory}: member {entry['name']!r} ({member}) is not "
                        "the file its run committed (its digest differs)", path=member)
        except CheckpointError:
            for ck in opened.values():
                ck.close()
            # a newer save's clean-up removes members only after its commit: a member that
            # failed while run.json names another save was superseded, not damaged
            if attempt < SUPERSEDED_RETRIES - 1 \
                    and _committed_save_id(directory) not in (None, content["save_id"]):
                continue
            raise
        except BaseException:
            for ck in opened.values():
                ck.close()
            raise
        try:
            yield opened
        finally:
            for ck in opened.values():
                ck.close()
        return


# ----------------------------------------------------------------------------- load
def load(source, optimizers: Mapping, *, strict: bool = True, rename=None,
         hyperparameters=None, regroup: bool = False, schedulers=None, ema=None, scaler=None,
         staging: int | None = None) -> dict:
    """See ``flatopt.load``: every optimizer of the run at ``source`` in one commit; returns
    ``{name: LoadResult}`` (the first one's holds the run's metadata and arrays)."""
    optimizers, lookaheads = members_of(optimizers)
    optimizers = checked_optimizers(optimizers, "load()")
    for opt in optimizers.values():
        check_options(opt, rename, hyperparameters, staging)
    check_flags(strict=strict, regroup=regroup)
    schedulers = _per_member(schedulers, optimizers, "scheduler")
    emas = _per_member(ema, optimizers, "ema")
    if not is_run(source):
        raise CheckpointMismatch(f"checkpoint {source} holds one optimizer, not a run of "
                                 f"several: load it with flatopt.load(path, optimizer)",
                                 path=str(source))
    with _all_locked(optimizers), open_members(source) as members, files.pool() as workers:
        saved = list(members)
        missing = [name for name in optimizers if name not in members]
        unused = [name for name in saved if name not in optimizers]
        if missing or (unused and strict):
            raise CheckpointMismatch(
                f"checkpoint {source} holds the optimizers {saved[:20]}; "
                + (f"it has none named {missing[:20]}" if missing else
                   f"{unused[:20]} were not given (pass strict=False to load the rest)")
                + "; nothing was loaded", path=str(source))
        prepared = []
        for k, (name, opt) in enumerate(optimizers.items()):
            first = saved.index(name) == 0
            try:
                prepared.append(Prepared.of(
                    members[name], opt, workers, strict=strict, rename=rename,
                    hyperparameters=hyperparameters, regroup=regroup,
                    scheduler=schedulers.get(name), ema=emas.get(name),
                    lookahead=lookaheads.get(name),
                    scaler=scaler if first else None))
            except CheckpointError as exc:
                raise named(exc, name)
        if scaler is not None and not any(saved.index(n) == 0 for n in optimizers):
            raise CheckpointOptionError(f"scaler=: the run's GradScaler is saved with its first "
                                        f"optimizer {saved[0]!r}, which was not given")
        wanted = [w for p in prepared for w in p.wanted]

        def apply_from(k: int) -> None:
            if k == len(prepared):
                extras.load_states(wanted, str(source))
            else:   # the next member loads inside this one's commit: its failure undoes both
                prepared[k].apply(staging, lambda: apply_from(k + 1))
        apply_from(0)
        return {name: p.result() for name, p in zip(optimizers, prepared)}


# ----------------------------------------------------------------------------- tools
def _members(directory: str) -> list[tuple[str, str]]:
    """(name, member file) of the run at ``directory``, every member checked against it."""
    with open_members(directory) as members:
        return [(name, ck.name) for name, ck in members.items()]


def inspect_run(directory: str, *, tensors: bool = False) -> dict:
    """``inspect_checkpoint`` of every member: ``{"path", "run": save_id, "members"}``."""
    return {"path": os.path.abspath(directory), "run": read_run(directory)["save_id"],
            "members": {name: inspect_checkpoint(member, tensors=tensors)
                        for name, member in _members(directory)}}


def verify_run(directory: str) -> dict:
    """``verify_checkpoint`` of every member; ``ok`` only when the run and all are sound."""
    result: dict[str, Any] = {"path": os.path.abspath(directory), "ok": False, "problems": [],
                              "members": {}}
    try:
        members = _members(directory)
    except CheckpointError as exc:
        result["problems"].append(str(exc))
        return result
    result["members"] = {name: verify_checkpoint(member) for name, member in members}
    result["ok"] = all(entry["ok"] for entry in result["members"].values())
    return result


def diff_runs(a: str, b: str) -> dict:
    """``diff_checkpoints`` of the members two runs share, and the names only one has."""
    ma, mb = dict(_members(a)), dict(_members(b))
    members = {name: diff_checkpoints(ma[name], mb[name]) for name in ma if name in mb}
    only_a = [name for name in ma if name not in mb]
    only_b = [name for name in mb if name not in ma]
    return {"a": os.path.abspath(a), "b": os.path.abspath(b), "members": members,
            "only_in_a": only_a, "only_in_b": only_b,
            "identical": not only_a and not only_b and all(d["identical"]
                                                           for d in members.values())}
