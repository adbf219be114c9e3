"""The ceiling with raw aio-pika: ``python -m bench.ceiling_aio_pika SCENARIO ...`` (or ``consume``).

Publishing keeps up to ``CONFIRM_WINDOW`` confirms awaited at once; consuming acks each message.
Both run on uvloop when it is installed, as our worker does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any

import aio_pika

from bench import driver
from bench.ceiling import CONFIRM_WINDOW, PREFETCH, RawSubject
from bench.scenarios import Produced
from broker_svc.message import WireMessage

SYSTEM = "aio-pika"


def _message(wire: WireMessage) -> aio_pika.Message:
    return aio_pika.Message(
        wire.body,
        headers=wire.headers,
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        correlation_id=wire.correlation_id,
        priority=wire.priority,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
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


async def _consume(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        declared = await channel.declare_queue(queue, durable=True)
        async with declared.iterator() as messages:
            async for message in messages:
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


def main() -> int:
    if sys.argv[1:2] == ["consume"]:
        parser = argparse.ArgumentParser(prog="python -m bench.ceiling_aio_pika consume")
        parser.add_argument("--broker", required=True)
        parser.add_argument("--queue", required=True)
        args = parser.parse_args(sys.argv[2:])
        _run(_consume(args.broker, args.queue))  # until SIGTERM's default action ends it
        return 0
    return driver.main(
        SYSTEM, lambda job: RawSubject(job.broker_url, module="bench.ceiling_aio_pika", producer=produce)
    )


if __name__ == "__main__":
    sys.exit(main())
