"""Celery 5 as a benchmark subject (peers' venv): ``python -m bench.peers.celery_subject SCENARIO ...``.

Workers: ``celery worker -P prefork -c 2`` (``pair``), ``-P threads -c 50`` (``wide``: gevent is
not installed, and threads are what Celery ships for I/O-bound tasks), at INFO, without mingle
and gossip (start-up costs). The client is the app's own ``apply_async`` with ``confirm_publish``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen
from types import ModuleType
from typing import Any

import pika

from bench import driver
from bench.driver import Job
from bench.procs import running
from bench.queues import RawMessage, publish_raw
from bench.scenarios import SLEEP_S, WARMUP_CALLS, Produced, Shape, Task

SYSTEM = "celery"
ROOT = Path(__file__).resolve().parents[2]
WIDE_THREADS = 50


class CelerySubject:
    """The ``bench.scenarios.Subject`` for Celery with ``bench.peers.celery_app``."""

    def __init__(self, url: str, *, wide: int = 0) -> None:
        self._url = url
        self._wide = wide or WIDE_THREADS
        self._env = {**os.environ, "BENCH_BROKER_URL": url, "PYTHONPATH": str(ROOT)}
        os.environ["BENCH_BROKER_URL"] = url  # read when the app module is imported, just below
        from bench.peers import celery_app

        self._tasks: ModuleType = celery_app

    @contextmanager
    def worker(self, queue: str, shape: Shape) -> Iterator[Popen[bytes]]:
        pool = (
            ["-P", "prefork", "-c", "2"] if shape is Shape.PAIR else ["-P", "threads", "-c", str(self._wide)]
        )
        cmd = [sys.executable, "-m", "celery", "-A", "bench.peers.celery_app", "worker", *pool, "-Q", queue,
               "-n", f"{queue}@bench", "-l", "info", "--without-mingle", "--without-gossip"]  # fmt: skip
        with running(cmd, env=self._env, cwd=ROOT) as proc:
            yield proc

    def consumers(self, shape: Shape) -> int:
        return 1

    def _declare(self, queue: str) -> str:
        """Declare ``queue`` as Celery does (its worker repeats it); return the exchange it is bound to."""
        app: Any = self._tasks.app
        app.amqp.queues.select_add(queue)
        declaration = app.amqp.queues[queue]
        with app.connection_for_write() as connection:
            declaration(connection.default_channel).declare()
        return str(declaration.exchange.name)

    def fill(self, queue: str, count: int, task: Task, *, wait_queued: bool = True) -> None:
        exchange = self._declare(queue)
        app: Any = self._tasks.app
        name, args = ("bench.peers.noop", ()) if task is Task.NOOP else ("bench.peers.sleep", (SLEEP_S,))
        template = app.amqp.as_task_v2(str(uuid.uuid4()), name, args=args, kwargs={}, ignore_result=True)
        payload = json.dumps(template.body).encode()  # Celery's default serializer, on plain values

        def messages() -> Iterator[RawMessage]:
            for _ in range(count):
                task_id = str(uuid.uuid4())
                headers = {**template.headers, "id": task_id, "root_id": task_id}
                properties = pika.BasicProperties(
                    content_type="application/json", content_encoding="utf-8", headers=headers,
                    correlation_id=task_id, delivery_mode=2, priority=0,
                )  # fmt: skip
                yield RawMessage(payload, properties, exchange=exchange)

        publish_raw(self._url, queue, messages(), wait_queued=wait_queued)

    def produce(self, queue: str, count: int) -> Produced:
        noop: Any = self._tasks.noop
        noop.apply_async(queue=queue)  # connect and declare first
        started = time.perf_counter()
        for _ in range(count):
            noop.apply_async(queue=queue)  # returns once the broker confirmed it
        done = time.perf_counter()
        return Produced(started, done, done)

    def round_trip(self, queue: str, calls: int) -> list[float]:
        echo: Any = self._tasks.echo
        samples = []
        for i in range(WARMUP_CALLS + calls):
            started = time.perf_counter()
            echo.apply_async(queue=queue).get(timeout=30)
            if i >= WARMUP_CALLS:  # the first ones warm the worker and the result consumer
                samples.append((time.perf_counter() - started) * 1000)
        return samples


def main() -> int:
    return driver.main(SYSTEM, lambda job: _make(job))


def _make(job: Job) -> CelerySubject:
    return CelerySubject(job.broker_url, wide=job.wide)


if __name__ == "__main__":
    sys.exit(main())
