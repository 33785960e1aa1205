"""One process at a time owns a node's data directory.

The replica holds an exclusive ``flock`` on ``DIR/replica.lock`` for as long as it runs;
the offline store tools (``squall store mark-clean`` / ``mark-dirty``) take the same lock,
so they refuse to change a store a running replica has open, and a second replica pointed
at the same directory refuses to start. The kernel drops the lock when the process dies,
kill -9 included, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE_NAME = "replica.lock"


class DataDirBusy(Exception):
    """Another process holds the data directory; the message names it."""


class DataDirLock:
    """An exclusive lock on a data directory (release it, or use it as a context manager)."""

    def __init__(self, data_dir: Path) -> None:
        """Takes the lock without waiting; raises DataDirBusy if another process holds it."""
        self.path = data_dir / LOCK_FILE_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(self._fd)
            os.close(self._fd)
            who = f"process {holder}" if holder else "another process"
            raise DataDirBusy(
                f"{data_dir} is in use by {who} (it holds {self.path}): stop that node's "
                "replica first"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        """Drops the lock; safe to call twice."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def is_locked(data_dir: Path) -> bool:
    """True if a process holds the data directory now (a running replica)."""
    path = data_dir / LOCK_FILE_NAME
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _read_pid(fd: int) -> str:
    """The PID the holder wrote into the lock file, if it is readable."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""
