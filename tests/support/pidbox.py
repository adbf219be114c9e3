"""Speak the pidbox protocol from a test with raw pika, as kombu's Mailbox does (no client of ours)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pika

from tests.support.amqp import channel
from tests.support.waiting import poll


def call(
    url: str,
    method: str,
    *,
    arguments: dict[str, Any] | None = None,
    destination: list[str] | None = None,
    clock: int = 1,
    headers: dict[str, Any] | None = None,
    body: bytes | None = None,
    content_type: str = "application/json",
    wait_s: float = 3.0,
    reply: bool = True,
    expect: int | None = None,
) -> list[tuple[dict[str, Any], Any]]:
    """Broadcast one request and collect ``(headers, body)`` replies for ``wait_s`` seconds, or
    until ``expect`` replies came."""
    replies: list[tuple[dict[str, Any], Any]] = []
    oid = uuid.uuid4().hex
    ticket = str(uuid.uuid4())
    with channel(url) as ch:
        ch.exchange_declare("reply.celery.pidbox", exchange_type="direct", durable=False)
        ch.exchange_declare("celery.pidbox", exchange_type="fanout", durable=False)
        reply_queue = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(reply_queue, "reply.celery.pidbox", routing_key=oid)
        request: dict[str, Any] = {
            "method": method, "arguments": arguments or {}, "destination": destination, "pattern": None,
            "matcher": None,
        }  # fmt: skip
        if reply:
            request |= {"ticket": ticket, "reply_to": {"exchange": "reply.celery.pidbox", "routing_key": oid}}
        ch.basic_publish(
            "celery.pidbox", "", body if body is not None else json.dumps(request).encode(),
            pika.BasicProperties(content_type=content_type, headers={"clock": clock, **(headers or {})}),
        )  # fmt: skip
        if not reply:
            return replies

        def collect() -> bool:
            method_frame, props, payload = ch.basic_get(reply_queue, auto_ack=True)
            if method_frame is not None:
                replies.append((props.headers, json.loads(payload)))
            return expect is not None and len(replies) >= expect

        poll(collect, timeout_s=wait_s, interval_s=0.05)
    return replies


def cast(url: str, method: str, **kwargs: Any) -> None:
    """A request with no reply wanted."""
    call(url, method, reply=False, **kwargs)
