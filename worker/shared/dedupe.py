"""A worker's dedupe window shared by its consuming children: recent task ids, in shared memory.

``--dedupe-window``: a key ``(task id, retries)`` running in the worker, or finished within the
window, is a duplicate. It holds for every child of the worker at once, since a copy
published twice, or redelivered after a lost ack or a lost connection, may reach any of them.

The table is a memory-mapped file of buckets of 16 entries; an entry is the 16-byte digest of a key,
the pid and thread id of the child thread running it (0: finished; with ``--threads`` a child runs
several) and when a finished entry expires (monotonic seconds, one clock for every process of the
machine). A key lives in the bucket its digest names; a full
bucket gives up its oldest finished entry, so memory is fixed (``max_ids`` entries of 32 bytes) and
an id is forgotten before its window ends only when its bucket sees more than 16 ids within it.
Reading and writing a bucket holds an advisory file lock, as ``worker/shared/rates.py`` does.

An entry whose child is gone (exited, or a zombie not reaped yet) counts for nothing: the copy the
broker redelivers after a child died in the middle of a task runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from worker.shared.shared_file import SharedFile, pid_alive

__all__ = ["Claim", "SharedDedupe"]

WAYS: Final = 16  # entries per bucket
# Key digest, pid and thread id running it (0: finished), expires (monotonic s).
_ENTRY: Final = struct.Struct("<16sIId")
_BUCKET_BYTES: Final = WAYS * _ENTRY.size
_EMPTY: Final = bytes(16)


@dataclass(frozen=True, slots=True)
class Claim:
    """A key this process runs: where its entry is, to finish or release it.

    Attributes:
        digest: the key's digest.
        offset: its entry's place in the table; None when its bucket had no room (it runs unrecorded).
        thread: the native id of the thread that claimed it (its release may come from another).
    """

    digest: bytes
    offset: int | None
    thread: int = 0


class SharedDedupe:
    """The table; the worker creates it (``create``), each consuming child attaches to it by path.

    Args:
        path: the file.
        ttl_s: how long a finished key is remembered.
        owner: remove the file on ``close`` (the worker's copy).

    Raises:
        ValueError: a non-positive ``ttl_s``, or a file that holds no bucket.
    """

    def __init__(self, path: Path, *, ttl_s: float, owner: bool) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.path = path
        self.ttl_s = ttl_s
        self._pid = os.getpid()
        self._file = SharedFile(path, owner=owner)
        self.buckets = self._file.size // _BUCKET_BYTES
        if self.buckets < 1:
            self._file.close()
            raise ValueError(f"{path} holds no dedupe bucket ({self._file.size} bytes)")
        self._map = self._file.map
        self._locked = self._file.locked

    @classmethod
    def create(cls, *, ttl_s: float, max_ids: int = 100_000, kind: str = "dedupe") -> SharedDedupe:
        """An empty table for at most ``max_ids`` keys, in shared memory (``/dev/shm`` where there is one).

        Raises:
            ValueError: a non-positive ``ttl_s`` or ``max_ids``.
        """
        if max_ids < 1:
            raise ValueError(f"max_ids must be positive, got {max_ids}")
        # Zeroed: every entry empty.
        path = SharedFile.create(f"clockwork-{kind}-", math.ceil(max_ids / WAYS) * _BUCKET_BYTES)
        try:
            return cls(path, ttl_s=ttl_s, owner=True)
        except BaseException:
            os.unlink(path)
            raise

    def claim(self, task_id: str, retries: int, *, now: float | None = None) -> Claim | None:
        """Record ``(task_id, retries)`` as running in this process; None if it is a duplicate.

        A duplicate is a key another thread runs in a live process (this one included), or one
        finished within the window. Pair a claim with :meth:`release`.
        """
        digest, thread = _digest(task_id, retries), threading.get_native_id()
        base = int.from_bytes(digest[:8], "little") % self.buckets * _BUCKET_BYTES
        now = time.monotonic() if now is None else now
        with self._locked():
            bucket = self._map[base : base + _BUCKET_BYTES]
            at = _find(bucket, digest)
            if at is not None:
                _, pid, tid, expires = _ENTRY.unpack_from(bucket, at)
                if pid and (pid, tid) != (self._pid, thread) and pid_alive(pid):
                    return None
                if not pid and expires > now:
                    return None
                # Its child is gone, or its window is over (or a claim of this thread's was never
                # released): it runs again, here.
            else:
                at = _room(bucket, now)
                if at is None:  # every entry runs in a live child (at most 16 in one bucket)
                    return Claim(digest, None, thread)
            _ENTRY.pack_into(self._map, base + at, digest, self._pid, thread, 0.0)
        return Claim(digest, base + at, thread)

    def state(self, task_id: str, retries: int, *, now: float | None = None) -> str | None:
        """``"running"`` (in a live process), ``"finished"`` (within the window) or None: unknown here."""
        digest = _digest(task_id, retries)
        base = int.from_bytes(digest[:8], "little") % self.buckets * _BUCKET_BYTES
        now = time.monotonic() if now is None else now
        with self._locked():
            bucket = self._map[base : base + _BUCKET_BYTES]
        at = _find(bucket, digest)
        if at is None:
            return None
        _, pid, _, expires = _ENTRY.unpack_from(bucket, at)
        if pid:
            return "running" if pid_alive(pid) else None
        return "finished" if expires > now else None

    def release(self, claim: Claim, *, finished: bool, now: float | None = None) -> None:
        """The delivery of ``claim`` is settled: remembered for the window if ``finished``, else forgotten."""
        if claim.offset is None:
            return
        now = time.monotonic() if now is None else now
        with self._locked():
            digest, pid, tid, _ = _ENTRY.unpack_from(self._map, claim.offset)
            if (digest, pid, tid) != (claim.digest, self._pid, claim.thread):
                return  # taken over by a process that thought this one gone: the entry is its own
            if finished:
                _ENTRY.pack_into(self._map, claim.offset, digest, 0, 0, now + self.ttl_s)
            else:
                _ENTRY.pack_into(self._map, claim.offset, _EMPTY, 0, 0, 0.0)

    def close(self) -> None:
        """Unmap; the worker also removes the file."""
        self._file.close()


def _digest(task_id: str, retries: int) -> bytes:
    # 128 bits: two keys of one worker's window never share a digest in practice.
    key = f"{retries}:{task_id}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=16).digest()


def _find(bucket: bytes, digest: bytes) -> int | None:
    # The entry holding ``digest``: a search of the bucket's bytes, kept only where an entry starts.
    at = bucket.find(digest)
    while at != -1:
        if at % _ENTRY.size == 0:
            return at
        at = bucket.find(digest, at + 1)
    return None


def _room(bucket: bytes, now: float) -> int | None:
    # Where a new key goes: an empty or expired entry, else the oldest finished one, else one whose
    # child is gone; None if every entry runs in a live child.
    oldest: tuple[float, int] | None = None
    running: list[tuple[int, int]] = []
    for at in range(0, _BUCKET_BYTES, _ENTRY.size):
        _, pid, _, expires = _ENTRY.unpack_from(bucket, at)
        if pid:
            running.append((pid, at))
        elif expires <= now:
            return at
        elif oldest is None or expires < oldest[0]:
            oldest = (expires, at)
    if oldest is not None:
        return oldest[1]
    return next((at for pid, at in running if not pid_alive(pid)), None)
