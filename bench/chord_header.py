"""A chord with a large header, from our client and from a Celery client (``ChordBackend``), on our worker.

The time from the first send to the body's result, for a header of ``--size`` tasks (default
1,000), on one worker with 2 children; the median of ``--rounds`` rounds. Usage:
``python -m bench.chord_header [--broker URL] [--size N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable

from celery import Celery
from celery import chord as celery_chord

from bench.control import vhost
from bench.spine import drop_queue, parse_args, worker
from broker_svc import App, Settings, chord

ADD, XSUM = "bench.tasks.add", "bench.tasks.xsum"


def ours(url: str, queue: str, size: int) -> float:
    with App("bench-chord", settings=Settings(broker_url=url, default_queue=queue)) as app:
        started = time.monotonic()
        result = chord([app.signature(ADD, (i, i)) for i in range(size)])(app.signature(XSUM))
        assert result.get(timeout=300) == sum(2 * i for i in range(size))
        return time.monotonic() - started


def celery_client(url: str, queue: str, size: int) -> float:
    app = Celery("bench-chord", broker=url, backend="broker_svc.celery_backend:ChordBackend")
    app.conf.update(accept_content=["json"], result_accept_content=["json"], task_default_queue=queue)
    try:
        started = time.monotonic()
        body = app.signature(XSUM)
        result = celery_chord(app.signature(ADD, args=(i, i)) for i in range(size))(body)
        assert result.get(timeout=300) == sum(2 * i for i in range(size))
        return time.monotonic() - started
    finally:
        app.close()


def main() -> int:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--size", type=int, default=1000)
        parser.add_argument("--rounds", type=int, default=3)

    args = parse_args(extra)
    clients: dict[str, Callable[[str, str, int], float]] = {"clockwork": ours, "celery_client": celery_client}
    with vhost(args.broker) as url:
        queue = f"chord-{uuid.uuid4().hex[:6]}"
        with worker(url, queue, 2):
            for name, run in clients.items():
                times = [run(url, queue, args.size) for _ in range(args.rounds)]
                print(json.dumps({
                    "figure": "chord_header", "client": name, "size": args.size,
                    "median_s": round(statistics.median(times), 2), "rounds_s": [round(t, 2) for t in times],
                }), flush=True)  # fmt: skip
        drop_queue(url, queue)
    return 0


if __name__ == "__main__":
    sys.exit(main())
