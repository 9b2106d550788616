"""File handling: atomic replacement (a temporary file beside the target, space reserved up
front, fsync, rename, directory fsync; stale temporary files of killed savers removed), the
raw block I/O of format version 2 (buffers read and written in blocks on several threads, each
block hashed as it passes through the cache), and opening a checkpoint file for reading."""

from __future__ import annotations

import concurrent.futures
import errno
import io
import os
import re
import stat
import tempfile
import threading
from typing import Callable

import h5py
import numpy as np

from .._io import pwrite_all
from ..errors import CheckpointCorrupt, CheckpointError
from .format import BLOCK_BYTES, block_hasher, hash_block, n_blocks

# The name of a save's temporary file: "." + the target's name + "." + the saver's pid + "." +
# mkstemp's 8 random characters + ".tmp". Matched in full (``$`` would also match before a
# trailing newline) with ASCII classes (``\d`` takes any Unicode digit): a name that only
# resembles one is a user's file and stays. (Were mkstemp's random part to change, stale
# temporary files would stay too: the safe side.)
TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>[1-9][0-9]{0,9})\.[a-z0-9_]{8}\.tmp",
                       re.ASCII | re.DOTALL)
SIGNATURE = b"\x89HDF\r\n\x1a\n"  # where a file flatopt wrote starts (no user block)
SUPERBLOCKS = (2, 3)  # superblock versions whose metadata HDF5 checksums (flatopt writes 3)
BYTES_HINT = ("bytes are a checkpoint's contents, never its path: to load a file, pass its "
              "path as a str or os.PathLike")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXT = ("No space left", "Disk quota", "File too large")


def reserve(path: str, nbytes: int) -> None:
    """Allocate the file's disk space up front, so a full disk fails here, cleanly, before
    HDF5 writes any chunk (HDF5 2.0 crashes on close after a failed chunked write)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL,
                         getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            return  # the filesystem cannot reserve space; write without the reservation
        raise
    finally:
        os.close(fd)


def trim(path: str) -> None:
    """Cut the file to the end of HDF5's data (recorded in superblock v2/v3), dropping the
    unused tail of the reservation."""
    with open(path, "r+b") as handle:
        head = handle.read(48)
        if (len(head) < 48 or head[:8] != SIGNATURE or head[8] not in (2, 3)
                or head[9] != 8):
            return
        end = int.from_bytes(head[28:36], "little")
        handle.seek(0, os.SEEK_END)
        if 0 < end < handle.tell():
            handle.truncate(end)


def fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def clean_stale_temps(directory: str, name: str) -> None:
    """Remove temporary files that a killed save of ``name`` left behind."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        match = TEMPORARY.fullmatch(entry)
        if not match or match["name"] != name:
            continue
        pid = int(match["pid"])
        if pid == os.getpid():
            continue  # our own temp files are removed by the save that made them
        try:
            os.kill(pid, 0)
            continue  # that saver is still running
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue
        remove_plain_file(os.path.join(directory, entry))


def remove_plain_file(path: str) -> None:
    """Remove ``path`` if it is a regular file, ignoring failures. Never a symlink: flatopt
    makes none, so one bearing a name flatopt uses was put there by someone else."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def file_name(path, what: str = "a checkpoint path must be a str or os.PathLike") -> str:
    """``path`` (str, bytes or os.PathLike) as a str; ``CheckpointError`` saying ``what``
    otherwise."""
    try:
        name = os.fspath(path)
    except TypeError:
        raise CheckpointError(f"{what}, got {type(path).__name__}") from None
    return os.fsdecode(name) if isinstance(name, bytes) else name


def target_path(path, directory_target: bool = False) -> str:
    """The absolute target of a save, checked: a str or PathLike to a file (or, with
    ``directory_target``, a sharded checkpoint's directory) in an existing directory."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        # load() reads bytes as a checkpoint's contents: a file saved under a bytes path
        # could not be loaded by the same argument
        raise CheckpointError(f"cannot save to the bytes path {bytes(path)[:200]!r}: "
                              f"{BYTES_HINT}, so save takes a str or os.PathLike too "
                              "(os.fsdecode(path))")
    final = file_name(path)
    try:
        os.fsencode(final)
    except UnicodeEncodeError:
        raise CheckpointError(f"invalid checkpoint path {final!r}: it cannot be encoded for "
                              "the file system (a lone surrogate?)") from None
    if not final or "\x00" in final:
        raise CheckpointError(f"invalid checkpoint path {final!r}")
    final = os.path.abspath(final)
    directory = os.path.dirname(final)
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot save checkpoint {final}: directory {directory} does not "
                              "exist", path=final)
    if directory_target and os.path.exists(final) and not os.path.isdir(final):
        raise CheckpointError(
            f"cannot save checkpoint {final}: it is a file, and an optimizer sharded over ranks "
            "saves a directory (one file per rank and a manifest): choose another path, or "
            "remove the file (to write one file, save flatopt.distributed.consolidated(opt, "
            "root=0) on rank 0)", path=final)
    if not directory_target and os.path.isdir(final):
        raise CheckpointError(f"cannot save checkpoint {final}: it is a directory", path=final)
    return final


