"""Celery events from a blocking thread (the scheduler's leader): ``beat-fired``, ``beat-schedule-changed``.

Best-effort, as the worker's events: not mandatory, no confirm awaited, a failure logged and
never a reason to stop the sender's work. One connection of its own, opened on first use and
again after a failure (at most once a second, so a broker that is down costs little).
"""

from __future__ import annotations

import time
from typing import Any, Final

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from broker_svc.clock import LamportClock
from broker_svc.connection.blocking import open_blocking
from broker_svc.errors import BrokerUnavailable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import event_exchange
from broker_svc.wire.event_fields import encode_event, event_body, routing_key

__all__ = ["EventSender"]

log = get_logger(__name__)

_RETRY_S: Final = 1.0


class EventSender:
    """Sends events as ``hostname``; one thread at a time."""

    def __init__(self, settings: Settings, *, hostname: str, clock: LamportClock) -> None:
        self._settings = settings
        self.hostname = hostname
        self._clock = clock
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._next_try = 0.0

    def send(self, event_type: str, **fields: Any) -> None:
        """Publish one event; never raises on broker errors."""
        self._publish(event_type, event_body(event_type, hostname=self.hostname, clock=self._clock, **fields))

    def send_batch(self, event_type: str, many: list[dict[str, Any]]) -> None:
        """Publish events of one type in one message, a list (Celery's batched events, which its
        receivers and ours read event by event); never raises on broker errors."""
        if many:
            bodies = [event_body(event_type, hostname=self.hostname, clock=self._clock, **f) for f in many]
            self._publish(event_type, bodies)

    def _publish(self, event_type: str, event: dict[str, Any] | list[dict[str, Any]]) -> None:
        channel = self._open()
        if channel is None:
            return
        body = encode_event(event)
        props = pika.BasicProperties(
            content_type="application/json", content_encoding="utf-8", delivery_mode=1,
            headers={"hostname": self.hostname},
        )  # fmt: skip
        try:
            channel.basic_publish(event_exchange().name, routing_key(event_type), body, props)
        except (pika.exceptions.AMQPError, OSError) as exc:
            log.warning("event_not_sent", event_type=event_type, error=str(exc) or type(exc).__name__)
            self.close()

    def close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # closing a broken connection: nothing left to do
                pass

    def _open(self) -> BlockingChannel | None:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self.close()
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + _RETRY_S
        try:  # pika tries the failover URLs in turn
            conn = open_blocking(self._settings, connection_name=f"clockwork-events-{self.hostname}")
            channel = conn.channel()
            exchange = event_exchange()
            channel.exchange_declare(exchange.name, exchange.type, **exchange.declare_options())
        except (BrokerUnavailable, pika.exceptions.AMQPError, OSError) as exc:
            log.warning("event_connect_failed", error=str(exc) or type(exc).__name__)
            return None
        self._conn, self._channel = conn, channel
        return channel
