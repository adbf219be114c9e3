"""Fairness figures, ours beside Celery's on the same workload and machine, in one run.

Three levels (issue "Load balancing"):

- child: one 5 s task and 100 x 10 ms tasks on one worker with 2 children: when the last short
  task ends, counted from when they were sent;
- worker: two workers with 2 children each; the first runs two 4 s tasks (so it is busy) when
  the second starts, then 60 x 10 ms tasks are sent: how long they wait to start (p50, max);
- queue: 10,000 no-op tasks waiting in queue ``a``, then 10 tasks sent to ``b``, one worker
  reading ``-Q a,b``: how long ``b``'s tasks wait to start;
- warm child: the child level after 400 no-op tasks, when a prefetch budget has made the
  children's prefetch deep: how long short tasks queued behind the long one take.

Ours runs with its defaults, at a fixed prefetch of 1, with a 10 ms prefetch budget and with a
fixed multiplier of 4.

Celery 5 runs prefork ``-c 2`` with its defaults, and again with ``-O fair``. Our client sends
to both (Celery workers read our messages). Usage: ``python -m bench.fairness [--broker URL]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench.control import vhost
from bench.spine import drop_queue, parse_args, worker
from broker_svc import App, Settings
from broker_svc.tasks.task import Signature

ROOT = Path(__file__).resolve().parent.parent
TIMED, NOOP = "bench.tasks.timed", "bench.tasks.noop"

Starter = Callable[[str, Sequence[str], str], contextlib.AbstractContextManager[object]]


def ours(*options: str) -> Starter:
    @contextlib.contextmanager
    def start(url: str, queues: Sequence[str], name: str) -> Iterator[object]:
        with worker(url, ",".join(queues), 2, name=f"{name}@bench", extra=options) as proc:
            yield proc

    return start


def celery(*options: str) -> Starter:
    @contextlib.contextmanager
    def start(url: str, queues: Sequence[str], name: str) -> Iterator[object]:
        log = Path(tempfile.mkstemp(prefix="bench-celery-", suffix=".log")[1])
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.celery_tasks", "worker", "-P", "prefork",
                 "-c", "2", "-Q", ",".join(queues), "-n", f"{name}@bench", "-l", "info",
                 "--without-mingle", "--without-gossip", *options],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "BENCH_BROKER_URL": url},
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 90
            while "ready." not in log.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"celery worker did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.unlink(missing_ok=True)

    return start


def _ready(app: App, queue: str) -> None:
    app.send_task(NOOP, queue=queue).get(timeout=60)  # children up and consuming


def child_level(url: str, start: Starter) -> dict[str, float]:
    queue = f"fair-child-{uuid.uuid4().hex[:6]}"
    with App("bench-fair", settings=Settings(broker_url=url)) as app, start(url, [queue], f"c-{queue}"):
        _ready(app, queue)
        long = app.send_task(TIMED, args=(5.0,), queue=queue)
        sent = time.time()
        shorts = [app.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(100)]
        last_end = max(r.get(timeout=60)[1] for r in shorts)
        long.get(timeout=60)
    drop_queue(url, queue)
    return {"last_short_done_s": round(last_end - sent, 3)}


def warm_child_level(url: str, start: Starter) -> dict[str, float]:
    """As ``child_level``, after 400 no-op tasks: a prefetch budget has made the children deep."""
    queue = f"fair-warm-{uuid.uuid4().hex[:6]}"
    with App("bench-fair", settings=Settings(broker_url=url)) as app, start(url, [queue], f"c-{queue}"):
        _ready(app, queue)
        for result in [app.send_task(NOOP, queue=queue) for _ in range(400)]:
            result.get(timeout=60)
        long = app.send_task(TIMED, args=(5.0,), queue=queue)
        sent = time.time()
        shorts = [app.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(100)]
        ends = sorted(r.get(timeout=60)[1] - sent for r in shorts)
        long.get(timeout=60)
    drop_queue(url, queue)
    return {"short_done_p50_s": round(statistics.median(ends), 3), "last_short_done_s": round(ends[-1], 3)}


def worker_level(url: str, start: Starter) -> dict[str, float]:
    queue = f"fair-worker-{uuid.uuid4().hex[:6]}"
    with App("bench-fair", settings=Settings(broker_url=url)) as app, start(url, [queue], f"w1-{queue}"):
        _ready(app, queue)
        # Both long tasks go to the first worker (the only one yet), so it is busy and the second,
        # started next, is idle: a worker that hoards makes short tasks wait for the long ones.
        longs = [app.send_task(TIMED, args=(4.0,), queue=queue) for _ in range(2)]
        time.sleep(0.5)  # a benchmark, not a test: a fixed pause lets the long tasks start
        with start(url, [queue], f"w2-{queue}"):
            sent = time.time()
            shorts = [app.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(60)]
            waits = sorted(r.get(timeout=60)[0] - sent for r in shorts)
            for r in longs:
                r.get(timeout=60)
    drop_queue(url, queue)
    return {
        "short_wait_p50_s": round(statistics.median(waits), 3),
        "short_wait_p90_s": round(waits[int(len(waits) * 0.9)], 3),
        "short_wait_max_s": round(waits[-1], 3),
        "shorts_waiting_over_1s": sum(w > 1.0 for w in waits),
    }


def queue_level(url: str, start: Starter) -> dict[str, float]:
    big, small = f"fair-a-{uuid.uuid4().hex[:6]}", f"fair-b-{uuid.uuid4().hex[:6]}"
    with App("bench-fair", settings=Settings(broker_url=url)) as app:
        app.send_many([Signature(NOOP, options={"queue": big, "ignore_result": True}) for _ in range(10_000)])
        app.flush(timeout=120)
        with start(url, [big, small], f"q-{big}"):
            sent = time.time()
            results = [app.send_task(TIMED, args=(0.0,), queue=small) for _ in range(10)]
            starts = [r.get(timeout=120)[0] - sent for r in results]
    drop_queue(url, big)
    drop_queue(url, small)
    return {"small_queue_max_start_s": round(max(starts), 3)}


def main() -> int:
    args = parse_args()
    systems: dict[str, Starter] = {
        "clockwork": ours(),
        "clockwork_prefetch_1": ours("--prefetch-multiplier", "1"),
        "clockwork_budget_10ms": ours("--prefetch-budget", "10ms"),
        "clockwork_multiplier_4": ours("--prefetch-multiplier", "4"),
        "celery": celery(),
        "celery_O_fair": celery("-O", "fair"),
    }
    with vhost(args.broker) as url:
        for level in (child_level, warm_child_level, worker_level, queue_level):
            for name, start in systems.items():
                print(json.dumps({"figure": level.__name__, "system": name, **level(url, start)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
