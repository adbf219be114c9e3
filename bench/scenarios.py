"""The scenarios, written once for every system (stdlib and pika only: runs in both venvs).

A system is a ``Subject``: how to start its worker, fill a queue fast (untimed), produce with its
own client and confirms (timed), and call one task and wait for its result. What is timed is seen
from the broker (``bench.queues``), the same way for everyone.
"""

from __future__ import annotations

import subprocess
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from bench.procs import Memory, memory, tree
from bench.queues import Depth, QueueProbe, probe
from bench.stats import latency_ms

SLEEP_S = 0.01  # the body of the "sleep" task
WARMUP_CALLS = 50  # round trips before the timed ones (connections, result consumers, children)
MEMORY_SETTLE_S = 2.0  # an idle worker is measured this long after it started consuming
MEMORY_SAMPLE_S = 0.2


class Task(StrEnum):
    NOOP = "noop"
    SLEEP = "sleep"  # time.sleep(SLEEP_S)


class Shape(StrEnum):
    """How a worker is started: ``pair`` is two worker processes (the settings of every scenario but
    one); ``wide`` is as many concurrent tasks as the system sensibly runs, for sleeping tasks."""

    PAIR = "pair"
    WIDE = "wide"


@dataclass(frozen=True, slots=True)
class Produced:
    """``perf_counter`` stamps of a timed production: first call, last call returned, all confirmed."""

    started: float
    handed: float
    confirmed: float


class Subject(Protocol):
    """One system under test, on one broker URL."""

    def worker(self, queue: str, shape: Shape) -> AbstractContextManager[subprocess.Popen[bytes]]:
        """Start a worker on ``queue``; yield once started (consuming or about to); stop it on exit."""
        ...

    def consumers(self, shape: Shape) -> int:
        """How many AMQP consumers a started worker of this shape has on its queue."""
        ...

    def fill(self, queue: str, count: int, task: Task, *, wait_queued: bool = True) -> None:
        """Put ``count`` tasks in ``queue`` as this system's client would (untimed, any fast way);
        with ``wait_queued``, return once the broker holds them all (no worker is consuming)."""
        ...

    def produce(self, queue: str, count: int) -> Produced:
        """Send ``count`` no-op tasks with this system's own client and publisher confirms.

        Connecting and declaring (one warm-up message) come before ``started``.
        """
        ...

    def round_trip(self, queue: str, calls: int) -> list[float]:
        """Call a no-op task and wait for its result ``calls`` times in a row; return each in ms."""
        ...


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _started(
    queue_probe: QueueProbe, subject: Subject, queue: str, shape: Shape, proc: subprocess.Popen[bytes]
) -> None:
    wanted = subject.consumers(shape)
    queue_probe.wait(
        queue, lambda d: d.consumers >= wanted, timeout_s=120, what="worker start", alive=lambda: _alive(proc)
    )


def _drain(
    subject: Subject, url: str, queue: str, count: int, task: Task, shape: Shape, timeout_s: float
) -> dict[str, float]:
    subject.fill(queue, count, task)
    wanted = subject.consumers(shape)
    with probe(url) as queue_probe:
        full = queue_probe.depth(queue).ready
        with subject.worker(queue, shape) as proc:
            # The clock starts when the broker is seen handing messages out with every consumer of
            # the worker on the queue (a worker whose 50 threads each connect would otherwise be
            # timed while it starts), and stops when none is left ready; the rate counts what was
            # delivered in between. In steady state that is what was done: the prefetch in flight
            # at either end is the same (a few dozen deliveries; 200 for Celery's 50 threads).
            began, first = queue_probe.wait(
                queue,
                lambda d: d.ready < full and d.consumers >= wanted,
                timeout_s=120,
                what="first delivery with every consumer",
                alive=lambda: _alive(proc),
            )
            ended, _ = queue_probe.wait(
                queue, lambda d: d.ready == 0, timeout_s=timeout_s, what="drain", alive=lambda: _alive(proc)
            )
    if first.ready == 0:
        raise RuntimeError(f"{count} tasks were gone before the first poll: too few to time")
    seconds = ended - began
    return {"tasks_per_s": round(first.ready / seconds, 1), "seconds": round(seconds, 3), "tasks": count}


