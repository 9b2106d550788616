"""Sharded checkpoints: a directory of one file per rank and a manifest that commits them.

``flatopt.save(path, opt)`` of an optimizer sharded over P ranks (``comm=``) writes the
directory ``path``::

    path/<save_id>.rank<r>-of-<P>.h5   written by rank r: its fragment of every slot
    path/manifest.h5                   written last, by rank 0: the save's commit

A **part file** (format ``flatopt.checkpoint.part`` version 1) holds, at
``/fragments/<group>/<dtype>/<slot>``, one contiguous range of that slot (params and every
state slot), stored as a version-2 file stores a buffer: contiguous, no filter, attrs
``checksums`` (XXH3-64 of each 4 MiB block) and ``digest``. Its root attrs: format,
format_version, save_id, rank, world_size, flatopt_version.

The **manifest** (format ``flatopt.checkpoint.sharded`` version 1) is a single-file
checkpoint (see ``format``: header, metadata, scheduler, index, groups, extra arrays, commit
digest) with root attrs ``world_size`` and ``save_id`` more, in which each buffer slot
``/groups/<g>/<dtype>/<slot>`` is a fragment table instead of data: int64 rows (rank, start,
stop, digest), attr ``length``. The fragments of a slot tile ``[0, length)``; each one's digest
is its part dataset's, and the commit digest covers every table, so a part file of another
save, a damaged one or a missing one is refused by name.

Renaming ``manifest.h5`` into place commits the save (as torch.distributed.checkpoint's
``.metadata``): part files of a save whose manifest never landed are ignored, and removed by
the next save that commits. A reader opens every part file the manifest names when it parses
it and holds them, so a save committing meanwhile cannot pull them away (one committing while
the reader opens them makes it read the newer save). A load reads only the fragments, and
within them the blocks, that cover the ranges it needs (``Contents.read_range``).
"""

from __future__ import annotations

import os
import re
import secrets
import stat

import h5py
import numpy as np

from .._version import __version__
from ..errors import CheckpointError
from . import files
from .format import DTYPES, FORMAT_VERSION, LIBVER, MAX_MEMBERS, hashes_digest, manifest_digest
from .files import open_file
from .h5write import create_contiguous, set_text
from .datasets import read_arrays
from .reader import (Contents, SavedBuffer, attr, block_hashes, member, raw_offset, read_header,
                     read_index)
from .writer import Snapshot

SHARDED_FORMAT = "flatopt.checkpoint.sharded"
SHARDED_VERSION = 1
PART_FORMAT = "flatopt.checkpoint.part"
PART_VERSION = 1
MANIFEST = "manifest.h5"
MANIFEST_ATTRS = {"world_size": int, "save_id": str}
MAX_WORLD = 1 << 20
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
# part_name's output, matched in full with ASCII digits (see files.TEMPORARY)
_PART = re.compile(r"(?P<save_id>[0-9a-f]{16})\.rank(?P<rank>0|[1-9][0-9]*)"
                   r"-of-(?P<size>[1-9][0-9]*)\.h5", re.ASCII)
_DIGEST = re.compile(r"xxh3:[0-9a-f]{16}")


def new_save_id() -> str:
    return secrets.token_hex(8)


def part_name(save_id: str, rank: int, world_size: int) -> str:
    return f"{save_id}.rank{rank}-of-{world_size}.h5"


def part_match(entry: str):
    """The match of ``entry`` when it is a name part_name gives, else None."""
    match = _PART.fullmatch(entry)
    return match if match and int(match["rank"]) < int(match["size"]) else None


