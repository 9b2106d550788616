"""Atomic file handling: a temporary file beside the target, space reserved up front, fsync,
rename, directory fsync; stale temporary files of killed savers removed."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from typing import Callable

from ..errors import CheckpointError

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")
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
        if (len(head) < 48 or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (2, 3)
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
        match = _TEMP.match(entry)
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
        try:
            os.unlink(os.path.join(directory, entry))
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


def target_path(path) -> str:
    """The absolute target of a save, checked: a str or PathLike to a file in an existing
    directory."""
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
    if os.path.isdir(final):
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