def drain(subject: Subject, url: str, queue: str, count: int, timeout_s: float) -> dict[str, float]:
    """Drain ``count`` queued no-op tasks with two worker processes (ack after the task ran)."""
    return _drain(subject, url, queue, count, Task.NOOP, Shape.PAIR, timeout_s)


def sleepers(subject: Subject, url: str, queue: str, count: int, timeout_s: float) -> dict[str, float]:
    """Drain ``count`` queued tasks that each sleep ``SLEEP_S``, with the ``wide`` worker."""
    return _drain(subject, url, queue, count, Task.SLEEP, Shape.WIDE, timeout_s)


def enqueue(subject: Subject, queue: str, count: int) -> dict[str, float]:
    """Send ``count`` no-op tasks with confirms, no worker running."""
    produced = subject.produce(queue, count)
    return {
        "confirmed_per_s": round(count / (produced.confirmed - produced.started), 1),
        "calls_per_s": round(count / (produced.handed - produced.started), 1),
        "tasks": count,
    }


def end_to_end(subject: Subject, url: str, queue: str, count: int, timeout_s: float) -> dict[str, float]:
    """Send ``count`` no-op tasks while a started worker (two processes) runs them: until none is left."""
    with probe(url) as queue_probe, subject.worker(queue, Shape.PAIR) as proc:
        _started(queue_probe, subject, queue, Shape.PAIR, proc)
        produced = subject.produce(queue, count)
        ended, _ = queue_probe.wait(
            queue, lambda d: d.ready == 0, timeout_s=timeout_s, what="drain", alive=lambda: _alive(proc)
        )
    seconds = ended - produced.started
    return {"tasks_per_s": round(count / seconds, 1), "seconds": round(seconds, 3), "tasks": count}


def round_trip(subject: Subject, url: str, queue: str, calls: int) -> dict[str, float]:
    """p50/p99 of ``calls`` sequential calls with their result, on a warm two-process worker."""
    with probe(url) as queue_probe, subject.worker(queue, Shape.PAIR) as proc:
        _started(queue_probe, subject, queue, Shape.PAIR, proc)
        samples = subject.round_trip(queue, calls)
    return {**latency_ms(samples), "calls": calls}


def worker_memory(subject: Subject, url: str, queue: str, count: int, timeout_s: float) -> dict[str, float]:
    """Memory of a two-process worker's whole process tree: idle, then the peak while it drains
    ``count`` no-op tasks sent to it while it runs."""
    with probe(url) as queue_probe, subject.worker(queue, Shape.PAIR) as proc:
        _started(queue_probe, subject, queue, Shape.PAIR, proc)
        time.sleep(MEMORY_SETTLE_S)
        idle = memory(tree(proc.pid))
        peak: list[Memory] = [idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(MEMORY_SAMPLE_S):
                now = memory(tree(proc.pid))
                peak[0] = Memory(
                    max(peak[0].rss_mib, now.rss_mib), max(peak[0].pss_mib, now.pss_mib), now.processes
                )

        sampler = threading.Thread(target=sample, name="memory-sampler", daemon=True)
        sampler.start()
        try:
            subject.fill(queue, count, Task.NOOP, wait_queued=False)
            queue_probe.wait(
                queue, _empty, timeout_s=timeout_s, what="drain under load", alive=lambda: _alive(proc)
            )
        finally:
            stop.set()
            sampler.join()
    return {
        "idle_pss_mib": idle.pss_mib,
        "idle_rss_mib": idle.rss_mib,
        "load_pss_mib": peak[0].pss_mib,
        "load_rss_mib": peak[0].rss_mib,
        "processes": idle.processes,
        "tasks": count,
    }


def _empty(depth: Depth) -> bool:
    return depth.ready == 0