def is_sharded(source) -> bool:
    """Whether ``source`` names a directory (a sharded checkpoint, or nothing flatopt wrote);
    bytes are a checkpoint's contents, never a path."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    try:
        return os.path.isdir(source)
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------ fragment tables
def fragment_problems(rows: list, length: int, world_size: int) -> list[str]:
    """Why fragment rows cannot be one slot of ``length`` elements saved by ``world_size``
    ranks: they must tile ``[0, length)`` in order, each non-empty, each from another rank in
    range (a part file holds one fragment of a slot). The one check of a fragment table, made
    by the save before it commits and by every reader."""
    problems, end, ranks = [], 0, set()
    for rank, start, stop, digest in rows:
        if not 0 <= rank < world_size or rank in ranks:
            problems.append(f"a fragment of rank {rank} in a save of {world_size} ranks "
                            "(out of range, or the rank's second fragment of the slot)")
        ranks.add(rank)
        if start != end or stop <= start:
            problems.append(f"fragment [{start}, {stop}) of rank {rank} does not follow the "
                            f"previous one (which ends at {end})")
        if not _DIGEST.fullmatch(digest):
            problems.append(f"fragment [{start}, {stop}) has a bad digest {digest!r}")
        end = stop
    if end != length:
        problems.append(f"fragments cover [0, {end}) of {length} elements")
    return problems


# ------------------------------------------------------------------------ writing
def target_directory(path, create: bool) -> str:
    """The absolute directory of a sharded save, checked (and made, with ``create``)."""
    final = files.target_path(path, directory_target=True)
    if create:
        try:
            os.makedirs(final, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {final}: cannot create the "
                                  f"directory: {exc}", path=final) from exc
    return final


def write_part(directory: str, save_id: str, rank: int, world_size: int,
               pieces: list) -> list[list]:
    """Rank ``rank``'s part file, written atomically; ``pieces`` are (group, dtype name,
    slot, start, stop, array). Returns its fragment rows: [group, dtype, slot, rank, start,
    stop, digest]."""
    rows = []

    def write(target: str) -> None:
        estimate = sum(a.nbytes + 8 * (a.nbytes // (4 << 20) + 1) + 8192 for *_, a in pieces)
        with h5py.File(target, "w", libver=LIBVER, alignment_threshold=1 << 20,
                       alignment_interval=4096) as f:
            files.reserve(target, estimate + (1 << 20))
            for key, value in (("format", PART_FORMAT), ("save_id", save_id),
                               ("flatopt_version", __version__)):
                set_text(f, key, value)
            for key, value in (("format_version", PART_VERSION), ("rank", rank),
                               ("world_size", world_size)):
                f.attrs[key] = value
            root, pending = f.create_group("fragments"), []
            stored = [piece for piece in pieces if piece[4] > piece[3]]
            for group, dtype, slot, start, stop, array in stored:
                parent = root.require_group(str(group)).require_group(dtype)
                pending.append((create_contiguous(parent, slot, array.shape, array.dtype),
                                array))
            for (ds, _), hashes, (group, dtype, slot, start, stop, _) in zip(
                    pending, Snapshot._write_data(target, pending, None), stored):
                ds.attrs.create("checksums", data=hashes.astype("<u8"))
                digest = hashes_digest(hashes)
                set_text(ds, "digest", digest)
                rows.append([group, dtype, slot, rank, start, stop, digest])
            # an empty piece names its slot only (a slot of no elements has no fragment)
            rows.extend([group, dtype, slot, rank, start, stop, None]
                        for group, dtype, slot, start, stop, _ in pieces if stop <= start)

    files.replace_atomically(os.path.join(directory, part_name(save_id, rank, world_size)),
                             write)
    return rows


def commit(directory: str, snapshot, save_id: str, world_size: int, rows: list[list]) -> None:
    """Rank 0: the manifest from ``snapshot`` (a ``writer.Snapshot`` made with
    ``buffers=False``) and every rank's fragment rows, checked, then renamed into place (the
    commit); then the part files of other saves are removed."""
    numbers = {(saved.group, saved.dtype.name): saved.number for saved in snapshot.buffers}
    lengths = {(saved.number, slot): saved.layouts[slot].length for saved in snapshot.buffers
               for slot in saved.layouts}
    tables: dict[tuple[int, str], list] = {}
    in_order = sorted(rows, key=lambda row: (row[0], row[1], row[2], row[4], row[5]))
    for group, dtype, slot, rank, start, stop, digest in in_order:
        table = tables.setdefault((numbers[group, dtype], slot), [])
        if stop > start:
            table.append([rank, start, stop, digest])
    problems = []
    for (number, slot), table in sorted(tables.items()):
        saved = snapshot.buffers[number]
        problems += [f"param group {saved.group} {saved.dtype} {slot}: {problem}" for problem in
                     fragment_problems(table, lengths[number, slot], world_size)]
    if problems:
        raise CheckpointError(f"cannot commit checkpoint {directory}: the ranks' files do not "
                              "fit together (were the ranks' optimizers built alike?): "
                              + "; ".join(problems[:10]), path=directory)
    snapshot.fragments = {key: (lengths[key], table) for key, table in tables.items()}
    snapshot.header.update({"format": SHARDED_FORMAT, "format_version": SHARDED_VERSION,
                            "world_size": world_size, "save_id": save_id})
    files.replace_atomically(os.path.join(directory, MANIFEST), snapshot.write)
    remove_other_saves(directory, save_id)


def remove_other_saves(directory: str, save_id: str) -> None:
    """Part files of every other save (older, or never committed), once ``save_id`` is
    committed, and the temporary part files of savers that were killed."""
    for entry in os.listdir(directory):
        match = part_match(entry)
        if match and match["save_id"] != save_id:
            files.remove_plain_file(os.path.join(directory, entry))
        temporary = files.TEMPORARY.fullmatch(entry)
        if temporary and part_match(temporary["name"]):
            files.clean_stale_temps(directory, temporary["name"])


# ------------------------------------------------------------------------ reading
class Superseded(CheckpointError):
    """A save committed in the directory while it was being opened: the manifest read names
    part files that commit removed. Reading again reads the newer save."""


class _Fragments:
    """A slot of a sharded checkpoint, where a file has a dataset: its name and fragments."""

    def __init__(self, name: str, rows: list):
        self.name = name
        self.rows = rows


class ShardedContents(Contents):
    """A sharded checkpoint: the manifest parsed as a file is, part files opened (and their
    fragments located and checked) when first read."""

    def __init__(self, name: str, file, size: int, raw):
        super().__init__(name, file, size, raw)
        self.parts: dict[int, Contents] = {}
        self.located: dict[tuple, tuple[int, np.ndarray]] = {}
        opened = os.fstat(file.id.get_vfd_handle())
        self.manifest_id = (opened.st_dev, opened.st_ino)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
        super().close()

    def missing(self, rank: int):
        name = part_name(self.header["save_id"], rank, self.header["world_size"])
        try:
            now = os.stat(os.path.join(self.name, MANIFEST))
            replaced = (now.st_dev, now.st_ino) != self.manifest_id
        except OSError:
            replaced = True
        if replaced:  # a commit renamed another manifest into place, then removed our parts
            return Superseded(f"checkpoint {self.name}: a newer save was committed while it "
                              f"was being opened (rank {rank}'s file {name} is gone)",
                              path=self.name)
        return self.corrupt(f"rank {rank}'s file {name} is missing; the checkpoint cannot be "
                            "read without it: restore the file or use an earlier checkpoint")

    def part_path(self, rank: int) -> str:
        return os.path.join(self.name, part_name(self.header["save_id"], rank,
                                                 self.header["world_size"]))

    def part_stat(self, rank: int) -> os.stat_result:
        """Rank ``rank``'s part file, checked to be a regular file of the directory itself:
        flatopt writes no symlink, and one could point at any file, whose contents (or size)
        an error must not show."""
        try:
            found = os.lstat(self.part_path(rank))
        except OSError:
            raise self.missing(rank) from None
        if not stat.S_ISREG(found.st_mode):
            kind = "a symlink" if stat.S_ISLNK(found.st_mode) else "not a regular file"
            raise self.corrupt(f"rank {rank}'s file {os.path.basename(self.part_path(rank))} "
                               f"is {kind}; flatopt writes part files as regular files in the "
                               "checkpoint's directory and reads no other")
        return found

    def part(self, rank: int) -> Contents:
        part = self.parts.get(rank)
        if part is not None:
            return part
        save_id, size = self.header["save_id"], self.header["world_size"]
        found = self.part_stat(rank)
        try:
            file, name, nbytes, raw = open_file(self.part_path(rank))
        except CheckpointError:
            if not os.path.lexists(self.part_path(rank)):  # removed since: by a commit?
                raise self.missing(rank) from None
            raise
        part = Contents(name, file, nbytes, raw)
        part.version = FORMAT_VERSION
        try:
            opened = os.fstat(file.id.get_vfd_handle())
            if (opened.st_dev, opened.st_ino) != (found.st_dev, found.st_ino):
                raise part.corrupt("it was replaced while it was being opened")
            for key, want in (("format", PART_FORMAT), ("save_id", save_id)):
                got = attr(part, file, key, str, required=False)
                if got != want:
                    raise part.corrupt(f"its {key} is {got!r}, not {want!r}: it is not rank "
                                       f"{rank}'s file of the save {self.name} commits")
            version = attr(part, file, "format_version", int)
            if not 1 <= version <= PART_VERSION:
                raise part.corrupt(f"part format version {version}: this flatopt reads up to "
                                   f"{PART_VERSION}; upgrade flatopt")
            for key, want in (("rank", rank), ("world_size", size)):
                if attr(part, file, key, int) != want:
                    raise part.corrupt(f"its {key} is not {want}")
        except BaseException:
            part.close()  # never kept: the next read of this rank checks it again
            raise
        self.parts[rank] = part
        return part

    def pieces(self, key, slot: str) -> list[tuple]:
        return [(start, stop, lambda rank=rank, length=stop - start, digest=digest:
                 self._piece(rank, key, slot, length, digest))
                for rank, start, stop, digest in self.buffers[key].datasets[slot].rows]

    def _piece(self, rank: int, key, slot: str, length: int, digest: str) -> tuple:
        part = self.part(rank)
        located = self.located.get((rank, key, slot))
        if located is None:
            located = self.located[rank, key, slot] = self._locate(part, key, slot, length,
                                                                   digest)
        return (part, *located, f"{part.name}:/fragments/{key[0]}/{key[1]}/{slot}")

    @staticmethod
    def _locate(part: Contents, key, slot: str, length: int, digest: str):
        """A fragment's dataset in its part file, checked: plain, contiguous, of its length,
        its checksums hashing to the digest the manifest holds. (byte offset, hashes)."""
        node = member(part, part.file, "fragments", "group")
        for name in (str(key[0]), key[1]):
            if name not in node:
                raise part.corrupt(f"{node.name}/{name} is missing")
            node = member(part, node, name, "group")
        if slot not in node:
            raise part.corrupt(f"{node.name}/{slot} is missing")
        ds = member(part, node, slot, "dataset")
        dtype = DTYPES[key[1]]
        if ds.dtype != dtype or ds.shape != (length,) or set(ds.attrs) != {"checksums",
                                                                           "digest"}:
            raise part.corrupt(f"it should be {length} {key[1]} values with checksums and a "
                               f"digest, is {ds.dtype} {ds.shape}", buffer=ds.name)
        if attr(part, ds, "digest", str) != digest:
            raise part.corrupt("its digest is not the one the manifest holds (a file of "
                               "another save, or damaged)", buffer=ds.name)
        nbytes = length * dtype.itemsize
        return raw_offset(part, ds, nbytes), block_hashes(part, ds, nbytes, digest)

    def part_bytes(self) -> int:
        """Bytes of the manifest and every part file it names (checked by
        ``_check_part_sizes``)."""
        return self.size + sum(self.part_stat(rank).st_size
                               for rank in range(self.header["world_size"]))


def open_sharded(source) -> ShardedContents:
    name = os.path.abspath(files.file_name(source))
    path = os.path.join(name, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {name}: the directory has no {MANIFEST}, so it "
                              "is not a sharded flatopt checkpoint, or its first save never "
                              "committed (the manifest is written last)", path=name)
    file, _, size, raw = open_file(path)
    return ShardedContents(name, file, size, raw)


def read_structure(ck: ShardedContents) -> None:
    """The manifest's structure read and guarded, its commit digest verified (as
    ``datasets.read_structure`` does for a file)."""
    digest = read_header(ck, SHARDED_FORMAT, SHARDED_VERSION, MANIFEST_ATTRS,
                         data_version=FORMAT_VERSION)
    if not 1 <= ck.header["world_size"] <= MAX_WORLD:
        raise ck.corrupt(f"world_size {ck.header['world_size']} is not a world size")
    if not _SAVE_ID.fullmatch(ck.header["save_id"]):
        raise ck.corrupt(f"save_id {ck.header['save_id'][:40]!r} is not 16 hex digits")
    columns = read_index(ck)
    table = _read_tables(ck)
    _check_part_sizes(ck)
    arrays = read_arrays(ck)
    if manifest_digest(ck.header, ck.raw_groups, columns, table, arrays) != digest:
        raise ck.corrupt("its metadata digest does not match (attributes, index or fragment "
                         "tables were modified or damaged)")
    ck.raw_columns, ck.digest = columns, digest
    # every part file held open from now on: a later commit in the directory removes them,
    # but the save parsed here stays readable (its data lives while a handle does)
    for rank in range(ck.header["world_size"]):
        ck.part(rank)


def _check_part_sizes(ck: ShardedContents) -> None:
    """Every rank's file is there and can hold the fragments the manifest gives it, so no
    buffer is allocated for data that is not there (as a file's declared buffers must fit in
    the file)."""
    declared = [0] * ck.header["world_size"]
    for key, saved in ck.buffers.items():
        for slot, fragments in saved.datasets.items():
            for rank, start, stop, _ in fragments.rows:
                declared[rank] += (stop - start) * DTYPES[key[1]].itemsize
    for rank, nbytes in enumerate(declared):
        name = part_name(ck.header["save_id"], rank, ck.header["world_size"])
        size = ck.part_stat(rank).st_size
        if nbytes > size:
            raise ck.corrupt(f"the manifest gives rank {rank}'s file {name} {nbytes:,} bytes "
                             f"of fragments, more than its {size:,} bytes")


def _read_tables(ck: ShardedContents) -> dict[str, list]:
    """Groups and their buffers' fragment tables (``datasets.read_groups`` for a manifest)."""
    groups = member(ck, ck.file, "groups", "group")
    count = len(groups)
    if set(groups) != {str(k) for k in range(count)}:
        raise ck.corrupt(f"groups are named {sorted(groups)[:10]}, expected 0..{count - 1}")
    table: dict[str, list] = {}
    for number in range(count):
        g = member(ck, groups, str(number), "group")
        if set(g.attrs) - {"hyperparameters", "label"}:
            raise ck.corrupt(f"{g.name} has unexpected attributes")
        ck.raw_groups.append({"hyperparameters": attr(ck, g, "hyperparameters", str),
                              "label": attr(ck, g, "label", str, required=False)})
        for dtype_name in g:
            if dtype_name not in DTYPES:
                raise ck.corrupt(f"{g.name}/{dtype_name}: buffers are float32 or float64")
            b = member(ck, g, dtype_name, "group")
            if set(b.attrs) != {"length"}:
                raise ck.corrupt(f"{b.name} has unexpected attributes")
            length = attr(ck, b, "length", int)
            if length < 0:
                raise ck.corrupt(f"{b.name} declares a negative length {length}")
            slots, lengths = {}, {}
            for slot in b:
                ds = member(ck, b, slot, "dataset")
                if (ds.dtype != np.dtype("<i8") or ds.ndim != 2 or ds.shape[1] != 4
                        or ds.shape[0] > MAX_MEMBERS * MAX_WORLD or ds.shape[0] * 32 > ck.size
                        or set(ds.attrs) != {"length"}):
                    raise ck.corrupt("it should be a fragment table (int64 rows of 4, attr "
                                     f"length), is {ds.dtype} {ds.shape}", buffer=ds.name)
                own = attr(ck, ds, "length", int)
                data = ds[...]
                rows = [[int(r), int(a), int(z), f"xxh3:{int(d):016x}"]
                        for r, a, z, d in zip(data[:, 0], data[:, 1], data[:, 2],
                                              data[:, 3].view(np.uint64))]
                problems = fragment_problems(rows, own, ck.header["world_size"])
                if problems or own < 0 or (slot == "params" and own != length):
                    raise ck.corrupt("; ".join(problems) or f"length {own} (buffer {length})",
                                     buffer=ds.name)
                slots[slot], lengths[slot] = _Fragments(f"{ck.name}:{ds.name}", rows), own
                table[ds.name] = [dtype_name, own, rows]
            if "params" not in slots:
                raise ck.corrupt(f"{b.name} has no params fragment table")
            digests = {slot: hashes_digest(np.array([int(r[3][5:], 16) for r in f.rows],
                                                    np.uint64)) for slot, f in slots.items()}
            ck.buffers[number, dtype_name] = SavedBuffer(number, dtype_name, length, slots,
                                                         digests, lengths=lengths)
    return table

