"""The ceiling with raw aio-pika: ``python -m bench.ceiling_aio_pika SCENARIO ...`` (or ``consume``).

Publishing keeps up to ``CONFIRM_WINDOW`` confirms awaited at once; consuming acks each message,
first answering one with a ``reply_to`` on a second channel in confirm mode (the reply's confirm
awaited before the ack, as our worker does). Everything runs on uvloop when it is installed (the
ceiling of what aio-pika can do; our worker's main process, out of the task path, does not use it).

The round trip's client has one channel in confirm mode that publishes each call and consumes the
reply queue (no acks). Confirms are pipelined as our client's: each call's publish is a task of
its own and the call waits only for its reply; confirms are collected as they come (a nack fails
the measurement) and all are awaited after the last call.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

import aio_pika
import aio_pika.abc

from bench import driver
from bench.ceiling import (
    CALL_TIMEOUT_S,
    CONFIRM_WINDOW,
    PREFETCH,
    RawSubject,
    our_call_message,
    our_result_message,
    raw_worker_args,
    with_correlation_id,
)
from bench.scenarios import WARMUP_CALLS, Produced
from broker_svc.topology import QueueSpec
from broker_svc.wire.ids import uuid4_str
from broker_svc.wire.task.task_message import WireMessage

SYSTEM = "aio-pika"


def _message(wire: WireMessage) -> aio_pika.Message:
    return aio_pika.Message(
        wire.body,
        headers=wire.headers,
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
        priority=wire.priority,
        delivery_mode=aio_pika.DeliveryMode(wire.delivery_mode),
    )


async def _produce(url: str, queue: str, count: int, wire: WireMessage) -> Produced:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        exchange = channel.default_exchange
        await exchange.publish(_message(wire), routing_key=queue)  # connect and declare first
        window = asyncio.Semaphore(CONFIRM_WINDOW)

        async def publish() -> None:
            try:
                await exchange.publish(_message(wire), routing_key=queue)  # returns once confirmed
            finally:
                window.release()

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(count):
                await window.acquire()
                group.create_task(publish())
            handed = time.perf_counter()
        return Produced(started, handed, time.perf_counter())


async def _round_trip(url: str, queue: str, replies: QueueSpec, calls: int) -> list[float]:
    wire = our_call_message(replies.name)
    loop = asyncio.get_running_loop()
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        future = waiting.pop(message.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_result(None)

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        reply_queue = await channel.declare_queue(
            replies.name, durable=replies.durable, arguments=replies.arguments
        )
        await reply_queue.consume(on_reply, no_ack=True)
        exchange = channel.default_exchange
        unconfirmed: deque[asyncio.Task[Any]] = deque()
        samples = []
        try:
            for i in range(WARMUP_CALLS + calls):
                correlation_id = uuid4_str()
                reply = waiting[correlation_id] = loop.create_future()
                started = time.perf_counter()
                message = _message(with_correlation_id(wire, correlation_id))
                unconfirmed.append(asyncio.create_task(exchange.publish(message, routing_key=queue)))
                try:
                    async with asyncio.timeout(CALL_TIMEOUT_S):
                        await reply
                except TimeoutError:
                    raise TimeoutError(f"no reply to call {i} within {CALL_TIMEOUT_S} s") from None
                if i >= WARMUP_CALLS:
                    samples.append((time.perf_counter() - started) * 1000)
                while unconfirmed and unconfirmed[0].done():
                    unconfirmed.popleft().result()  # raises a nack (DeliveryError)
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await asyncio.gather(*unconfirmed)
        finally:
            for task in unconfirmed:
                task.cancel()
        return samples


async def _consume(url: str, queue: str) -> None:
    reply = our_result_message()
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        # Our worker publishes results on a confirm-mode channel of its own and awaits the confirm.
        replies = (await connection.channel(publisher_confirms=True)).default_exchange
        await channel.set_qos(prefetch_count=PREFETCH)
        declared = await channel.declare_queue(queue, durable=True)
        async with declared.iterator() as messages:
            async for message in messages:
                if message.reply_to:
                    answer = _message(with_correlation_id(reply, message.correlation_id))
                    # Returns once confirmed; an unroutable reply (client gone) comes back, dropped.
                    await replies.publish(answer, routing_key=message.reply_to)
                await message.ack()


def _run(main: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def produce(url: str, queue: str, count: int, wire: WireMessage) -> Produced:
    produced: Produced = _run(_produce(url, queue, count, wire))
    return produced


def round_trip(url: str, queue: str, replies: QueueSpec, calls: int) -> list[float]:
    """``WARMUP_CALLS`` then ``calls`` calls in a row: publish, wait for the reply; each in ms.

    Raises:
        TimeoutError: a reply did not come within ``CALL_TIMEOUT_S``.
        aio_pika.exceptions.DeliveryError: the broker refused a call.
    """
    samples: list[float] = _run(_round_trip(url, queue, replies, calls))
    return samples


def main() -> int:
    raw = raw_worker_args("bench.ceiling_aio_pika", "consume")
    if raw is not None:
        _run(_consume(*raw))  # until SIGTERM's default action ends it
        return 0
    return driver.main(
        SYSTEM,
        lambda job: RawSubject(
            job.broker_url, module="bench.ceiling_aio_pika", producer=produce, round_trip=round_trip
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
