"""One daemon per state directory: an exclusive flock on ``state_dir/gemmd.lock``."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from gemmd.errors import StoreError

# The store's log lines keep the logger name they had as one module (tests filter on it).
logger = logging.getLogger("gemmd.store")

LOCK_NAME = "gemmd.lock"


class InstanceLock:
    """One daemon per state directory (as Prometheus's TSDB lock): an exclusive flock on
    ``state_dir/gemmd.lock`` while the daemon runs. Two daemons on one directory both
    wrote rows for the same GPUs (issue 24). The kernel drops the lock when the process
    ends however it ends (no stale lock after SIGKILL); the file says who holds it.
    One-shot commands (probe, import, status) take no lock: SQLite serializes them."""

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> InstanceLock:
        """Take the lock; StoreError naming the holder if another process has it. A
        directory that cannot be created or written is left for the store to explain."""
        import fcntl
        import socket

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("state_dir %s: cannot lock %s (%s): make sure no other gemmd "
                               "runs on it", self.path.parent, self.path.name,
                               e.strerror or e)
                return self
            raise StoreError(f"state_dir {self.path.parent} is in use by another gemmd "
                             f"({holder or 'its lock file names no process'}): one daemon "
                             "per state directory; stop that one or give this one its own "
                             "state_dir") from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
                  .encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the file stays: removing it would race a new daemon
            self._fd = None
