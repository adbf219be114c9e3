"""Per-worker rate limits shared by its consuming children: one token bucket per task, in shared memory.

The same bucket as ``worker/rules/rate_limits.py`` (capacity 1, kept as the time its next token
is due), but every child of the worker takes tokens from it, so ``rate_limit="10/s"`` means ten a
second per worker, as in Celery, not per child. Each registered task has 16 bytes of a memory-mapped
file: its rate (tokens per second, 0: no limit) and the monotonic time of its next free token (the
same clock in every process of the machine). Taking a token holds an advisory file lock; the worker
changes a rate (the ``rate_limit`` command) the same way, and every child sees it at once.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from worker.shared.shared_file import SharedFile

__all__ = ["SharedRates"]

_SLOT: Final = struct.Struct("<dd")  # tokens per second (0: none), next free token (monotonic s)
_RATE: Final = struct.Struct("<d")


class SharedRates:
    """Token buckets by task name; the worker creates the file, each child attaches to it.

    Args:
        path: the file.
        names: every task name the buckets are for, in the same order in every process.
        owner: remove the file on ``close`` (the worker's copy).
    """

    def __init__(self, path: Path, names: Sequence[str], *, owner: bool) -> None:
        self.path = path
        self._index = {name: i for i, name in enumerate(names)}
        self._file = SharedFile(path, owner=owner)
        self._map = self._file.map
        self._locked = self._file.locked

    @classmethod
    def create(cls, names: Sequence[str], rates: Mapping[str, float]) -> SharedRates:
        """Full buckets for ``names`` with the limits ``rates`` (per second), in shared memory."""
        # Zeroed: no limit, every token free now.
        path = SharedFile.create("clockwork-rates-", max(len(names), 1) * _SLOT.size)
        shared = cls(path, names, owner=True)
        for name, per_second in rates.items():
            shared.set(name, per_second)
        return shared

    def rate(self, task_name: str) -> float | None:
        """The limit of ``task_name`` in tokens per second, None when it has none."""
        index = self._index.get(task_name)
        if index is None:
            return None
        (per_second,) = _RATE.unpack_from(self._map, index * _SLOT.size)
        return per_second or None

    def set(self, task_name: str, per_second: float | None) -> None:
        """Limit ``task_name`` to ``per_second`` tokens (None or 0: no limit); a name not known is ignored."""
        index = self._index.get(task_name)
        if index is None:
            return
        with self._locked():
            _RATE.pack_into(self._map, index * _SLOT.size, per_second or 0.0)

    def reserve(self, task_name: str) -> float:
        """Take one token of ``task_name`` now; the seconds until it is due (0.0: start now)."""
        index = self._index.get(task_name)
        if index is None or not self.rate(task_name):  # the common case: no limit, no lock
            return 0.0
        with self._locked():
            per_second, next_free = _SLOT.unpack_from(self._map, index * _SLOT.size)
            if not per_second:
                return 0.0
            now = time.monotonic()
            start = next_free if next_free > now else now
            _SLOT.pack_into(self._map, index * _SLOT.size, per_second, start + 1.0 / per_second)
        return start - now

    def close(self) -> None:
        """Unmap; the worker also removes the file."""
        self._file.close()
