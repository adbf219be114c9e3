"""One consuming child's task path in this process: tasks/s and CPU per task, with less noise.

Usage: ``python -m bench.child_inproc [--broker URL] [--tasks 20000] [--threads 1] [--task noop]
[--prefetch-multiplier 1] [--rounds 3] [--profile 40]``. In a vhost of its own, each round fills a
fresh queue with ``bench.tasks`` tasks (``noop``, or ``sleep``: 10 ms each) and runs the child's own
consumers on it here (``worker/child/consumer.py``, under ``--threads`` on one shared connection, as
``worker/child/serve.py`` builds them), logging at INFO to a temporary file as the worker does. It
prints one JSON line per round: tasks/s and microseconds of this process's CPU per task (user and
system), from the start until the last task ended; ``--profile N`` adds cProfile's N costliest
functions by own time (``--threads 1`` only; it slows the run).

Without a worker, a forkserver and a second child it is steadier than a whole worker's drain, but
not immune to a shared machine whose speed drifts (on this one: 162-164 us of user CPU per no-op
task in three rounds, 189-222 in four rounds an hour later). To compare two commits, run it from
two checkouts (``PYTHONPATH=<checkout>``) in turn, several times each.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import tempfile
import threading
import time
from typing import Any

from bench.control import vhost
from bench.queues import delete
from bench.scenarios import SLEEP_S
from bench.tasks import app as bench_app
from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from broker_svc.app import App
from broker_svc.canvas.signature import Signature
from broker_svc.clock import LamportClock
from broker_svc.logging import configure_logging
from broker_svc.settings import DEFAULT_BROKER_URL, Settings
from broker_svc.topology import task_queue
from broker_svc.wire.ids import uuid4_str
from worker.child.consumer import Consumer, Shared
from worker.child.serve import build_consumers
from worker.child.soft_limits import SoftLimit
from worker.child.spec import FeedSpec

_TASKS = {"noop": ("bench.tasks.noop", ()), "sleep": ("bench.tasks.timed", (SLEEP_S,))}


def one_round(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Fill a queue, run the child's consumers on it until every task ran; the round's figures."""
    settings = Settings(broker_url=url)
    queue = f"child-inproc-{uuid4_str()[:8]}"
    name, task_args = _TASKS[args.task]
    try:
        with App("bench-fill", settings=settings) as app:
            options = {"queue": queue, "ignore_result": True}
            app.send_many(Signature(name, task_args, options=options) for _ in range(args.tasks))
            app.flush(120)
        spec = FeedSpec(
            settings=settings, queues=(queue,), prefetch=args.prefetch_multiplier, hostname="inproc@bench",
            queue_specs=(task_queue(queue),), task_names=(name,), threads=args.threads,
        )  # fmt: skip
        consumers, shared, connection = _consumers(spec)
        ended: list[tuple[float, resource.struct_rusage]] = []

        def watch() -> None:  # the end is the last task's, not the stop check's wait after it
            while sum(c.handler.processed for c in consumers) < args.tasks:
                time.sleep(0.001)
            ended.append((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)))
            shared.stopping.set()

        profile = cProfile.Profile() if args.profile else None
        threading.Thread(target=watch, daemon=True).start()
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if profile is not None:
            profile.enable()
        _run(consumers)
        if profile is not None:
            profile.disable()
        if connection is not None:  # the threads' shared one (a lone consumer closes its own)
            connection.close()
        finished, after = ended[0]
        done = sum(c.handler.processed for c in consumers)
        figures: dict[str, Any] = {
            "tasks_per_s": round(done / (finished - started), 1),
            "user_us_per_task": round((after.ru_utime - before.ru_utime) / done * 1e6, 1),
            "system_us_per_task": round((after.ru_stime - before.ru_stime) / done * 1e6, 1),
            "tasks": done,
        }
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
            figures["profile"] = out.getvalue()
        return figures
    finally:
        delete(url, [queue])


def _consumers(spec: FeedSpec) -> tuple[list[Consumer], Shared, SharedFeedConnection | None]:
    # As worker/child/serve.py's serve builds them, without the control thread and the board.
    shared = Shared(revoked=set(), wanted=list(spec.queues))
    shared.may_consume.set()
    consumers, connection = build_consumers(
        bench_app, spec, shared, clock=LamportClock(), board=None, soft_limit=SoftLimit()
    )
    return consumers, shared, connection


def _run(consumers: list[Consumer]) -> None:
    if len(consumers) == 1:
        consumers[0].run(lambda: None)
        return
    threads = [threading.Thread(target=c.run, args=(lambda: None,)) for c in consumers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.child_inproc", description=__doc__)
    parser.add_argument("--broker", default=os.environ.get("CLOCKWORK_BROKER_URL") or DEFAULT_BROKER_URL)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--task", choices=sorted(_TASKS), default="noop")
    parser.add_argument("--prefetch-multiplier", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.profile and args.threads > 1:
        parser.error("--profile sees the calling thread only: profile with --threads 1")
    with tempfile.NamedTemporaryFile("w", prefix="bench-child-inproc-", suffix=".log") as log:
        # The child's lines (one per task at INFO) go to a file, as the worker's do in bench.compare.
        with contextlib.redirect_stderr(log):
            configure_logging("info", json=True)
            with vhost(args.broker) as url:
                for _ in range(args.rounds):
                    figures = one_round(url, args)
                    text = figures.pop("profile", None)
                    print(json.dumps(figures), flush=True)
                    if text:
                        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
