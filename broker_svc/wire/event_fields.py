"""The fields every Celery event carries (WIRE.md §7), built without I/O for any sender.

The worker's ``EventDispatcher`` (aio-pika), a consuming child's ``FeedEvents`` (its own
connection) and the scheduler's ``EventSender`` (blocking pika) send the same event maps.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from broker_svc.clock import LamportClock

__all__ = ["describe_repr", "encode_event", "event_body", "routing_key", "utcoffset"]


def utcoffset() -> int:
    """Hours *west* of UTC, Celery's sign (a UTC+2 host sends -2), DST included when in effect."""
    if time.daylight and time.localtime().tm_isdst > 0:
        return time.altzone // 3600
    return time.timezone // 3600


def event_body(event_type: str, *, hostname: str, clock: LamportClock, **extra: Any) -> dict[str, Any]:
    """An event map with the standard fields (the clock is forwarded: this is a send)."""
    return {
        "type": event_type,
        "hostname": hostname,
        "pid": os.getpid(),
        "clock": clock.forward(),
        "timestamp": time.time(),
        "utcoffset": utcoffset(),
        **extra,
    }


def encode_event(event: dict[str, Any] | list[dict[str, Any]]) -> bytes:
    """Events are JSON (one, or a batch as a list): a receiver that meets one msgpack event breaks."""
    return json.dumps(event, default=repr).encode()


def routing_key(event_type: str) -> str:
    """``task-succeeded`` is published as ``task.succeeded`` (Celery's topic keys)."""
    return event_type.replace("-", ".")


def describe_repr(error: dict[str, Any]) -> str:
    """An exception map as Celery's events show it: ``ValueError('bad')``."""
    message = error.get("exc_message")
    items = message if isinstance(message, list) else [message]
    return f"{error.get('exc_type')}({', '.join(repr(m) for m in items)})"
