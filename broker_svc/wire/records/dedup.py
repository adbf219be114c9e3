"""Keyed deduplication on the wire: the gate's headers, its shard of a key, its own messages.

Pure. A task sent with a dedup key goes to a gate shard queue (``topology.dedup_gate_queue``)
instead of its own, with the headers below; the worker that is the shard's single active consumer
(``worker/single_active/gate_shard.py``) decides, per key, to send it on (``accept``), hold it (``block``)
or answer it ``DECLINED`` (docs/architecture.md, "Deduplication under faults"). Three kinds of
message of the gate's own travel in the same queue, each an empty body with headers:

- a **head** marker, published by the gate in the transaction that sends a task on: while the gate
  holds it unacked, the key has a running head; a gate that takes over learns the heads from them;
- a **release**, published by the worker that ran the head once its delivery is settled for good;
- a **sync** marker, published by a gate to itself when it becomes active: what it receives before
  its marker comes back is what the previous gate left, replayed in a safe order. A worker also
  publishes one with a token nobody waits for (a ping) to wake a shard's active gate: one that
  had no delivery yet learns from it that it is active; the others ack it.
"""

from __future__ import annotations

import datetime as dt
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from broker_svc.wire.records.task_state import TARGET_QUEUE_HEADER

__all__ = [
    "DEADLINE_HEADER",
    "DEFAULT_DEDUP_TIMEOUT_S",
    "FORWARDED_HEADER",
    "GATE_SHARDS",
    "KEY_HEADER",
    "KIND_HEADER",
    "MAX_DEDUP_TIMEOUT_S",
    "TARGET_QUEUE_HEADER",
    "TASK_HEADER",
    "TIMEOUT_HEADER",
    "TOKEN_HEADER",
    "GateMessage",
    "deadline_header",
    "dedup_headers",
    "eta_wait_s",
    "gate_headers",
    "gate_message",
    "head_deadline",
    "release_of",
    "shard_of",
]

KEY_HEADER: Final = "x-clockwork-dedup-key"
TIMEOUT_HEADER: Final = "x-clockwork-dedup-timeout"  # seconds, from the task or the call
# Epoch milliseconds as an integer, stamped by the gate: AMQP clients send a float header as 32 bits
# (pamqp), which would round an epoch to 128 s.
DEADLINE_HEADER: Final = "x-clockwork-dedup-deadline"
KIND_HEADER: Final = "x-clockwork-dedup-kind"
TASK_HEADER: Final = "x-clockwork-dedup-task"
TOKEN_HEADER: Final = "x-clockwork-dedup-token"
# Set by a worker that sent a task to its gate for a sender that did not (a Celery client): its
# caller may not know ``DECLINED``, so a decline answers it ``REVOKED``.
FORWARDED_HEADER: Final = "x-clockwork-dedup-forwarded"

# Every producer and worker must hash a key onto the same shard, so the count is fixed.
GATE_SHARDS: Final = 8
# The safety timeout bounds how long the gate holds a head marker and a waiting task unacked; the
# broker closes a channel that holds a delivery past its consumer_timeout (30 min by default).
MAX_DEDUP_TIMEOUT_S: Final = 1500.0
DEFAULT_DEDUP_TIMEOUT_S: Final = 600.0

Kind = Literal["head", "release", "sync"]
_KINDS: Final = frozenset({"head", "release", "sync"})


def shard_of(key: str) -> int:
    """The gate shard that owns ``key`` (the same on every host and Python version)."""
    return zlib.crc32(key.encode()) % GATE_SHARDS


def dedup_headers(key: str, timeout_s: float, target_queue: str) -> dict[str, Any]:
    """The headers a task carries to its gate: its key, safety timeout (whole seconds, rounded up:
    a float header travels as 32 bits) and destination queue."""
    return {KEY_HEADER: key, TIMEOUT_HEADER: math.ceil(timeout_s), TARGET_QUEUE_HEADER: target_queue}


@dataclass(frozen=True, slots=True)
class GateMessage:
    """One of the gate's own messages (see the module docstring)."""

    kind: Kind
    key: str = ""
    task_id: str = ""
    deadline: float = 0.0
    token: str = ""


def gate_headers(message: GateMessage) -> dict[str, Any]:
    """``message`` as the headers of an empty-bodied AMQP message."""
    headers: dict[str, Any] = {KIND_HEADER: message.kind}
    if message.key:
        headers[KEY_HEADER] = message.key
    if message.task_id:
        headers[TASK_HEADER] = message.task_id
    if message.deadline:
        headers[DEADLINE_HEADER] = deadline_header(message.deadline)
    if message.token:
        headers[TOKEN_HEADER] = message.token
    return headers


def gate_message(headers: Mapping[str, Any] | None) -> GateMessage | None:
    """The gate message these headers carry; None for a task (an arrival) or a malformed one."""
    kind = (headers or {}).get(KIND_HEADER)
    if kind not in _KINDS:
        return None
    assert headers is not None
    key, task_id = headers.get(KEY_HEADER, ""), headers.get(TASK_HEADER, "")
    deadline_ms, token = headers.get(DEADLINE_HEADER, 0), headers.get(TOKEN_HEADER, "")
    if not isinstance(key, str) or not isinstance(task_id, str) or not isinstance(token, str):
        return None
    if not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool):
        return None
    return GateMessage(kind=kind, key=key, task_id=task_id, deadline=deadline_ms / 1000, token=token)


def deadline_header(deadline: float) -> int:
    """A deadline (epoch seconds) as the header's integer milliseconds."""
    return round(deadline * 1000)


def eta_wait_s(headers: Mapping[str, Any]) -> float:
    """Seconds until a task message's ETA (protocol 2's ``eta`` header); 0 when none or past."""
    eta = headers.get("eta")
    if not isinstance(eta, str):
        return 0.0
    try:
        when = dt.datetime.fromisoformat(eta)
    except ValueError:
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds())


def head_deadline(headers: Mapping[str, Any]) -> float | None:
    """The deadline the gate stamped on a task it sent on (epoch seconds); None if it did not."""
    deadline_ms = headers.get(DEADLINE_HEADER)
    if (
        isinstance(deadline_ms, int)
        and not isinstance(deadline_ms, bool)
        and isinstance(headers.get(KEY_HEADER), str)
    ):
        return deadline_ms / 1000
    return None


def release_of(headers: Mapping[str, Any]) -> GateMessage | None:
    """The release a worker owes the gate once this task's delivery is settled for good; None if
    the task did not come through the gate."""
    key, task_id = headers.get(KEY_HEADER), headers.get("id")
    if head_deadline(headers) is None or not isinstance(key, str) or not isinstance(task_id, str):
        return None
    return GateMessage("release", key=key, task_id=task_id)
