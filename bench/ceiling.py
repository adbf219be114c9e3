"""The ceiling: what the AMQP libraries alone do with our messages, no task queue around them.

Both ceiling subjects (``bench.ceiling_pika``, ``bench.ceiling_aio_pika``) publish the bytes and
headers our client sends for a no-op task (encoded once), with publisher confirms, pipelined up to
``CONFIRM_WINDOW`` unconfirmed; their "worker" is one process consuming with prefetch ``PREFETCH``
and one ack per message, doing nothing else. They take part in enqueue, drain, end to end and the
round trip.

The round trip does the AMQP work of ours: the client declares a reply queue shaped as our
client's (``result_queue``: durable, ``x-expires``; deleted after the measurement), consumes it
without acks, and publishes our no-op call message (``reply_to`` set, persistent) with a fresh
``correlation_id`` per call, then waits for the reply carrying it. The worker, for a message with
a ``reply_to``, publishes the bytes of our worker's result for a no-op task (encoded once) to the
default exchange on a second channel in confirm mode, ``mandatory``, with our worker's delivery
mode for results, waits for that confirm and then acks the request, as our worker does. Messages
without a ``reply_to`` (enqueue, drain, end to end) are only acked, as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import pika

from bench.driver import NotApplicable
from bench.procs import running
from bench.queues import RawMessage, declare_plain, delete, publish_raw
from bench.scenarios import Produced, Shape, Task
from bench.spine import NOOP
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec, result_queue
from broker_svc.wire import codec
from broker_svc.wire.results.message import Outcome
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import CLOCK_HEADER, TaskMessage, WireMessage, encode_task

ROOT = Path(__file__).resolve().parent.parent
CONFIRM_WINDOW = 1000
PREFETCH = 100
CALL_TIMEOUT_S = 30.0  # one round trip, as ``bench.ours`` waits in ``get(timeout=30)``
_DEFAULTS = Settings()


def our_noop_message() -> WireMessage:
    """One no-op task as our client encodes it (msgpack body, protocol v2 headers)."""
    return encode_task(
        TaskMessage(id=TaskMessage.new_id(), task=NOOP, ignore_result=True), serializer="msgpack"
    )


def our_call_message(reply_to: str) -> WireMessage:
    """One no-op task as our client encodes it for a call whose result it waits for."""
    task_id = TaskMessage.new_id()
    message = TaskMessage(id=task_id, task=NOOP, clock=1, reply_to=reply_to, correlation_id=task_id)
    return encode_task(message, serializer="msgpack")


def our_result_message(task_id: str | None = None) -> WireMessage:
    """A no-op task's SUCCESS result as our worker publishes it to ``reply_to`` (``worker.consume.publish``):
    the request's content type (msgpack), the clock header, priority 0, our default delivery mode
    for results (``Settings.result_persistent``); ``correlation_id`` is the request's.

    For ``task_id``, or a new one where the reply's body does not matter (the ceiling).
    """
    outcome = Outcome(task_id=task_id or TaskMessage.new_id(), status=State.SUCCESS)
    body, content_type, content_encoding = codec.encode(outcome.to_wire(), codec.MSGPACK)
    return WireMessage(
        body=body,
        content_type=content_type,
        content_encoding=content_encoding,
        headers={CLOCK_HEADER: 1},
        priority=0,
        delivery_mode=2 if _DEFAULTS.result_persistent else 1,
    )


def reply_queue(queue: str) -> QueueSpec:
    """The round trip's reply queue, shaped as our client's result queue."""
    return result_queue(f"{queue}.reply", expires_s=_DEFAULTS.result_expires_s)


def with_correlation_id(wire: WireMessage, correlation_id: str | None) -> WireMessage:
    return dataclasses.replace(wire, correlation_id=correlation_id)


def pika_properties(wire: WireMessage) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        headers=wire.headers,
        correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
        priority=wire.priority,
        delivery_mode=wire.delivery_mode,
    )


def raw_worker_args(module: str, subcommand: str) -> tuple[str, str] | None:
    """``(broker, queue)`` when this process is ``python -m <module> <subcommand> --broker URL
    --queue Q`` (a raw worker, started by ``RawSubject.worker`` or ``bench.latency_split``)."""
    if sys.argv[1:2] != [subcommand]:
        return None
    parser = argparse.ArgumentParser(prog=f"python -m {module} {subcommand}")
    parser.add_argument("--broker", required=True)
    parser.add_argument("--queue", required=True)
    args = parser.parse_args(sys.argv[2:])
    return args.broker, args.queue


Producer = Callable[[str, str, int, WireMessage], Produced]
# ``(url, queue, reply_queue, calls)``: the timed calls' durations in ms, after ``WARMUP_CALLS``.
RoundTrip = Callable[[str, str, QueueSpec, int], list[float]]


class RawSubject:
    """A ``bench.scenarios.Subject`` around one AMQP library: ``module`` runs its consumer
    (``python -m <module> consume --broker URL --queue Q``), ``producer`` publishes and
    ``round_trip`` makes the calls."""

    def __init__(self, url: str, *, module: str, producer: Producer, round_trip: RoundTrip) -> None:
        self._url = url
        self._module = module
        self._producer = producer
        self._round_trip = round_trip

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
        replies = reply_queue(queue)
        try:
            return self._round_trip(self._url, queue, replies, calls)
        finally:
            delete(self._url, [replies.name])  # bench.compare deletes the task queue
