"""Which spool a process owns: slot directories under ``spool_dir``, each held by an flock.

Several processes of one service (a web server's workers) may share ``spool_dir``: each takes the
lowest slot (``slot-0``, ``slot-1``, ...) no live process holds. The lock is an ``flock`` on the
slot's ``lock`` file, so the kernel drops it when its process dies, however it dies; the next
process to start takes that slot and replays what it holds. Two live processes never hold the same
slot, so never drain the same file.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from broker_svc.errors import SpoolError

__all__ = ["MAX_SLOTS", "Slot", "claim_slot", "try_slot"]

MAX_SLOTS: Final = 256


@dataclass
class Slot:
    """A slot directory this process holds, and the open lock file that holds it."""

    path: Path
    fd: int
    pid: int

    def release(self) -> None:
        """Let another process take the slot (closing the file drops the lock)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def try_slot(path: Path) -> Slot | None:
    """Hold the slot at ``path`` (made if missing), or None if a live process holds it.

    Raises:
        OSError: the directory cannot be made or its lock file opened.
    """
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    pid = os.getpid()
    try:  # who holds it, for a person looking; the lock, not this text, is what counts
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{pid}\n".encode(), 0)
    except OSError:
        pass
    return Slot(path, fd, pid)


def claim_slot(root: Path) -> Slot:
    """The lowest free slot under ``root`` (``spool_dir``), held until released or the process ends.

    Raises:
        SpoolError: ``root`` cannot be used, or every slot is held by a live process.
    """
    try:
        for index in range(MAX_SLOTS):
            slot = try_slot(root / f"slot-{index}")
            if slot is not None:
                return slot
    except OSError as exc:
        raise SpoolError(f"cannot use spool_dir {str(root)!r}: {exc}") from exc
    raise SpoolError(f"all {MAX_SLOTS} slots of spool_dir {str(root)!r} are held by live processes")
