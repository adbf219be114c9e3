"""The asyncio client under load: ``python -m bench.async_client``.

One worker (``-c 2``) on a fresh queue of the broker at ``$CLOCKWORK_BROKER_URL``; ``--tasks``
tasks (``bench.tasks.noop``, results on) sent and their results awaited, three ways, in one run:

- ``asyncio (pushed)``: ``AsyncApp``; one coroutine per task, all started at once, each
  ``await aapp.delay(noop)`` (its own confirm) then ``await result.get()`` (a future resolved by
  the reply-queue consumer);
- ``blocking (pipelined)``: ``App``; every ``delay()`` first (pipelined confirms), then each
  ``get()`` in order. A task's latency ends when its ``get()`` returns, so a task that finished
  while an earlier one was waited for counts the wait: an upper bound;
- ``asyncio, polled every 0.2 s``: the same ``AsyncApp`` sends, but each coroutine looks at its
  result every 0.2 s (``ready()``, then ``asyncio.sleep(0.2)``), as taskiq's ``wait_result``
  polls its result backend; the figure a polling client gets, with our broker and worker.

Throughput is tasks per second from the first send to the last result; latency is per task, from
the start of its send to its result in hand (p50, p99); client CPU is this process's CPU time
per task (the worker shares the machine's cores with it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Callable

from bench.spine import drop_queue, worker
from broker_svc import App, Settings
from broker_svc.aio import AsyncApp
from broker_svc.settings import DEFAULT_BROKER_URL

POLL_S = 0.2


def _client(url: str, queue: str) -> App:
    app = App("bench-aio", settings=Settings(broker_url=url, default_queue=queue), set_as_current=False)
    app.task(name="bench.tasks.noop")(lambda: None)
    return app


async def _pushed(app: App, tasks: int) -> tuple[float, list[float]]:
    async with AsyncApp(app) as aapp:
        noop = app.tasks["bench.tasks.noop"]
        await (await aapp.delay(noop)).get(timeout=60)  # connected and declared before timing

        async def one() -> float:
            started = time.perf_counter()
            result = await aapp.delay(noop)
            await result.get(timeout=600)
            return time.perf_counter() - started

        began = time.perf_counter()
        latencies = await asyncio.gather(*(one() for _ in range(tasks)))
        return time.perf_counter() - began, list(latencies)


async def _polled(app: App, tasks: int) -> tuple[float, list[float]]:
    async with AsyncApp(app) as aapp:
        noop = app.tasks["bench.tasks.noop"]
        await (await aapp.delay(noop)).get(timeout=60)

        async def one() -> float:
            started = time.perf_counter()
            result = await aapp.delay(noop)
            # The polling client's loop, on purpose: what this way measures.
            while not result.ready():  # noqa: ASYNC110
                await asyncio.sleep(POLL_S)
            return time.perf_counter() - started

        began = time.perf_counter()
        latencies = await asyncio.gather(*(one() for _ in range(tasks)))
        return time.perf_counter() - began, list(latencies)


def _blocking(app: App, tasks: int) -> tuple[float, list[float]]:
    noop = app.tasks["bench.tasks.noop"]
    noop.delay().get(timeout=60)
    began = time.perf_counter()
    sent = []
    for _ in range(tasks):
        sent.append((time.perf_counter(), noop.delay()))
    latencies = []
    for started, result in sent:
        result.get(timeout=600)
        latencies.append(time.perf_counter() - started)
    return time.perf_counter() - began, latencies


def _row(name: str, tasks: int, elapsed: float, latencies: list[float], cpu_s: float) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{name:30} {tasks / elapsed:>10,.0f} {1000 * p50:>10,.1f} {1000 * p99:>10,.1f}"
        f" {1e6 * cpu_s / tasks:>14,.0f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per way")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's -c")
    args = parser.parse_args()
    url = os.environ.get("CLOCKWORK_BROKER_URL") or DEFAULT_BROKER_URL
    queue = f"bench-aio-{uuid.uuid4().hex[:8]}"
    ways: list[tuple[str, Callable[[App, int], tuple[float, list[float]]]]] = [
        ("asyncio (pushed)", lambda app, n: asyncio.run(_pushed(app, n))),
        ("blocking (pipelined)", _blocking),
        (f"asyncio, polled every {POLL_S} s", lambda app, n: asyncio.run(_polled(app, n))),
    ]
    print(f"{args.tasks:,} tasks per way, one worker -c {args.concurrency}, {os.cpu_count()} CPUs")
    print(f"{'way':30} {'tasks/s':>10} {'p50 ms':>10} {'p99 ms':>10} {'client CPU µs':>14}")
    try:
        with worker(url, queue, args.concurrency):
            for name, run in ways:
                app = _client(url, queue)
                cpu = time.process_time()
                try:
                    elapsed, latencies = run(app, args.tasks)
                    cpu = time.process_time() - cpu
                finally:
                    app.close(timeout=60)
                print(_row(name, args.tasks, elapsed, latencies, cpu), flush=True)
    finally:
        drop_queue(url, queue)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
