"""What a consuming child publishes, each confirmed before the call returns: results and copies.

Publishing goes through the child's ``FeedConnection``, which waits for each confirm: a copy of a
delivery (a dead letter, a retry) must be confirmed before that delivery is acked. If the
connection fails first, the delivery is the broker's again and runs again (at-least-once).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from broker_svc.amqp.feed_connection import FeedConnection, TaskDelivery
from broker_svc.clock import LamportClock
from broker_svc.errors import Unroutable
from broker_svc.topology import (
    DEAD_LETTER_AT_HEADER,
    DEAD_LETTER_ERROR_HEADER,
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    QueueSpec,
    dead_letter_queue,
)
from broker_svc.wire import codec
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import CLOCK_HEADER, WireMessage

__all__ = ["FeedReplies"]

log = structlog.get_logger(__name__)


class FeedReplies:
    """Publishes for one consuming child and waits for each confirm.

    Args:
        connection: the child's connection.
        clock: the child's Lamport clock, forwarded on each message.
        persistent: results are persistent (``result_persistent``).
    """

    def __init__(self, connection: FeedConnection, *, clock: LamportClock, persistent: bool) -> None:
        self._connection = connection
        self._clock = self.clock = clock
        self._delivery_mode = 2 if persistent else 1
        # Told of each confirmed publish: its kind and seconds (clockwork_publish_confirm_seconds).
        self.on_confirmed: Callable[[str, float], None] | None = None

    def result(
        self,
        outcome: Outcome,
        *,
        reply_to: str,
        correlation_id: str | None,
        content_type: str,
        expiration: str | None = None,
        task_name: str | None = None,
    ) -> None:
        """Send a result (Celery's rpc format); a result whose caller is gone is logged and dropped.

        ``expiration``: the message's TTL in ms (``result_ttl``), else none. ``task_name`` names
        the task in the FAILURE sent instead of a result that cannot be encoded.

        Raises:
            BrokerSvcError: the broker did not take it (the delivery must not be acked).
        """
        try:
            body, ctype, encoding = codec.encode(outcome.to_wire(), content_type)
        except (TypeError, ValueError, OverflowError) as exc:
            task = f"task {task_name!r} (id {outcome.task_id})" if task_name else f"task {outcome.task_id}"
            why = f"the result of {task} cannot be encoded as {content_type}: {exc}"
            log.warning("task_result_not_encodable", error=why)
            error = wire_exception("EncodeError", why)
            fallback = Outcome(task_id=outcome.task_id, status=State.FAILURE, result=error)
            body, ctype, encoding = codec.encode(fallback.to_wire(), content_type)
        message = WireMessage(
            body=body,
            content_type=ctype,
            content_encoding=encoding,
            headers={CLOCK_HEADER: self._clock.forward()},
            correlation_id=correlation_id or outcome.task_id,
            priority=0,
            delivery_mode=self._delivery_mode,
            expiration=expiration,
        )
        try:
            self._publish(message, reply_to, kind="result")
        except Unroutable:
            log.info("result_unroutable", reply_to=reply_to, task_id=outcome.task_id)

    def dead_letter(self, delivery: TaskDelivery, *, reason: str, error: str) -> None:
        """Keep a delivery that must not run in ``<queue>.dead``, with why.

        Raises:
            BrokerSvcError: the broker did not take it (the delivery must not be acked).
        """
        headers = {
            **delivery.headers,
            DEAD_LETTER_REASON_HEADER: reason,
            DEAD_LETTER_ERROR_HEADER: error[:1024],
            DEAD_LETTER_QUEUE_HEADER: delivery.queue,
            DEAD_LETTER_AT_HEADER: dt.datetime.now(dt.UTC).isoformat(),
        }
        spec = dead_letter_queue(delivery.queue)
        self._publish(copy_of(delivery, headers), spec.name, kind="dead_letter", declare=(spec,))
        log.warning("task_dead_lettered", reason=reason, error=error[:200], queue=delivery.queue)

    def copy(
        self,
        delivery: TaskDelivery,
        *,
        to: str,
        headers: Mapping[str, Any],
        drop: Sequence[str] = (),
        body: bytes | None = None,
        declare: Sequence[QueueSpec] = (),
    ) -> None:
        """Publish a persistent copy of ``delivery`` with changed headers to queue ``to``.

        Raises:
            BrokerSvcError: the broker did not take it (the delivery must not be acked).
        """
        merged = _copied_headers(delivery, headers, drop)
        self._publish(copy_of(delivery, merged, body=body), to, kind="republish", declare=declare)

    def copies(self, copied: Sequence[tuple[TaskDelivery, Mapping[str, Any], Sequence[str]]]) -> None:
        """Persistent copies of deliveries back to their own queues, each ``(delivery, headers,
        drop)`` as ``copy`` makes one, published at once and confirmed together.

        Raises:
            BrokerSvcError: the broker did not take one (no delivery may be acked).
        """
        started = time.monotonic()
        self._connection.publish_all([
            (copy_of(delivery, _copied_headers(delivery, headers, drop)), delivery.queue)
            for delivery, headers, drop in copied
        ])  # fmt: skip
        if self.on_confirmed is not None:
            self.on_confirmed("republish", time.monotonic() - started)

    def task(self, wire: WireMessage, *, queue: QueueSpec) -> None:
        """Send a task a finished task asked for (a chain's next step, a callback); confirmed.

        A queue nobody declared yet is declared as Celery's client would, and the task sent again.

        Raises:
            BrokerSvcError: the broker did not take it (the delivery must not be acked).
        """
        message = WireMessage(
            body=wire.body, content_type=wire.content_type, content_encoding=wire.content_encoding,
            headers={**wire.headers, CLOCK_HEADER: self._clock.forward()}, correlation_id=wire.correlation_id,
            reply_to=wire.reply_to, priority=wire.priority, delivery_mode=wire.delivery_mode,
            expiration=wire.expiration,
        )  # fmt: skip
        try:
            self._publish(message, queue.name, kind="task")
        except Unroutable:  # declared as the worker's settings declare it (type, ordered)
            self._publish(message, queue.name, kind="task", declare=(queue,))

    def internal(self, body: bytes, *, content_type: str, encoding: str, queue: QueueSpec) -> None:
        """Send a persistent message to one of Clockwork's own queues (declared first); confirmed.

        Raises:
            BrokerSvcError: the broker did not take it (the delivery must not be acked).
        """
        message = WireMessage(
            body=body, content_type=content_type, content_encoding=encoding,
            headers={CLOCK_HEADER: self._clock.forward()}, delivery_mode=2,
        )  # fmt: skip
        self._publish(message, queue.name, kind="internal", declare=(queue,))

    def release(self, headers: Mapping[str, Any], *, queue: QueueSpec) -> None:
        """Tell a dedup gate its key's head ended, without waiting for the confirm: it follows the
        delivery's ack on the same channel, and the child's next task should not wait on a quorum
        queue's confirm. A release lost with the connection ends at the head's deadline instead.

        Raises:
            ConnectionLost: the write failed.
        """
        message = WireMessage(
            body=b"", content_type="", content_encoding="",
            headers={**headers, CLOCK_HEADER: self._clock.forward()}, delivery_mode=2,
        )  # fmt: skip
        self._connection.publish_nowait(message, queue.name, exchange="")

    def _publish(
        self, message: WireMessage, routing_key: str, *, kind: str, declare: Sequence[QueueSpec] = ()
    ) -> None:
        started = time.monotonic()
        self._connection.publish(message, routing_key, declare=declare)
        if self.on_confirmed is not None:
            self.on_confirmed(kind, time.monotonic() - started)


def _copied_headers(
    delivery: TaskDelivery, headers: Mapping[str, Any], drop: Sequence[str]
) -> dict[str, Any]:
    # A copy's headers: the delivery's, without ``drop``, with ``headers`` over them.
    merged = {key: value for key, value in delivery.headers.items() if key not in drop}
    merged.update(headers)
    return merged


def copy_of(delivery: TaskDelivery, headers: dict[str, Any], *, body: bytes | None = None) -> WireMessage:
    """A persistent copy of a delivery with ``headers``; no TTL (the ``expires`` header ends a task)."""
    return WireMessage(
        body=delivery.body if body is None else body,
        content_type=delivery.content_type or "",
        content_encoding=delivery.content_encoding or "",
        headers=headers,
        correlation_id=delivery.correlation_id,
        reply_to=delivery.reply_to,
        priority=delivery.priority,
        delivery_mode=2,
    )
