"""A delivery's fate as a value: what the step that handled it decided, for a settle point to carry out.

Pure: no I/O, no AMQP client. A pool child carries a disposition out in ``worker/consume/settle.py``,
the one place a task delivery is acked or handed back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from broker_svc.topology import QueueSpec
from broker_svc.wire import codec
from broker_svc.wire.task.task_message import TaskMessage, parse_iso_datetime, safe_repr

__all__ = ["ACK", "HAND_BACK", "LEFT_TO_BROKER", "Disposition", "Fate", "Owed", "retry_copy", "retry_eta"]

# What a delivery still owes once its copy is confirmed: an announcement, sent before the ack.
Owed = Callable[[], Awaitable[None]]


class Fate(StrEnum):
    """What becomes of a task delivery."""

    ACK = "ack"  # nothing more to do: whatever it owed (result, event) has gone out
    HAND_BACK = "hand_back"  # nack with requeue: it runs again, here or on another worker
    DEAD_LETTER = "dead_letter"  # must never run: a confirmed copy to ``<queue>.dead``, then ack
    REPUBLISH = "republish"  # runs later: a confirmed copy (retry, park, recount), then ack
    LEFT_TO_BROKER = "left_to_broker"  # nothing: its channel is gone or it stays unacked on purpose


@dataclass(frozen=True, slots=True)
class Disposition:
    """A delivery's fate, decided by the step that handled it and carried out by :class:`Settler`.

    Attributes:
        fate: what becomes of the delivery.
        reason: the dead-letter reason (``x-clockwork-reason``), for ``DEAD_LETTER``.
        error: why, in words (``x-clockwork-error``), for ``DEAD_LETTER``.
        headers: set on the copy, for ``REPUBLISH``.
        drop: headers the copy must not carry, for ``REPUBLISH``.
        body: the copy's body, when it differs from the delivery's (a retry with new arguments).
        delay_ms: the delay queue the copy waits in, for ``REPUBLISH``; None: straight to the queue.
        to: another queue the copy goes to, for ``REPUBLISH`` (a dedup gate shard); None: its own.
        owed: what the delivery still owes once its copy is confirmed and before the ack (the event
            and reply that announce a retry or a dead letter only once it is true).
        ran: a child ran it here to an outcome (remembered for a redelivery whose ack is lost).
        finished: that outcome is final for this id and retry (later copies are duplicates).
    """

    fate: Fate
    reason: str = ""
    error: str = ""
    headers: Mapping[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    body: bytes | None = None
    delay_ms: int | None = None
    to: QueueSpec | None = None
    owed: Owed | None = None
    ran: bool = False
    finished: bool = False

    @classmethod
    def dead_letter(
        cls, reason: str, error: str, *, owed: Owed | None = None, ran: bool = False, finished: bool = False
    ) -> Disposition:
        """Keep it in ``<queue>.dead`` with ``reason`` and ``error``, then ack."""
        return cls(Fate.DEAD_LETTER, reason=reason, error=error, owed=owed, ran=ran, finished=finished)

    @classmethod
    def republish(
        cls,
        headers: Mapping[str, Any],
        *,
        drop: tuple[str, ...] = (),
        body: bytes | None = None,
        delay_ms: int | None = None,
        to: QueueSpec | None = None,
        owed: Owed | None = None,
        ran: bool = False,
        finished: bool = False,
    ) -> Disposition:
        """Publish a copy with ``headers`` set (to a delay queue if ``delay_ms``, to ``to`` if
        given), then ack."""
        return cls(
            Fate.REPUBLISH,
            headers=headers,
            drop=drop,
            body=body,
            delay_ms=delay_ms,
            to=to,
            owed=owed,
            ran=ran,
            finished=finished,
        )


ACK: Disposition = Disposition(Fate.ACK)
HAND_BACK: Disposition = Disposition(Fate.HAND_BACK)
LEFT_TO_BROKER: Disposition = Disposition(Fate.LEFT_TO_BROKER)


def retry_copy(
    request: TaskMessage,
    value: Mapping[str, Any],
    eta: str,
    *,
    delay_ms: int | None,
    owed: Owed | None = None,
) -> Disposition:
    """The copy a retry leaves: same id, ``retries + 1``, its ``eta``, the arguments ``retry()`` gave.

    ``value`` is what the child reported (``args``/``kwargs`` when ``retry(args=..., kwargs=...)``);
    the new arguments go in the request's own codec, uncompressed.
    """
    headers: dict[str, Any] = {"retries": request.retries + 1, "eta": eta}
    body: bytes | None = None
    drop: tuple[str, ...] = ()
    if "args" in value or "kwargs" in value:
        args = list(value.get("args", request.args))
        kwargs = dict(value.get("kwargs", request.kwargs))
        body, _, _ = codec.encode([args, kwargs, request.embed], codec.reply_type(request.content_type))
        headers |= {"argsrepr": safe_repr(args), "kwargsrepr": safe_repr(kwargs)}
        drop = ("compression",)
    return Disposition.republish(
        headers, drop=drop, body=body, delay_ms=delay_ms, owed=owed, ran=True, finished=True
    )


def retry_eta(value: Mapping[str, Any]) -> dt.datetime:
    """When a retry is due: the ISO-8601 ``eta`` its child reported; anything unreadable means now."""
    eta = value.get("eta")
    if isinstance(eta, str):
        try:
            return parse_iso_datetime(eta)
        except ValueError:
            pass
    return dt.datetime.now(dt.UTC)
