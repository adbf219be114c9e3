"""Live events (Celery's ``celeryev``) read with blocking pika, and the decoding both feeds share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.logging import get_logger
from broker_svc.topology import event_queue
from broker_svc.wire import codec
from control.blocking.declarations import declare_queue

__all__ = ["decode_events", "follow_events"]

log = get_logger(__name__)

_EVENT_ACCEPT: Final = codec.accept_set(("json",))


def follow_events(
    conn: pika.BlockingConnection,
    *,
    routing_key: str,
    tick_s: float,
    clock: LamportClock,
    max_body_bytes: int,
) -> Iterator[list[dict[str, Any]]]:
    """Follow live events (Celery's ``celeryev``) on an exclusive queue of a channel of its own.

    Yields the events received during each tick of about ``tick_s`` (often none); closing the
    generator closes the channel, and the queue goes with it. Bodies that are lists (Celery's
    batched task events) are flattened; anything that is not a JSON map is skipped.

    Raises:
        pika.exceptions.AMQPError: the channel or the connection failed.
        OSError: the socket failed.
    """
    received: list[dict[str, Any]] = []

    def on_message(
        _ch: Channel, _method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        for event in decode_events(body, props, max_bytes=max_body_bytes):
            if event.get("type") != "task-sent":  # clients' clocks are not trusted (as Celery)
                clock.adjust(event.get("clock"))
            received.append(event)

    channel = conn.channel()
    spec = event_queue(routing_key)
    declare_queue(channel, spec, bind=True)
    channel.basic_consume(spec.name, on_message, auto_ack=True, exclusive=True)
    try:
        while True:
            conn.process_data_events(time_limit=tick_s)
            batch = received[:]
            received.clear()
            yield batch
    finally:
        if channel.is_open and conn.is_open:
            try:
                channel.close()  # the exclusive queue goes with it
            except (pika.exceptions.AMQPError, OSError):
                pass


def decode_events(body: bytes, props: pika.spec.BasicProperties, *, max_bytes: int) -> list[dict[str, Any]]:
    """The events in one message: a JSON map, or a list of them; nothing if it does not decode."""
    try:
        decoded = codec.decode(body, props.content_type, accept=_EVENT_ACCEPT, max_bytes=max_bytes)
    except MessageError as exc:
        log.debug("event_undecodable", error=str(exc), size=len(body))
        return []
    items = decoded if isinstance(decoded, list) else [decoded]
    return [item for item in items if isinstance(item, dict)]
