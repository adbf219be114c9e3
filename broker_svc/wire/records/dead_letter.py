"""Dead letters as ``ctl dead`` reads and requeues them (pure): what one says, and its requeued copy.

The worker writes them (``worker/consume/replies.py``); the control plane reads and requeues them
(``control/blocking/dead_letters.py``).

A dead letter is a task a worker kept in ``<queue>.dead`` with the headers ``x-clockwork-reason``,
``-error``, ``-queue`` and ``-dead-at`` (docs/guide.md, "Delivery limits, dead letters and quorum
queues"). Requeueing publishes a copy to its queue without those headers and the delivery counts,
with ``x-clockwork-requeued`` saying so, and a second copy of that same publish (RabbitMQ's ``BCC``)
into the dead queue: the *marker*. The marker holds the dead letter's key, so a requeue cut short
after its publish, before its ack, is recognised by the next one: the dead letter and its marker
are acked, and nothing is published twice.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.topology import (
    DEAD_LETTER_AT_HEADER,
    DEAD_LETTER_ERROR_HEADER,
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_REQUEUED_HEADER,
    dedup_gate_queue,
    expired_queue,
)
from broker_svc.wire import codec
from broker_svc.wire.records.dedup import (
    DEADLINE_HEADER,
    KEY_HEADER,
    TARGET_QUEUE_HEADER,
    TOKEN_HEADER,
    shard_of,
)
from broker_svc.wire.task.task_message import CLOCK_HEADER

__all__ = [
    "DEAD_SUFFIX",
    "BodyView",
    "DeadLetter",
    "RequeuePlan",
    "RequeueResult",
    "Requeued",
    "dead_queue_name",
    "jsonable",
    "letter_key",
    "marker_key",
    "plan_requeue",
    "view_body",
]

DEAD_SUFFIX: Final = ".dead"
# What a requeued copy must not carry: the dead letter's own headers, the delivery counts (ours and
# quorum's; a fresh publish starts at 0), the mark of a resend, a rate-limit token it held
# (worker/rules/rate_limits.py), the broker's dead-lettering record, and a dedup head's deadline
# and token (the gate stamps new ones).
_DROPPED: Final = frozenset({
    DEAD_LETTER_REASON_HEADER, DEAD_LETTER_ERROR_HEADER, DEAD_LETTER_QUEUE_HEADER, DEAD_LETTER_AT_HEADER,
    "x-clockwork-deliveries", "x-delivery-count", "x-clockwork-resent", "x-clockwork-rate-reserved",
    "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
    "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", "CC", "BCC",
    DEADLINE_HEADER, TOKEN_HEADER,
})  # fmt: skip
_ACCEPT: Final = codec.accept_set(("json", "msgpack"))
_EXCERPT_BYTES: Final = 256


def dead_queue_name(queue: str) -> str:
    """``orders`` or ``orders.dead`` -> ``orders.dead``.

    Raises:
        ValueError: an empty name.
    """
    if not queue or queue == DEAD_SUFFIX:
        raise ValueError("a queue name is needed (orders, or its dead queue orders.dead)")
    return queue if queue.endswith(DEAD_SUFFIX) else f"{queue}{DEAD_SUFFIX}"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """One message in a dead-letter queue.

    Attributes:
        dead_queue: where it is kept (``orders.dead``).
        queue: the queue it came from: ``x-clockwork-queue``, else the dead queue's name without
            ``.dead``; a requeue sends it back there.
        task_id: the task's id (its ``id`` header); None if it has none.
        task: the task's name (its ``task`` header); None if it has none.
        reason: why it is here (``x-clockwork-reason``), e.g. ``NotRegistered``, ``rejected``.
        error: the error in words (``x-clockwork-error``).
        dead_at: when it was dead-lettered (``x-clockwork-dead-at``, ISO-8601 UTC).
        requeued: how often this task was requeued before it came back here.
        key: identifies this dead letter (a digest of its headers and body).
        headers: its headers, as read.
        properties: its AMQP properties that are set.
        body: its body, as stored.
    """

    dead_queue: str
    queue: str
    task_id: str | None
    task: str | None
    reason: str | None
    error: str | None
    dead_at: str | None
    requeued: int
    key: str
    headers: dict[str, Any] = field(repr=False)
    properties: dict[str, Any] = field(repr=False)
    body: bytes = field(repr=False)

    @classmethod
    def read(
        cls, dead_queue: str, headers: Mapping[str, Any] | None, properties: Mapping[str, Any], body: bytes
    ) -> DeadLetter:
        """A dead letter from what ``basic.get`` gave (any header may be missing or malformed)."""
        headers = dict(headers or {})
        origin = headers.get(DEAD_LETTER_QUEUE_HEADER)
        if not isinstance(origin, str) or not origin:
            origin = dead_queue.removesuffix(DEAD_SUFFIX)
        return cls(
            dead_queue=dead_queue,
            queue=origin,
            task_id=_text(headers.get("id")),
            task=_text(headers.get("task")),
            reason=_text(headers.get(DEAD_LETTER_REASON_HEADER)),
            error=_text(headers.get(DEAD_LETTER_ERROR_HEADER)),
            dead_at=_text(headers.get(DEAD_LETTER_AT_HEADER)),
            requeued=_requeue_count(headers),
            key=letter_key(headers, body),
            headers=headers,
            properties={k: v for k, v in properties.items() if v is not None},
            body=body,
        )

    @property
    def content_type(self) -> str | None:
        value = self.properties.get("content_type")
        return value if isinstance(value, str) else None

    def as_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The fields as JSON values; ``full`` adds the headers, properties and the body's view."""
        shown: dict[str, Any] = {
            "id": self.task_id, "task": self.task, "reason": self.reason, "error": self.error,
            "dead_at": self.dead_at, "queue": self.queue, "dead_queue": self.dead_queue,
            "requeued": self.requeued, "content_type": self.content_type, "size": len(self.body),
        }  # fmt: skip
        if full:
            shown["headers"] = jsonable(self.headers)
            shown["properties"] = jsonable(self.properties)
            shown["body"] = view_body(self).as_dict()
        return shown


