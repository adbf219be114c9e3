"""The revoked set: a LimitedSet of task ids (Celery's semantics and wire shape), kept on disk."""

from __future__ import annotations

import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import msgpack
import structlog

from broker_svc.wire.codec import refuse_ext

__all__ = ["RevokedSet"]

log = structlog.get_logger(__name__)

MAXLEN: Final = 50_000
EXPIRES_S: Final = 10_800.0
_MAX_ID: Final = 256


class RevokedSet:
    """Revoked task ids, at most ``maxlen``, each forgotten ``expires_s`` after it was added.

    Insertion times are this process's ``time.monotonic()``, as in Celery's ``hello`` payload; on
    disk they are wall-clock, so a restarted worker can tell what has expired meanwhile.
    """

    def __init__(self, *, maxlen: int = MAXLEN, expires_s: float = EXPIRES_S) -> None:
        self._maxlen = maxlen
        self._expires_s = expires_s
        self._entries: OrderedDict[str, float] = OrderedDict()

    @property
    def expires_s(self) -> float:
        """How long an id stays revoked."""
        return self._expires_s

    def __contains__(self, task_id: object) -> bool:
        if not isinstance(task_id, str):
            return False
        added = self._entries.get(task_id)
        if added is None:
            return False
        if time.monotonic() - added > self._expires_s:
            del self._entries[task_id]
            return False
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        self.purge()
        return iter(list(self._entries))

    def add(self, task_id: str, *, at: float | None = None) -> None:
        """Revoke ``task_id`` (again: its clock restarts)."""
        if not isinstance(task_id, str) or not task_id or len(task_id) > _MAX_ID:
            return
        self._entries.pop(task_id, None)
        self._entries[task_id] = time.monotonic() if at is None else at
        while len(self._entries) > self._maxlen:
            self._entries.popitem(last=False)

    def update(self, task_ids: Iterable[str]) -> None:
        """Revoke many ids."""
        for task_id in task_ids:
            self.add(task_id)

    def purge(self) -> None:
        """Drop expired entries."""
        cutoff = time.monotonic() - self._expires_s
        while self._entries:
            task_id, added = next(iter(self._entries.items()))
            if added >= cutoff:
                break
            del self._entries[task_id]

    # -- wire (Mingle's hello) ---------------------------------------------------------------------

    def to_wire(self, limit: int | None = None) -> dict[str, list[Any]]:
        """Celery's LimitedSet data: ``{task_id: [insertion_time, task_id]}``, newest last.

        ``limit`` keeps only the newest entries, to bound a reply's size.
        """
        self.purge()
        items = list(self._entries.items())
        if limit is not None:
            items = items[-limit:]
        return {task_id: [float(added), task_id] for task_id, added in items}

    def merge_wire(self, data: Any) -> int:
        """Merge a peer's revoked ids; malformed entries are skipped.

        Celery 5.6 sends its LimitedSet data (``{id: [time, id]}``), Celery 5.7 a list of ids,
        oldest first; both are taken. A peer's times are its own monotonic clock, not ours, so
        merged ids count as added now.

        Returns:
            How many ids were new here.
        """
        if isinstance(data, list):
            pairs: list[tuple[Any, Any]] = [(task_id, 0.0) for task_id in data]
        elif isinstance(data, Mapping):
            pairs = list(data.items())
        else:
            return 0
        added = 0
        now = time.monotonic()
        for task_id, value in pairs[-self._maxlen :]:
            if not isinstance(task_id, str) or not _is_entry(value):
                continue
            if task_id not in self._entries:
                added += 1
            self.add(task_id, at=now)
        return added

    # -- disk --------------------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the set atomically (temp file + rename), with wall-clock times."""
        self.purge()
        offset = time.time() - time.monotonic()
        payload = msgpack.packb(
            {"version": 1, "entries": [[k, v + offset] for k, v in self._entries.items()]}
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(payload)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, path: Path) -> int:
        """Read a saved set; a missing or damaged file is logged and leaves the set as it was.

        Returns:
            How many unexpired ids were loaded.
        """
        try:
            data = msgpack.unpackb(path.read_bytes(), raw=False, ext_hook=refuse_ext)
            entries = data["entries"]
        except FileNotFoundError:
            return 0
        except Exception as exc:  # a damaged state file must not stop the worker
            log.warning("revoked_state_unreadable", path=str(path), error=str(exc))
            return 0
        offset = time.time() - time.monotonic()
        loaded = 0
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int | float):
                self.add(str(entry[0]), at=float(entry[1]) - offset)
                loaded += 1
        self.purge()
        return min(loaded, len(self._entries))


def _is_entry(value: Any) -> bool:
    # Celery refuses an int timestamp (ValueError); we accept [number, id] or a bare number.
    if isinstance(value, list | tuple) and value:
        value = value[0]
    return isinstance(value, int | float) and not isinstance(value, bool)
