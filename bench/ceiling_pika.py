"""The ceiling with raw pika: ``python -m bench.ceiling_pika SCENARIO ...`` (or ``consume``, its worker).

Publishing uses a ``SelectConnection`` (``BlockingConnection`` waits for each confirm), keeping
up to ``CONFIRM_WINDOW`` messages unconfirmed; consuming uses a ``BlockingConnection``, which
answers a message with a ``reply_to`` on a second channel in confirm mode (each reply's confirm
awaited before the ack, as our worker does).

The round trip's client is a ``BlockingConnection`` too, with one channel that publishes each call
and consumes the reply queue (no acks). That channel is *not* in confirm mode: in
``BlockingConnection`` confirm mode makes ``basic_publish`` wait for the broker's confirm, a wait
our client's pipelined confirms do not have, so the raw pika round trip skips confirms altogether
(slightly less work than ours; the aio-pika ceiling keeps them, pipelined).
"""

from __future__ import annotations

import sys
import time

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.channel import Channel
from pika.frame import Method
from pika.spec import Basic, BasicProperties

from bench import driver
from bench.ceiling import (
    CALL_TIMEOUT_S,
    CONFIRM_WINDOW,
    PREFETCH,
    RawSubject,
    our_call_message,
    our_result_message,
    pika_properties,
    raw_worker_args,
    with_correlation_id,
)
from bench.scenarios import WARMUP_CALLS, Produced
from broker_svc.connection.pika_internals import underlying_channel
from broker_svc.topology import QueueSpec
from broker_svc.wire.ids import uuid4_str
from broker_svc.wire.task.task_message import WireMessage

SYSTEM = "pika"


class _PipelinedPublisher:
    """Publish ``count`` messages (after one warm-up) with confirms, ``CONFIRM_WINDOW`` in flight."""

    _connection: pika.SelectConnection

    def __init__(self, url: str, queue: str, count: int, wire: WireMessage) -> None:
        self._params = pika.URLParameters(url)
        self._queue = queue
        self._total = count + 1  # the first one, confirmed before the clock starts, warms up
        self._body = wire.body
        self._properties = pika_properties(wire)
        self._published = self._confirmed = 0
        self._started = self._handed = self._done = 0.0
        self._error: str | None = None
        self._channel: Channel | None = None

    def run(self) -> Produced:
        """Raises: RuntimeError: the broker refused a message or closed the connection."""
        self._connection = pika.SelectConnection(
            self._params,
            on_open_callback=lambda conn: conn.channel(on_open_callback=self._on_channel),
            on_open_error_callback=self._on_open_error,
            on_close_callback=lambda conn, _exc: conn.ioloop.stop(),
        )
        self._connection.ioloop.start()
        if self._error is not None:
            raise RuntimeError(self._error)
        return Produced(self._started, self._handed, self._done)

    def _on_open_error(self, connection: pika.SelectConnection, error: BaseException | str) -> None:
        self._error = f"cannot connect: {error}"
        connection.ioloop.stop()

    def _on_channel(self, channel: Channel) -> None:
        self._channel = channel
        channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self._declare())

    def _declare(self) -> None:
        assert self._channel is not None
        self._channel.queue_declare(self._queue, durable=True, callback=lambda _frame: self._publish(1))

    def _publish(self, upto: int) -> None:
        assert self._channel is not None
        while self._published < min(upto, self._total):
            self._channel.basic_publish("", self._queue, self._body, self._properties)
            self._published += 1
        if self._published == self._total and not self._handed:
            self._handed = time.perf_counter()

    def _on_confirm(self, frame: Method[Basic.Ack | Basic.Nack]) -> None:
        method = frame.method
        if isinstance(method, Basic.Nack):
            self._error = f"the broker refused message {method.delivery_tag}"
            self._connection.close()
            return
        self._confirmed = method.delivery_tag if method.multiple else self._confirmed + 1
        if self._confirmed == 1 and not self._started:
            self._started = time.perf_counter()
        if self._confirmed >= self._total:
            self._done = time.perf_counter()
            self._connection.close()
        else:
            self._publish(self._confirmed + CONFIRM_WINDOW)


