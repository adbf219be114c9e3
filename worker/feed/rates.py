"""Per-worker rate limits shared by its consuming children: one token bucket per task, in shared memory.

The same bucket as ``worker/consume/rate_limits.py`` (capacity 1, kept as the time its next token
is due), but every child of the worker takes tokens from it, so ``rate_limit="10/s"`` means ten a
second per worker, as in Celery, not per child. Each bucket is 8 bytes of a memory-mapped file (the
monotonic time of its next free token, the same clock in every process of the machine), taken
under an advisory file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = ["SharedRates"]

_SLOT: Final = struct.Struct("<d")


class SharedRates:
    """Token buckets by task name; the worker creates the file, each child attaches to it.

    Args:
        path: the file.
        rates: tokens per second by task name (every process passes the same).
        owner: remove the file on ``close`` (the worker's copy).
    """

    def __init__(self, path: Path, rates: Mapping[str, float], *, owner: bool) -> None:
        self.path = path
        self._rates = dict(rates)
        self._index = {name: i for i, name in enumerate(sorted(rates))}
        self._owner = owner
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, max(len(rates), 1) * _SLOT.size)

    @classmethod
    def create(cls, rates: Mapping[str, float]) -> SharedRates:
        """Full buckets for ``rates``, in shared memory (``/dev/shm`` where there is one)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="clockwork-rates-", dir=folder)
        with os.fdopen(fd, "wb") as file:
            file.truncate(max(len(rates), 1) * _SLOT.size)  # zero: every token is free now
        return cls(Path(name), rates, owner=True)

    def limited(self, task_name: str) -> bool:
        """Whether ``task_name`` has a limit."""
        return task_name in self._index

    def reserve(self, task_name: str) -> float:
        """Take one token of ``task_name`` now; the seconds until it is due (0.0: start now)."""
        index = self._index.get(task_name)
        if index is None:
            return 0.0
        interval = 1.0 / self._rates[task_name]
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            (next_free,) = _SLOT.unpack_from(self._map, index * _SLOT.size)
            start = next_free if next_free > now else now
            _SLOT.pack_into(self._map, index * _SLOT.size, start + interval)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return start - now

    def close(self) -> None:
        """Unmap; the worker also removes the file."""
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
