"""Watch the ``celeryev`` exchange from a test: every event with its headers, in arrival order."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pika

from tests.support.amqp import _parameters
from tests.support.waiting import wait_for


class EventTap:
    """An exclusive queue bound to ``celeryev`` (declared as Celery does), read with basic.get."""

    def __init__(self, url: str, routing_key: str = "#") -> None:
        self._connection = pika.BlockingConnection(_parameters(url))
        self._channel = self._connection.channel()
        self._channel.exchange_declare("celeryev", exchange_type="topic", durable=True)
        self._queue = self._channel.queue_declare("", exclusive=True).method.queue
        self._channel.queue_bind(self._queue, "celeryev", routing_key=routing_key)
        self.events: list[dict[str, Any]] = []
        self.raw: list[tuple[str, pika.BasicProperties, bytes]] = []

    def poll(self) -> list[dict[str, Any]]:
        """Read what has arrived; returns every event so far."""
        while True:
            method, props, body = self._channel.basic_get(self._queue, auto_ack=True)
            if method is None:
                return self.events
            self.raw.append((method.routing_key, props, body))
            decoded = json.loads(body)
            for event in decoded if isinstance(decoded, list) else [decoded]:
                self.events.append({**event, "_routing_key": method.routing_key, "_headers": props.headers})

    def of(self, event_type: str, **match: Any) -> list[dict[str, Any]]:
        """Events of one type whose fields equal ``match``."""
        return [
            e for e in self.events if e["type"] == event_type and all(e.get(k) == v for k, v in match.items())
        ]

    def wait(
        self, predicate: Callable[[list[dict[str, Any]]], bool], *, timeout_s: float = 15.0, message: str
    ) -> list[dict[str, Any]]:
        """Wait until ``predicate(events)`` holds."""
        wait_for(lambda: predicate(self.poll()), timeout_s=timeout_s, message=message)
        return self.events

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()

    def __enter__(self) -> EventTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