def letter_key(headers: Mapping[str, Any], body: bytes) -> str:
    """A dead letter's identity: the same each time it is read (a classic queue changes no header on
    a redelivery), and another one for each dead-lettering (its ``x-clockwork-dead-at``)."""
    digest = hashlib.sha256(json.dumps(jsonable(headers), sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(body)
    return digest.hexdigest()[:32]


def marker_key(headers: Mapping[str, Any] | None) -> str | None:
    """The key of the dead letter a requeue marker stands for; None if these are not a marker's.

    A marker is the requeued copy itself, so it has ``x-clockwork-requeued`` and no reason; a task
    dead-lettered again after a requeue has both (a worker sets the reason).
    """
    headers = headers or {}
    requeued = headers.get(DEAD_LETTER_REQUEUED_HEADER)
    if DEAD_LETTER_REASON_HEADER in headers or not isinstance(requeued, Mapping):
        return None
    key = requeued.get("key")
    return key if isinstance(key, str) and key else None


@dataclass(frozen=True, slots=True)
class RequeuePlan:
    """Where a dead letter's copy goes and with which headers.

    Attributes:
        routing_key: the queue it is published to (default exchange): its task queue, or the dedup
            gate shard of its key, which sends it on to ``queue``.
        queue: the task queue it ends up in.
        headers: the copy's headers (without the ``BCC`` that makes the marker).
    """

    routing_key: str
    queue: str
    headers: dict[str, Any]


def plan_requeue(
    letter: DeadLetter, *, to: str | None, namespace: str, by: str, clock: int, now: dt.datetime
) -> RequeuePlan:
    """The copy that requeues ``letter``: to ``to``, else the queue it came from.

    A task the broker dead-lettered into the expired queue (for another reason than expiry) goes
    back to the queue the broker took it from. A task with a dedup key goes to its key's gate again
    (as its client sent it), so the key holds one running at a time after a requeue too.

    Raises:
        ValueError: ``to`` is a dead queue.
    """
    queue = to or _broker_origin(letter, namespace) or letter.queue
    if queue.endswith(DEAD_SUFFIX):
        raise ValueError(f"will not requeue into a dead-letter queue ({queue}); name the task queue")
    headers = {k: v for k, v in letter.headers.items() if k not in _DROPPED}
    headers[CLOCK_HEADER] = clock
    headers[DEAD_LETTER_REQUEUED_HEADER] = {
        "count": letter.requeued + 1, "at": now.isoformat(), "by": by, "from": letter.dead_queue,
        "reason": letter.reason, "dead_at": letter.dead_at, "key": letter.key,
    }  # fmt: skip
    routing_key = queue
    key = headers.get(KEY_HEADER)
    if isinstance(key, str) and key:
        headers[TARGET_QUEUE_HEADER] = queue
        routing_key = dedup_gate_queue(shard_of(key), namespace).name
    return RequeuePlan(routing_key=routing_key, queue=queue, headers=headers)


@dataclass(frozen=True, slots=True)
class Requeued:
    """A dead letter sent back, and where to."""

    letter: DeadLetter
    queue: str
    # The copy was published by an earlier requeue that was cut short; this run only acked it.
    earlier: bool = False


@dataclass(frozen=True, slots=True)
class RequeueResult:
    """What a requeue did.

    Attributes:
        requeued: the dead letters sent back, in queue order (``earlier``: by a run cut short).
        markers_cleared: markers of earlier runs removed (their dead letter was gone already).
    """

    requeued: tuple[Requeued, ...]
    markers_cleared: int = 0

    def as_dict(self) -> dict[str, Any]:
        """As JSON values."""
        return {
            "requeued": [
                {"id": r.letter.task_id, "task": r.letter.task, "from": r.letter.dead_queue, "to": r.queue,
                 "earlier": r.earlier}
                for r in self.requeued
            ],
            "markers_cleared": self.markers_cleared,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class BodyView:
    """A body as it can be shown: decoded (json, msgpack), or a safe excerpt of its bytes.

    Attributes:
        content_type: the message's content type.
        size: the body's length in bytes.
        decoded: whether ``value`` holds the decoded body.
        value: the decoded body (for a task: ``[args, kwargs, embed]``).
        excerpt: the first bytes as a Python bytes literal (no control character gets through).
        why: why it was not decoded.
    """

    content_type: str | None
    size: int
    decoded: bool
    value: Any = None
    excerpt: str = ""
    why: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """As JSON values."""
        if self.decoded:
            return {"content_type": self.content_type, "size": self.size, "decoded": jsonable(self.value)}
        return {
            "content_type": self.content_type,
            "size": self.size,
            "excerpt": self.excerpt,
            "why": self.why,
        }


def view_body(letter: DeadLetter, *, max_bytes: int = 10 * 1024 * 1024) -> BodyView:
    """Decode ``letter``'s body if it is json or msgpack (never pickle or yaml), else an excerpt."""
    body, content_type = letter.body, letter.content_type
    excerpt = repr(body[:_EXCERPT_BYTES]) + (" ..." if len(body) > _EXCERPT_BYTES else "")
    try:
        compression = letter.headers.get("compression")
        raw = body if compression is None else codec.decompress(body, compression, max_bytes=max_bytes)
        value = codec.decode(raw, content_type, accept=_ACCEPT, max_bytes=max_bytes)
    except MessageError as exc:
        return BodyView(content_type, len(body), decoded=False, excerpt=excerpt, why=str(exc))
    return BodyView(content_type, len(body), decoded=True, value=value)


def jsonable(value: Any) -> Any:
    """``value`` with what JSON lacks made printable: bytes as a literal, datetimes as ISO-8601."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return repr(bytes(value))
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def _broker_origin(letter: DeadLetter, namespace: str) -> str | None:
    # The newest ``x-death`` entry of a task dead-lettered by the broker (docs/guide.md, "Expiry").
    if letter.queue != expired_queue(namespace):
        return None
    deaths = letter.headers.get("x-death")
    newest = deaths[0] if isinstance(deaths, list) and deaths else None
    origin = newest.get("queue") if isinstance(newest, Mapping) else None
    return origin if isinstance(origin, str) and origin else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _requeue_count(headers: Mapping[str, Any]) -> int:
    requeued = headers.get(DEAD_LETTER_REQUEUED_HEADER)
    count = requeued.get("count") if isinstance(requeued, Mapping) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
