"""The ceiling: what the AMQP libraries alone do with our messages, no task queue around them.

Both ceiling subjects (``bench.ceiling_pika``, ``bench.ceiling_aio_pika``) publish the bytes and
headers our client sends for a no-op task (encoded once), with publisher confirms, pipelined up to
``CONFIRM_WINDOW`` unconfirmed; their "worker" is one process consuming with prefetch ``PREFETCH``
and one ack per message, doing nothing else. They take part in enqueue, drain and end to end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import pika

from bench.driver import NotApplicable
from bench.procs import running
from bench.queues import RawMessage, declare_plain, publish_raw
from bench.scenarios import Produced, Shape, Task
from bench.spine import NOOP
from broker_svc.message import TaskMessage, WireMessage, encode_task

ROOT = Path(__file__).resolve().parent.parent
CONFIRM_WINDOW = 1000
PREFETCH = 100


def our_noop_message() -> WireMessage:
    """One no-op task as our client encodes it (msgpack body, protocol v2 headers)."""
    return encode_task(
        TaskMessage(id=TaskMessage.new_id(), task=NOOP, ignore_result=True), serializer="msgpack"
    )


def pika_properties(wire: WireMessage) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        headers=wire.headers,
        correlation_id=wire.correlation_id,
        priority=wire.priority,
        delivery_mode=wire.delivery_mode,
    )


Producer = Callable[[str, str, int, WireMessage], Produced]


class RawSubject:
    """A ``bench.scenarios.Subject`` around one AMQP library: ``module`` runs its consumer
    (``python -m <module> consume --broker URL --queue Q``) and ``producer`` publishes."""

    def __init__(self, url: str, *, module: str, producer: Producer) -> None:
        self._url = url
        self._module = module
        self._producer = producer

    @contextmanager
    def worker(self, queue: str, shape: Shape) -> Iterator[Popen[bytes]]:
        if shape is not Shape.PAIR:
            raise NotApplicable("the ceiling has no task bodies to run concurrently")
        cmd = [sys.executable, "-m", self._module, "consume", "--broker", self._url, "--queue", queue]
        with running(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT) as proc:
            yield proc

    def consumers(self, shape: Shape) -> int:
        return 1

    def fill(self, queue: str, count: int, task: Task, *, wait_queued: bool = True) -> None:
        wire = our_noop_message()
        declare_plain(self._url, queue)
        message = RawMessage(wire.body, pika_properties(wire))
        publish_raw(self._url, queue, (message for _ in range(count)), wait_queued=wait_queued)

    def produce(self, queue: str, count: int) -> Produced:
        return self._producer(self._url, queue, count, our_noop_message())

    def round_trip(self, queue: str, calls: int) -> list[float]:
        raise NotApplicable("the ceiling has no results")
