"""Declaring topology specs over aio-pika (async): a queue with its exchange and binding.

One place for the worker's task queues, the mailbox node's queue, the reply queue of in-worker
broadcasts and the members stream; the flags come from ``QueueSpec.declare_options()``, as for the
pika declarers (a difference from Celery's own declaration is a 406 from RabbitMQ).
"""

from __future__ import annotations

import aio_pika
import aio_pika.abc

from broker_svc.topology import QueueSpec

__all__ = ["declare_queue"]


async def declare_queue(channel: aio_pika.abc.AbstractChannel, spec: QueueSpec) -> aio_pika.abc.AbstractQueue:
    """Declare ``spec``'s queue and, when it names one, its exchange and the binding."""
    queue = await channel.declare_queue(spec.name, **spec.declare_options())
    if spec.exchange is not None:
        exchange = await channel.declare_exchange(
            spec.exchange.name,
            type=aio_pika.ExchangeType(spec.exchange.type),
            **spec.exchange.declare_options(),
        )
        await queue.bind(exchange, routing_key=spec.routing_key)
    return queue
