"""The Dramatiq actors of the side-by-side benchmarks (``dramatiq bench.peers.dramatiq_app``).

As for any Dramatiq module, importing it sets the global broker, so it is an entry point: the
broker URL comes from ``$BENCH_BROKER_URL`` and the queue from ``$BENCH_QUEUE`` (a Dramatiq actor's
queue is fixed when it is defined). ``RabbitmqBroker(confirm_delivery=True)``; messages are
persistent (Dramatiq always sends delivery mode 2); default middleware.

Dramatiq's Results middleware has Redis and Memcached backends only, none on RabbitMQ, so ``reply``
publishes its result to the caller's reply queue itself (what Celery's rpc:// backend does).
"""

from __future__ import annotations

import os
import time

import dramatiq  # type: ignore[import-not-found]
from dramatiq.brokers.rabbitmq import RabbitmqBroker  # type: ignore[import-not-found]

QUEUE = os.environ.get("BENCH_QUEUE", "bench_default")

broker = RabbitmqBroker(
    url=os.environ.get("BENCH_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"), confirm_delivery=True
)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, actor_name="noop")  # type: ignore[untyped-decorator]
def noop() -> None:
    return None


@dramatiq.actor(queue_name=QUEUE, actor_name="sleep")  # type: ignore[untyped-decorator]
def sleep(seconds: float) -> None:
    time.sleep(seconds)


@dramatiq.actor(queue_name=QUEUE, actor_name="reply")  # type: ignore[untyped-decorator]
def reply(reply_to: str, token: str) -> None:
    """The round-trip task: a no-op that sends ``token`` back on the worker thread's channel."""
    broker.channel.basic_publish(exchange="", routing_key=reply_to, body=token.encode())
