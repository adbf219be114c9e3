"""Raw pika helpers for tests: look at queues and publish hand-made messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.adapters.blocking_connection

from broker_svc.settings import Settings


def _parameters(url: str) -> pika.URLParameters:
    params = pika.URLParameters(url)
    params.virtual_host = Settings(broker_url=url).virtual_host
    return params


@contextlib.contextmanager
def channel(url: str) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    conn = pika.BlockingConnection(_parameters(url))
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            conn.close()


def queue_depth(url: str, queue: str) -> int:
    with channel(url) as ch:
        return int(ch.queue_declare(queue, passive=True).method.message_count)


def queue_exists(url: str, queue: str) -> bool:
    try:
        queue_depth(url, queue)
    except pika.exceptions.ChannelClosedByBroker:
        return False
    return True


@dataclass
class Got:
    body: bytes
    headers: dict[str, Any]
    properties: pika.BasicProperties
    redelivered: bool


def drain(url: str, queue: str, limit: int = 100_000) -> list[Got]:
    """Take every message now in ``queue`` (acked)."""
    out: list[Got] = []
    with channel(url) as ch:
        while len(out) < limit:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            out.append(Got(body, dict(props.headers or {}), props, bool(method.redelivered)))
    return out


def publish_raw(
    url: str,
    queue: str,
    body: bytes,
    *,
    headers: dict[str, Any] | None = None,
    content_type: str | None = "application/json",
    reply_to: str | None = None,
    correlation_id: str | None = None,
) -> None:
    with channel(url) as ch:
        ch.confirm_delivery()
        ch.basic_publish(
            "",
            queue,
            body,
            pika.BasicProperties(
                headers=headers,
                content_type=content_type,
                reply_to=reply_to,
                correlation_id=correlation_id,
                delivery_mode=2,
            ),  # fmt: skip
            mandatory=True,
        )


def delete_queues(url: str, *names: str) -> None:
    with channel(url) as ch:
        for name in names:
            ch.queue_delete(name)