def full_hint(exc: Exception) -> str:
    """" (the disk is full ...)" when ``exc`` says so, else ""."""
    full = getattr(exc, "errno", None) in _FULL_ERRNOS or any(
        marker in str(exc) for marker in _FULL_TEXT)
    return " (the disk is full or a file size limit was hit)" if full else ""


def replace_atomically(final: str, write: Callable[[str], None]) -> None:
    """Call ``write(temporary_path)``, then make the result ``final`` atomically and durably.

    A crash at any moment leaves either the previous file or the new one; a failure removes the
    temporary file, leaves ``final`` untouched and raises :class:`CheckpointError` (for an
    ``OSError``, saying when the disk is full)."""
    directory, name = os.path.split(final)
    clean_stale_temps(directory, name)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.{os.getpid()}.",
                                   suffix=".tmp")
    except OSError as exc:
        raise CheckpointError(f"cannot save checkpoint {final}: cannot create a temporary file "
                              f"in {directory}: {exc}", path=final) from exc
    os.close(fd)
    try:
        write(tmp)
        trim(tmp)
        fsync_path(tmp)
        try:
            mode = os.stat(final).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, final)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointError):
            # h5py reports a failed write (a full disk the reservation did not foresee) as
            # OSError or RuntimeError
            raise CheckpointError(f"could not save checkpoint {final}{full_hint(exc)}: {exc}; "
                                  "the temporary file was removed and any previous checkpoint "
                                  "at that path is untouched", path=final) from exc
        raise
    fsync_path(directory, directory=True)


# ----------------------------------------------------------------------------- block I/O
def io_threads() -> int:
    """Threads that read, write and hash blocks at once: hashing and the copies to and from the
    page cache release the GIL, so they spread over the cores (memory bandwidth caps the gain
    beyond a few)."""
    return max(1, min(4, os.cpu_count() or 1))


class pool:
    """A thread pool for one save, load or verify (``threads`` <= 1: no pool, the calling
    thread does everything). Made per operation, so a forked child never inherits one."""

    def __init__(self, threads: int | None = None):
        self.threads = io_threads() if threads is None else threads
        self.executor = (concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix="flatopt-io") if self.threads > 1 else None)

    def map(self, fn, items) -> list:
        """``fn`` over ``items``; every call has finished when this returns or raises (the
        first error in item order), so nothing writes into a caller's memory afterwards."""
        if self.executor is None:
            return [fn(item) for item in items]
        futures = [self.executor.submit(fn, item) for item in items]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)


def _blocks(nbytes: int) -> list[tuple[int, int, int]]:
    return [(k, k * BLOCK_BYTES, min(BLOCK_BYTES, nbytes - k * BLOCK_BYTES))
            for k in range(n_blocks(nbytes))]


