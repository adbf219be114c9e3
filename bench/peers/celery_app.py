"""The Celery app of the side-by-side benchmarks (``celery -A bench.peers.celery_app worker``).

As for any Celery app, its module is an entry point: the broker URL comes from
``$BENCH_BROKER_URL``. Settings: rpc:// results, ``acks_late``, persistent messages (Celery's
default delivery mode) and publisher confirms (``confirm_publish``, so each send waits for its
confirm); everything else is Celery's default (prefetch multiplier 4, JSON).
"""

from __future__ import annotations

import os
import time

from celery import Celery

app = Celery("bench-peer", broker=os.environ.get("BENCH_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.update(
    result_backend="rpc://",
    task_acks_late=True,
    task_default_delivery_mode="persistent",
    broker_transport_options={"confirm_publish": True},
    broker_connection_retry_on_startup=True,
)


@app.task(name="bench.peers.noop", ignore_result=True)  # type: ignore[untyped-decorator]
def noop() -> None:
    return None


@app.task(name="bench.peers.sleep", ignore_result=True)  # type: ignore[untyped-decorator]
def sleep(seconds: float) -> None:
    time.sleep(seconds)


@app.task(name="bench.peers.echo")  # type: ignore[untyped-decorator]
def echo() -> None:
    """The round-trip task: a no-op whose (None) result goes back through rpc://."""
    return None
