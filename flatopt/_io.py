"""Positional file writes shared by checkpoint saves and a load's spilled undo copy."""

from __future__ import annotations

import errno
import os
import threading

_WRITE_LOCK = threading.Lock()  # lseek + write, where there is no pwrite (Windows)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` written at ``offset`` of ``fd`` (positional: several threads may
    write one file at once)."""
    done = 0
    while done < len(view):
        if hasattr(os, "pwrite"):
            got = os.pwrite(fd, view[done:], offset + done)
        else:  # Windows: no positional writes
            with _WRITE_LOCK:
                os.lseek(fd, offset + done, os.SEEK_SET)
                got = os.write(fd, view[done:])
        if got <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += got
