"""Spine figures: round-trip latency, delay() rate with confirms, drain throughput with -c 2.

Usage: ``python -m bench.spine [--broker URL]``. Prints one JSON line per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pika

from broker_svc import App, Settings
from broker_svc.logging import configure_logging
from broker_svc.tasks.task import Signature

NOOP = "bench.tasks.noop"


def worker_command(
    url: str, queue: str, concurrency: int, *, name: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The ``python -m worker`` command line of a benchmark worker at INFO; ``extra`` comes last
    (later options win)."""
    return [
        sys.executable, "-m", "worker", "-A", "bench.tasks:app", "-c", str(concurrency), "-Q", queue,
        "-b", url, "-l", "info", "-n", name or f"bench-{queue}@%h", *extra,
    ]  # fmt: skip


@contextmanager
def worker(
    url: str,
    queue: str,
    concurrency: int = 2,
    *,
    name: str | None = None,
    lines: list[bytes] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``python -m worker`` on ``queue``; yields once it logged ``worker_ready``.

    ``lines`` collects what it logged up to then (for figures the worker logs itself); ``extra``
    options follow ``$BENCH_WORKER_ARGS``.
    """
    options = [*os.environ.get("BENCH_WORKER_ARGS", "").split(), *extra]
    proc = subprocess.Popen(
        worker_command(url, queue, concurrency, name=name, extra=options),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        if b"worker_ready" in line:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not start")
    # Keep reading so the worker never blocks on a full pipe.
    subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def drop_queue(url: str, queue: str) -> None:
    params = pika.URLParameters(url)
    params.virtual_host = Settings(broker_url=url).virtual_host
    conn = pika.BlockingConnection(params)
    try:
        channel = conn.channel()
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.dead")
        channel.exchange_delete(queue)
    finally:
        conn.close()


def round_trip(url: str, calls: int = 500) -> dict[str, float]:
    queue = f"bench-rt-{uuid.uuid4().hex[:8]}"
    with App("bench-rt", settings=Settings(broker_url=url)) as app, worker(url, queue):
        for _ in range(50):  # warm up
            app.send_task(NOOP, queue=queue).get(timeout=30)
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            app.send_task(NOOP, queue=queue).get(timeout=30)
            samples.append((time.perf_counter() - started) * 1000)
    drop_queue(url, queue)
    cuts = statistics.quantiles(samples, n=100)
    return {"p50_ms": round(cuts[49], 3), "p99_ms": round(cuts[98], 3), "calls": calls}


def delay_rate(url: str, count: int = 20_000) -> dict[str, float]:
    queue = f"bench-enq-{uuid.uuid4().hex[:8]}"
    with App("bench-enqueue", settings=Settings(broker_url=url)) as app:
        app.send_task(NOOP, queue=queue, ignore_result=True)  # connect and declare before timing
        app.flush(30)
        started = time.perf_counter()
        for _ in range(count):
            app.send_task(NOOP, queue=queue, ignore_result=True)
        handed = time.perf_counter()
        app.flush(120)
        confirmed = time.perf_counter()
    drop_queue(url, queue)
    return {
        "calls_per_s": round(count / (handed - started)),
        "confirmed_per_s": round(count / (confirmed - started)),
        "count": count,
    }


def drain(url: str, count: int = 10_000) -> dict[str, float]:
    queue = f"bench-drain-{uuid.uuid4().hex[:8]}"
    with App("bench-drain", settings=Settings(broker_url=url)) as app:
        results = app.send_many([Signature(NOOP, options={"queue": queue}) for _ in range(count)])
        app.flush(120)
        with worker(url, queue):
            started = time.perf_counter()
            for r in results:
                r.get(timeout=300)
            elapsed = time.perf_counter() - started
    drop_queue(url, queue)
    return {"tasks_per_s": round(count / elapsed), "count": count, "seconds": round(elapsed, 2)}


def parse_args(extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The benchmarks' command line: ``--broker`` (default $CLOCKWORK_BROKER_URL, else local)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    if extra is not None:
        extra(parser)
    args, _ = parser.parse_known_args()  # python -m bench runs every benchmark with one command line
    configure_logging("warning")
    return args


def main() -> int:
    args = parse_args()
    wanted = os.environ.get("BENCH_ONLY", "round_trip,delay_rate,drain_c2").split(",")
    scenarios = {"round_trip": round_trip, "delay_rate": delay_rate, "drain_c2": drain}
    for name in wanted:
        fn = scenarios[name]
        print(json.dumps({"scenario": name, **fn(args.broker)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