def byte_view(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes (the array itself for a 0-d or empty one)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class RawReader:
    """Reads byte ranges of an open checkpoint (a file descriptor, bytes, or a file object)
    straight into memory, bypassing HDF5; short reads (a truncated file) raise EOFError."""

    parallel = True

    def readinto(self, view: memoryview, offset: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class _FdReader(RawReader):
    def __init__(self, fd: int):
        self.fd = fd
        self.parallel = hasattr(os, "preadv") or hasattr(os, "pread")

    def readinto(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(self.fd, [view[done:]], offset + done)
            else:
                chunk = os.pread(self.fd, len(view) - done, offset + done)
                view[done:done + len(chunk)] = chunk
                got = len(chunk)
            if got <= 0:
                raise EOFError(f"the file ends before byte {offset + len(view)}")
            done += got


class _MemoryReader(RawReader):
    def __init__(self, data: memoryview):
        self.data = data

    def readinto(self, view: memoryview, offset: int) -> None:
        end = offset + len(view)
        if end > len(self.data):
            raise EOFError(f"the file ends before byte {end}")
        view[:] = self.data[offset:end]


class _StreamReader(RawReader):
    parallel = False

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()

    def readinto(self, view: memoryview, offset: int) -> None:
        with self.lock:
            self.stream.seek(offset)
            done = 0
            while done < len(view):
                got = self.stream.readinto(view[done:])
                if not got:
                    raise EOFError(f"the file ends before byte {offset + len(view)}")
                done += got


def raw_reader(source, fd: int | None) -> RawReader:
    """The reader for a checkpoint opened from ``source``: HDF5's own file descriptor for a
    path (the very file HDF5 parsed, whatever happens to the path since), the bytes
    themselves for an in-memory checkpoint, the file object otherwise."""
    if isinstance(source, io.BytesIO):
        return _MemoryReader(source.getbuffer().toreadonly())
    if fd is not None and (hasattr(os, "preadv") or hasattr(os, "pread")):
        return _FdReader(fd)
    if fd is not None:  # no positional reads (Windows): HDF5's descriptor through a lock
        return _StreamReader(os.fdopen(os.dup(fd), "rb", buffering=0))
    return _StreamReader(source)


READ_PIECE = 1 << 20
"""Bytes read, kept (the undo copy), hashed and checked at a time: a block passes in pieces
this size, each worked on while it is in the core's cache (the hash is streamed over them)."""


def read_hashed(reader: RawReader, offset: int, out: memoryview, workers: pool,
                before: Callable[[int, int], None] | None = None,
                after: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Read ``len(out)`` bytes at ``offset`` into ``out``, block by block on the pool's
    threads, each block hashed right after it lands; returns the block hashes. ``before(start,
    stop)`` and ``after(start, stop)``, when given, run on the same thread just before bytes
    ``[start, stop)`` of ``out`` are overwritten and just after they are hashed (a load keeps
    its undo copy of them, and checks their values, while they are in the cache)."""

    def one(block):
        k, start, size = block
        if size <= READ_PIECE:
            pieces = [(start, start + size)]
        else:  # a block in pieces that stay in the core's cache while they are worked on
            pieces = [(low, min(start + size, low + READ_PIECE))
                      for low in range(start, start + size, READ_PIECE)]
        hasher = block_hasher()
        for low, high in pieces:
            view = out[low:high]
            if before is not None:
                before(low, high)
            reader.readinto(view, offset + low)
            hasher.update(view)
            if after is not None:
                after(low, high)
        return hasher.intdigest()

    blocks = _blocks(len(out))
    hashes = workers.map(one, blocks) if reader.parallel else [one(b) for b in blocks]
    return np.array(hashes, dtype=np.uint64)


def write_hashed(fd: int, offset: int, data: memoryview, workers: pool) -> np.ndarray:
    """Write ``data`` at ``offset``, block by block on the pool's threads, each block hashed
    just before it is copied out (while it is in the cache); returns the block hashes."""

    def one(block):
        k, start, size = block
        view = data[start:start + size]
        value = hash_block(view)
        pwrite_all(fd, view, offset + start)
        return value

    return np.array(workers.map(one, _blocks(len(data))), dtype=np.uint64)


# ----------------------------------------------------------------------------- opening
def open_file(source) -> tuple[h5py.File, str, int, RawReader]:
    """Open a checkpoint read-only: a path, bytes, or a binary file object. Returns the HDF5
    file, its name, its size and the reader of its raw bytes (the same file, whatever happens
    to the path meanwhile)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = bytes(source)
        if not source.startswith(SIGNATURE):  # a path given as bytes, most likely
            raise CheckpointCorrupt(f"in-memory checkpoint {source[:80]!r} ({len(source)} "
                                    f"bytes) is not a valid flatopt checkpoint: not an HDF5 "
                                    f"file; {BYTES_HINT}")
        source = io.BytesIO(source)
    if hasattr(source, "read") and hasattr(source, "seek"):
        file, name, size = _open_object(source)
        fd = None
        if not isinstance(source, io.BytesIO):
            try:
                fd = source.fileno()
            except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
                fd = None
        return file, name, size, raw_reader(source, fd)
    name = file_name(source, "a checkpoint is a path, bytes or a binary file object")
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {name}: the file does not exist",
                              path=name) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {name!r}: {exc}", path=name) from exc
    if not os.path.isfile(name):
        raise CheckpointError(f"cannot read checkpoint {name}: not a regular file", path=name)
    file, name, _ = _h5_open(name, name, st.st_size)
    try:
        fd = file.id.get_vfd_handle()
        size = os.fstat(fd).st_size  # the file HDF5 opened, not whatever the path is now
        raw = raw_reader(None, fd)
        head = bytearray(min(size, len(SIGNATURE) + 1))
        raw.readinto(memoryview(head), 0)
        _check_container(bytes(head), name)  # that file's, before HDF5 walks its metadata
    except CheckpointError:
        file.close()
        raise
    except Exception as exc:
        file.close()
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    return file, name, size, raw


def _open_object(source) -> tuple[h5py.File, str, int]:
    name = str(getattr(source, "name", "<in-memory checkpoint>"))
    if isinstance(source, io.TextIOBase) or "b" not in getattr(source, "mode", "b"):
        raise CheckpointError(f"cannot read checkpoint {name}: it was opened in text mode; "
                              "open it with open(path, 'rb')", path=name)
    try:
        source.seek(0, os.SEEK_END)
        size = source.tell()
        source.seek(0)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    return _h5_open(source, name, size)


def _head(target, nbytes: int) -> bytes:
    """The first bytes of a path or a binary file object (left at its start)."""
    if isinstance(target, str):
        with open(target, "rb") as handle:
            return handle.read(nbytes)
    target.seek(0)
    head = target.read(nbytes)
    target.seek(0)
    return head


def _check_container(head: bytes, name: str) -> None:
    """CheckpointCorrupt unless the HDF5 container starting with ``head`` is one flatopt
    reads. HDF5 checksums the metadata of superblock versions 2 and 3 only: in a version 0 or
    1 file a damaged B-tree node (one naming itself as its child) reaches the library
    unchecked and can crash or hang it, so such a file is refused before HDF5 walks it."""
    if not head.startswith(SIGNATURE) or len(head) <= len(SIGNATURE):
        return  # HDF5's own message says what it is not
    version = head[len(SIGNATURE)]
    if version not in SUPERBLOCKS:
        checksums = "has no checksums" if version in (0, 1) else "is unknown"
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt "
                                f"checkpoint: its HDF5 superblock version {version} {checksums}:"
                                " flatopt writes superblock version 3 (checksummed metadata) "
                                "and reads versions 2 and 3 only", path=name)


def _h5_open(target, name: str, size: int) -> tuple[h5py.File, str, int]:
    if size < 8:
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt checkpoint:"
                                f" it is {size} bytes long, not an HDF5 file", path=name)
    try:
        head = _head(target, len(SIGNATURE) + 1)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    _check_container(head, name)
    try:
        return h5py.File(target, "r"), name, size
    except BlockingIOError as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: it is locked by another process "
                              f"that is writing it ({exc})", path=name) from exc
    except PermissionError as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc}", path=name) from exc
    except Exception as exc:
        text = str(exc)
        if "signature not found" in text:
            why = "not an HDF5 file"
        elif "truncated file" in text:
            why = "truncated (incomplete copy or interrupted write)"
        elif "already open for write" in text:
            why = ("it was never closed by its writer (a crashed save; a file flatopt saved "
                   "would have been renamed into place only when complete; h5clear -s clears "
                   "the flag, but the data may be incomplete)")
        else:
            why = "the HDF5 library cannot open it"
        raise CheckpointCorrupt(f"checkpoint {name} is damaged or not a valid flatopt checkpoint:"
                                f" {why} ({type(exc).__name__}: {text})", path=name) from exc
