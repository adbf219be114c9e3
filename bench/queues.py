"""Watching and filling queues from outside the system under test (pika only: runs in both venvs).

Every system is measured the same way from the broker's side: how many messages are ready in its
queue and how many consumers read it (``queue.declare`` with ``passive``), so no figure depends on
what a system chooses to log or report about itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class Depth:
    """A queue as the broker sees it; ``ready`` leaves out deliveries not yet acked."""

    ready: int
    consumers: int


@dataclass(frozen=True, slots=True)
class RawMessage:
    """What a fill publishes: the body and properties a system's own client would have sent."""

    body: bytes
    properties: pika.BasicProperties
    exchange: str = ""


Alive = Callable[[], bool] | None


class QueueProbe:
    """One connection that reads queue depths (reopening its channel after a 404)."""

    def __init__(self, url: str) -> None:
        self._connection = pika.BlockingConnection(pika.URLParameters(url))
        self._channel: BlockingChannel = self._connection.channel()

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()

    def depth(self, queue: str) -> Depth:
        """The queue's depth; a queue that does not exist (yet) reads as empty, without consumers."""
        try:
            frame = self._channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            self._channel = self._connection.channel()
            return Depth(0, 0)
        return Depth(frame.method.message_count, frame.method.consumer_count)

    def wait(
        self, queue: str, done: Callable[[Depth], bool], *, timeout_s: float, what: str, alive: Alive = None
    ) -> tuple[float, Depth]:
        """Poll until ``done(depth)``; return when it was first seen (``perf_counter``) and the depth.

        Raises:
            TimeoutError: not within ``timeout_s``, or ``alive`` reported the worker gone.
        """
        deadline = time.perf_counter() + timeout_s
        while True:
            depth = self.depth(queue)
            now = time.perf_counter()
            if done(depth):
                return now, depth
            if now > deadline:
                raise TimeoutError(f"{what}: still {depth} after {timeout_s} s")
            if alive is not None and not alive():
                raise TimeoutError(f"{what}: the worker exited (queue at {depth})")
            time.sleep(POLL_S)


@contextmanager
def probe(url: str) -> Iterator[QueueProbe]:
    queue_probe = QueueProbe(url)
    try:
        yield queue_probe
    finally:
        queue_probe.close()


def publish_raw(
    url: str,
    queue: str,
    messages: Iterable[RawMessage],
    *,
    wait_queued: bool = True,
    timeout_s: float = 120.0,
) -> int:
    """Publish without confirms (a fill is not timed), then wait until the broker holds them all
    (unless ``wait_queued`` is False: a worker is consuming them meanwhile).

    The queue must exist: each system declares its own (with its own arguments) first.

    Returns:
        How many were published.

    Raises:
        TimeoutError: the queue did not reach the expected depth.
    """
    with probe(url) as queue_probe:
        before = queue_probe.depth(queue).ready
        connection = pika.BlockingConnection(pika.URLParameters(url))
        try:
            channel = connection.channel()
            sent = 0
            for message in messages:
                # Routed by the queue's name, through the default exchange or the system's own.
                channel.basic_publish(message.exchange, queue, message.body, message.properties)
                sent += 1
        finally:
            connection.close()
        if wait_queued:
            queue_probe.wait(
                queue, lambda d: d.ready >= before + sent, timeout_s=timeout_s, what=f"filling {queue}"
            )
    return sent


def declare_plain(url: str, queue: str) -> None:
    """Declare a durable queue without arguments (ours and Celery's task queue shape)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(queue, durable=True)
    finally:
        connection.close()


def delete(url: str, queues: Iterable[str], exchanges: Iterable[str] = ()) -> None:
    """Delete queues and exchanges that may or may not exist (cleanup after a measurement)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for kind, names in (("queue", queues), ("exchange", exchanges)):
            for name in names:
                channel = connection.channel()
                try:
                    if kind == "queue":
                        channel.queue_delete(name)
                    else:
                        channel.exchange_delete(name)
                    channel.close()
                except pika.exceptions.ChannelClosedByBroker:
                    pass
    finally:
        connection.close()
