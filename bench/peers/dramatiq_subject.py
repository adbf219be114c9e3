"""Dramatiq as a benchmark subject (peers' venv): ``python -m bench.peers.dramatiq_subject SCENARIO ...``.

Workers: ``dramatiq -p 2 -t 8`` (``pair``: the settings of the reference figures), ``-p 2 -t 25``
(``wide``: 50 threads), at Dramatiq's default log level (INFO; it logs nothing per task). The
client is the actor's own ``send()`` with ``confirm_delivery=True`` (each send waits for its confirm).
"""

from __future__ import annotations

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

SYSTEM = "dramatiq"
ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2
PAIR_THREADS = 8
WIDE_THREADS = 50  # over both processes


class DramatiqSubject:
    """The ``bench.scenarios.Subject`` for Dramatiq with ``bench.peers.dramatiq_app``."""

    def __init__(self, url: str, queue: str, *, wide: int = 0) -> None:
        self._url = url
        self._wide = wide or WIDE_THREADS
        # The actors' queue is fixed when the module is imported, just below.
        os.environ.update(BENCH_BROKER_URL=url, BENCH_QUEUE=queue)
        self._env = {**os.environ, "PYTHONPATH": str(ROOT)}
        from bench.peers import dramatiq_app

        self._actors: ModuleType = dramatiq_app

    @contextmanager
    def worker(self, queue: str, shape: Shape) -> Iterator[Popen[bytes]]:
        threads = PAIR_THREADS if shape is Shape.PAIR else max(1, self._wide // PROCESSES)
        cmd = [sys.executable, "-m", "dramatiq", "bench.peers.dramatiq_app",
               "-p", str(PROCESSES), "-t", str(threads), "-Q", queue]  # fmt: skip
        with running(cmd, env=self._env, cwd=ROOT) as proc:
            yield proc

    def consumers(self, shape: Shape) -> int:
        return PROCESSES  # each process consumes the queue (and its delay queue)

    def fill(self, queue: str, count: int, task: Task, *, wait_queued: bool = True) -> None:
        from dramatiq import Message  # type: ignore[import-not-found]

        actor: Any = self._actors.noop if task is Task.NOOP else self._actors.sleep
        args = () if task is Task.NOOP else (SLEEP_S,)
        actor.send(*args)  # Dramatiq declares the queue (with its dead-letter arguments) itself
        properties = pika.BasicProperties(delivery_mode=2)

        def messages() -> Iterator[RawMessage]:
            for _ in range(count - 1):
                message = Message(
                    queue_name=queue, actor_name=actor.actor_name, args=args, kwargs={}, options={}
                )
                yield RawMessage(message.encode(), properties)

        publish_raw(self._url, queue, messages(), wait_queued=wait_queued)

    def produce(self, queue: str, count: int) -> Produced:
        noop: Any = self._actors.noop
        noop.send()  # connect and declare first
        started = time.perf_counter()
        for _ in range(count):
            noop.send()  # returns once the broker confirmed it
        done = time.perf_counter()
        return Produced(started, done, done)

    def round_trip(self, queue: str, calls: int) -> list[float]:
        reply: Any = self._actors.reply
        connection = pika.BlockingConnection(pika.URLParameters(self._url))
        try:
            channel = connection.channel()
            reply_queue = channel.queue_declare("", exclusive=True).method.queue
            replies = channel.consume(reply_queue, auto_ack=True, inactivity_timeout=30)
            samples = []
            for i in range(WARMUP_CALLS + calls):
                token = uuid.uuid4().hex
                started = time.perf_counter()
                reply.send(reply_queue, token)
                _, _, body = next(replies)
                if body != token.encode():
                    raise RuntimeError(f"reply {body!r} is not {token!r}")
                if i >= WARMUP_CALLS:  # the first ones warm the worker and the reply path
                    samples.append((time.perf_counter() - started) * 1000)
        finally:
            connection.close()
        return samples


def main() -> int:
    return driver.main(SYSTEM, _make)


def _make(job: Job) -> DramatiqSubject:
    return DramatiqSubject(job.broker_url, job.queue, wide=job.wide)


if __name__ == "__main__":
    sys.exit(main())
