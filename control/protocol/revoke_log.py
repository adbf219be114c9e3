"""Entries of the durable revocation log (a RabbitMQ stream; ``topology.revocation_log``).

A revoke written here holds even when no worker is running: every worker reads the log from its
start when it connects, and follows it while it runs. An entry revokes task ids, or stamps
(``revoke_by_stamped_headers``): then its ``task_ids`` is empty, which a worker that knows no
stamps reads as a revoke of nothing. The control client writes an entry (with a
publisher confirm) before it broadcasts the revoke; a worker journals the revokes it receives by
broadcast only, such as ``celery control revoke``, unless the request says it was logged already.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.wire.task.stamps import revoke_headers

__all__ = ["LOGGED_HEADER", "MAX_ENTRY_BYTES", "MAX_IDS_PER_ENTRY", "RevokeEntry"]

# Set on a broadcast revoke whose entry is already in the log, so workers do not journal it again.
LOGGED_HEADER: Final = "x-clockwork-logged"
MAX_IDS_PER_ENTRY: Final = 10_000
MAX_ENTRY_BYTES: Final = 1024 * 1024
_MAX_ID: Final = 256
CONTENT_TYPE: Final = "application/json"


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeEntry:
    """One revoke: which ids (or stamps), whether running ones are killed (and with what), and when."""

    task_ids: tuple[str, ...]
    terminate: bool = False
    signal: str = "SIGTERM"
    timestamp: float = 0.0
    hostname: str = ""
    # Stamp name -> the values revoked (``broker_svc.wire.task.stamps.revoke_headers``); None: ids only.
    stamps: Mapping[str, list[Any]] | None = None

    @classmethod
    def new(
        cls,
        task_ids: str | Sequence[str],
        *,
        terminate: bool = False,
        signal: str = "SIGTERM",
        hostname: str = "",
    ) -> RevokeEntry:
        """An entry stamped now.

        Raises:
            ValueError: no ids, too many, or an id that is not a short non-empty string.
        """
        ids = (task_ids,) if isinstance(task_ids, str) else tuple(task_ids)
        if not ids or len(ids) > MAX_IDS_PER_ENTRY:
            raise ValueError(f"a revoke needs 1 to {MAX_IDS_PER_ENTRY} task ids, got {len(ids)}")
        for task_id in ids:
            if not isinstance(task_id, str) or not task_id or len(task_id) > _MAX_ID:
                raise ValueError(
                    f"task ids are non-empty strings of at most {_MAX_ID} characters: {task_id!r}"
                )
        return cls(task_ids=ids, terminate=terminate, signal=signal, timestamp=time.time(), hostname=hostname)

    @classmethod
    def stamped(
        cls, headers: Any, *, terminate: bool = False, signal: str = "SIGTERM", hostname: str = ""
    ) -> RevokeEntry:
        """An entry revoking stamps (Celery's ``revoke_by_stamped_headers`` ``headers``), stamped now.

        Raises:
            ValueError: ``headers`` names no stamp, or is not what ``revoke_headers`` takes.
        """
        stamps = revoke_headers(headers)
        if not stamps:
            raise ValueError("a revoke by stamps needs at least one stamp")
        return cls(
            task_ids=(), terminate=terminate, signal=signal, timestamp=time.time(), hostname=hostname,
            stamps=stamps,
        )  # fmt: skip

    def encode(self) -> bytes:
        """The JSON body of the log message."""
        body: dict[str, Any] = {
            "task_ids": list(self.task_ids),
            "terminate": self.terminate,
            "signal": self.signal,
            "timestamp": self.timestamp,
            "hostname": self.hostname,
        }
        if self.stamps is not None:
            body["stamps"] = dict(self.stamps)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> RevokeEntry:
        """Parse a log message body; ids that are not short strings are dropped.

        Raises:
            MessageError: the body is not a JSON map with a list of ids.
        """
        if len(body) > MAX_ENTRY_BYTES:
            raise MessageError(f"revocation entry of {len(body)} bytes is over {MAX_ENTRY_BYTES}")
        try:
            data: Any = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MessageError(f"revocation entry is not JSON: {exc}") from exc
        if not isinstance(data, Mapping) or not isinstance(data.get("task_ids"), list):
            raise MessageError("revocation entry must be a map with a task_ids list")
        ids = tuple(t for t in data["task_ids"] if isinstance(t, str) and 0 < len(t) <= _MAX_ID)
        timestamp = data.get("timestamp")
        signal = data.get("signal")
        hostname = data.get("hostname")
        stamps = None
        if data.get("stamps") is not None:
            try:
                stamps = revoke_headers(data["stamps"])
            except ValueError as exc:
                raise MessageError(f"revocation entry's stamps: {exc}") from exc
        return cls(
            task_ids=ids[:MAX_IDS_PER_ENTRY],
            terminate=data.get("terminate") is True,
            signal=signal if isinstance(signal, str) and len(signal) <= 16 else "SIGTERM",
            timestamp=float(timestamp)
            if isinstance(timestamp, int | float) and not isinstance(timestamp, bool)
            else 0.0,
            hostname=hostname if isinstance(hostname, str) else "",
            stamps=stamps,
        )


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
