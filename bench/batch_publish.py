"""Batch publishing with and without the spool: ``python -m bench.batch_publish``.

Sends ``--tasks`` tasks (a small msgpack body, results ignored) to a fresh queue of the broker at
``$CLOCKWORK_BROKER_URL`` and times them from the first call until the broker confirmed the last
one. Each way is one line:

- ``one by one, flush``: ``delay()`` per task, one ``app.flush()`` at the end (pipelined confirms);
- ``one by one, each``: ``confirm="each"``, every call waits for its own confirm;
- ``batch of B``: ``with app.batch():`` around every ``B`` calls: one hand-over and one wait each;
- the same with ``spool_dir`` (fsync on), where a call returns once spooled and a batch's end
  writes and fsyncs it once; ``write-through`` is ``spool_flush_count=1`` (a write and an fsync
  per call). Every spooled way ends with ``app.flush()``, so the figure includes the drain.

Figures are tasks per second (the median of ``--rounds``, with the range) and the mean wait of a
call or a batch's end. The queue is deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass

import pika

from broker_svc import App, Settings
from broker_svc.settings import DEFAULT_BROKER_URL


@dataclass(frozen=True)
class Way:
    name: str
    batch: int  # tasks per batch; 0: one by one
    spool: bool
    options: dict[str, object]


WAYS = [
    Way("one by one, flush", 0, False, {}),
    Way("one by one, each", 0, False, {"confirm": "each"}),
    Way("batch of 10", 10, False, {}),
    Way("batch of 100", 100, False, {}),
    Way("batch of 1000", 1000, False, {}),
    Way("spool: one by one, flush", 0, True, {}),
    Way("spool: write-through", 0, True, {"spool_flush_count": 1}),
    Way("spool: batch of 10", 10, True, {}),
    Way("spool: batch of 100", 100, True, {}),
    Way("spool: batch of 1000", 1000, True, {}),
]


def _run(url: str, way: Way, tasks: int) -> tuple[float, float]:
    """Tasks per second, and the mean wait of a call (one by one) or of a batch's end (ms)."""
    queue = f"bench-batch-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as spool_dir:
        options = dict(way.options)
        if way.spool:
            options["spool_dir"] = spool_dir
        app = App("bench-batch", settings=Settings(broker_url=url, **options))  # type: ignore[arg-type]

        def send() -> None:
            app.send_task("bench.noop", (1,), queue=queue, ignore_result=True)

        try:
            send()  # connect and declare the queue outside the timing
            app.flush(timeout=60)
            waits: list[float] = []
            started = time.perf_counter()
            if way.batch == 0:
                for _ in range(tasks):
                    t0 = time.perf_counter()
                    send()
                    waits.append(time.perf_counter() - t0)
            else:
                for _ in range(tasks // way.batch):
                    batch = app.batch()
                    with batch:
                        for _ in range(way.batch):
                            send()
                        t0 = time.perf_counter()
                    waits.append(time.perf_counter() - t0)  # the block's end: hand-over and wait
            app.flush(timeout=300)
            elapsed = time.perf_counter() - started
        finally:
            app.close(timeout=60)
            _delete_queue(url, queue)
    return tasks / elapsed, 1000 * statistics.fmean(waits)


def _delete_queue(url: str, queue: str) -> None:
    params = pika.URLParameters(url)
    params.virtual_host = Settings(broker_url=url).virtual_host  # "//" is "/", as kombu reads it
    connection = pika.BlockingConnection(params)
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--each-tasks", type=int, default=2_000, help="tasks for the slow per-call ways")
    args = parser.parse_args()
    url = os.environ.get("CLOCKWORK_BROKER_URL") or DEFAULT_BROKER_URL
    print(f"{'way':28} {'tasks/s (median, range)':>28} {'mean wait (ms)':>16}")
    for way in WAYS:
        slow = way.name.endswith(("each", "write-through"))
        tasks = args.each_tasks if slow else args.tasks
        rates, waits = [], []
        for _ in range(args.rounds):
            rate, wait = _run(url, way, tasks)
            rates.append(rate)
            waits.append(wait)
        spread = f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
        per = "call" if way.batch == 0 else "batch end"
        print(f"{way.name:28} {spread:>28} {statistics.median(waits):>10.3f} /{per}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