def produce(url: str, queue: str, count: int, wire: WireMessage) -> Produced:
    return _PipelinedPublisher(url, queue, count, wire).run()


def round_trip(
    url: str, queue: str, replies: QueueSpec, calls: int, *, fresh_ids: bool = False, confirms: bool = False
) -> list[float]:
    """``WARMUP_CALLS`` then ``calls`` calls in a row: publish, wait for the reply; each in ms.

    The ceiling sends our call message encoded once, with a fresh ``correlation_id`` per call.
    With ``fresh_ids`` each call is encoded in the timed part for a task id of its own, as our
    client does, so that our worker can answer it too (``bench.latency_split``). With ``confirms``
    the channel is in confirm mode and the confirms are read as they come, never waited for (as
    our client's pipelined confirms; ``BlockingChannel.confirm_delivery`` would wait for each).

    Raises:
        TimeoutError: a reply did not come within ``CALL_TIMEOUT_S``.
    """
    once = our_call_message(replies.name)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.queue_declare(replies.name, durable=replies.durable, arguments=replies.arguments)
        arrived: set[str] = set()

        def on_reply(
            _ch: BlockingChannel, _method: Basic.Deliver, props: BasicProperties, _body: bytes
        ) -> None:
            if props.correlation_id is not None:
                arrived.add(props.correlation_id)

        channel.basic_consume(replies.name, on_reply, auto_ack=True)
        confirmed: list[int] = []
        if confirms:
            impl = underlying_channel(channel)
            if impl is None:
                raise RuntimeError("pika's BlockingChannel no longer wraps a Channel: no confirm mode")
            impl.confirm_delivery(ack_nack_callback=lambda frame: confirmed.append(frame.method.delivery_tag))
            connection.process_data_events(time_limit=1)  # its confirm.select-ok
        samples = []
        for i in range(WARMUP_CALLS + calls):
            started = time.perf_counter()
            if fresh_ids:
                wire = our_call_message(replies.name)
                correlation_id = str(wire.correlation_id)
            else:
                correlation_id = uuid4_str()
                wire = with_correlation_id(once, correlation_id)
            channel.basic_publish("", queue, wire.body, pika_properties(wire), mandatory=True)
            deadline = started + CALL_TIMEOUT_S
            while correlation_id not in arrived:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise TimeoutError(f"no reply to call {i} within {CALL_TIMEOUT_S} s")
                connection.process_data_events(time_limit=remaining)
            arrived.discard(correlation_id)
            if i >= WARMUP_CALLS:
                samples.append((time.perf_counter() - started) * 1000)
        if confirms and not confirmed:
            raise RuntimeError("confirm mode was set, yet no confirm came")
        return samples
    finally:
        if connection.is_open:
            connection.close()


def consume(url: str, queue: str) -> None:
    """Ack every message of ``queue`` until killed (SIGTERM's default action ends it); first
    answer one with a ``reply_to`` (the round trip), confirmed."""
    reply = our_result_message()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    replies = connection.channel()
    replies.confirm_delivery()  # basic_publish returns once confirmed, as our worker waits
    channel.basic_qos(prefetch_count=PREFETCH)
    channel.queue_declare(queue, durable=True)

    def on_message(ch: BlockingChannel, method: Basic.Deliver, props: BasicProperties, _body: bytes) -> None:
        if props.reply_to:
            properties = pika_properties(with_correlation_id(reply, props.correlation_id))
            try:
                replies.basic_publish("", props.reply_to, reply.body, properties, mandatory=True)
            except pika.exceptions.UnroutableError:
                pass  # its client and reply queue are gone: dropped, as our worker does
        ch.basic_ack(method.delivery_tag)

    channel.basic_consume(queue, on_message)
    channel.start_consuming()


def main() -> int:
    raw = raw_worker_args("bench.ceiling_pika", "consume")
    if raw is not None:
        consume(*raw)
        return 0
    return driver.main(
        SYSTEM,
        lambda job: RawSubject(
            job.broker_url, module="bench.ceiling_pika", producer=produce, round_trip=round_trip
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
