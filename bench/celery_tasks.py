"""A Celery app for the side-by-side control-plane figures (the peer we are compared with)."""

from __future__ import annotations

import os
import time

from celery import Celery

app = Celery("bench", broker=os.environ.get("BENCH_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.update(result_backend="rpc://", accept_content=["json", "msgpack"], worker_hijack_root_logger=False)


@app.task(name="bench.tasks.noop")  # type: ignore[untyped-decorator]
def noop() -> None:
    return None


@app.task(name="bench.tasks.timed")  # type: ignore[untyped-decorator]
def timed(seconds: float) -> list[float]:
    started = time.time()
    time.sleep(seconds)
    return [started, time.time()]
