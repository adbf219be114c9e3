"""Clockwork as a benchmark subject (project venv): ``python -m bench.ours SCENARIO ...``.

Workers are ``python -m worker`` logging at INFO to a file as every system (``bench.procs.running``),
without mingle (a start-up cost only) and without a state file (Celery's default); the client is
``broker_svc.App`` with its default pipelined confirms.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

from bench import control, driver
from bench.driver import Job, Results
from bench.procs import running
from bench.scenarios import SLEEP_S, WARMUP_CALLS, Produced, Shape, Task
from bench.spine import NOOP, worker_command
from broker_svc import App, Settings
from broker_svc.logging import configure_logging
from broker_svc.tasks.task import Signature

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "clockwork"
TIMED = "bench.tasks.timed"
WIDE_THREADS = 50  # the wide worker: two children with 25 threads each, as Dramatiq's -p 2 -t 25
WORKER_ARGS = "--without-mingle --statedb none"
# Under --threads, Dramatiq's prefetch: twice the threads per process (one waiting per thread).
THREADS_PREFETCH = ("--prefetch-multiplier", "2")


class Clockwork:
    """The ``bench.scenarios.Subject`` for our worker and client."""

    def __init__(
        self, url: str, *, wide: int = 0, extra_worker_args: Sequence[str] = (), wide_threads: bool = True
    ) -> None:
        self._url = url
        self._wide = wide or WIDE_THREADS
        self._extra_worker_args = tuple(extra_worker_args)
        # The wide shape as Dramatiq's: two processes with threads (--threads), not one per slot.
        self._wide_threads = wide_threads

    def _app(self) -> App:
        return App("bench-compare", settings=Settings(broker_url=self._url))

    @contextmanager
    def worker(self, queue: str, shape: Shape) -> Iterator[Popen[bytes]]:
        # Its log goes to a file, as the peers' do (bench.procs.running): through a pipe, every
        # line would also wake the process reading it, a cost no peer pays. The scenarios wait
        # for its consumer on the queue, so no ``worker_ready`` line is needed.
        concurrency = 2 if shape is Shape.PAIR else self._wide
        # Later options win: bench.cpu_split's -l warning, say.
        extra = [*WORKER_ARGS.split(), *self._extra_worker_args]
        if shape is not Shape.PAIR and self._wide_threads:
            concurrency, extra = 2, [*extra, "--threads", str(max(1, self._wide // 2)), *THREADS_PREFETCH]
        cmd = worker_command(self._url, queue, concurrency, extra=extra)
        with running(cmd, env=dict(os.environ), cwd=ROOT) as proc:
            yield proc

    def consumers(self, shape: Shape) -> int:
        if shape is Shape.PAIR or self._wide_threads:
            return 2  # each child consumes, its threads (--threads) on one shared consumer
        return self._wide

    def fill(self, queue: str, count: int, task: Task, *, wait_queued: bool = True) -> None:
        # Confirmed messages are queued: there is nothing more to wait for either way.
        name, args = (NOOP, ()) if task is Task.NOOP else (TIMED, (SLEEP_S,))
        options = {"queue": queue, "ignore_result": True}
        with self._app() as app:
            app.send_many(Signature(name, args, options=options) for _ in range(count))
            app.flush(120)

    def produce(self, queue: str, count: int) -> Produced:
        with self._app() as app:
            app.send_task(NOOP, queue=queue, ignore_result=True)  # connect and declare first
            app.flush(30)
            started = time.perf_counter()
            for _ in range(count):
                app.send_task(NOOP, queue=queue, ignore_result=True)
            handed = time.perf_counter()
            app.flush(120)
            return Produced(started, handed, time.perf_counter())

    def round_trip(self, queue: str, calls: int) -> list[float]:
        samples = []
        with self._app() as app:
            for i in range(WARMUP_CALLS + calls):
                started = time.perf_counter()
                app.send_task(NOOP, queue=queue).get(timeout=30)
                if i >= WARMUP_CALLS:  # the first ones warm the worker and the result consumer
                    samples.append((time.perf_counter() - started) * 1000)
        return samples


def control_plane(job: Job) -> Results:
    """``bench.control``'s figures: ``inspect ping`` with 1 and 3 workers, ours beside Celery's (its
    client waits out its 1 s timeout), in process and as a command; revoke-to-skip (ours only)."""
    ours: dict[str, float] = {}
    celery: dict[str, float] = {}
    for workers in (1, 3):
        figures = control.ping_figures(job.broker_url, workers, job.count)
        ours[f"ping_{workers}w_ms"] = _p50(figures["ours_in_process"])
        ours[f"ping_cmd_{workers}w_ms"] = _p50(figures["ctl_command"])
        celery[f"ping_{workers}w_ms"] = _p50(figures["celery_in_process_timeout_1s"])
        celery[f"ping_cmd_{workers}w_ms"] = _p50(figures["celery_command_timeout_1s"])
    revoke = control.revoke_to_skip(job.broker_url, job.count)
    ours["revoke_call_ms"] = _p50(revoke["revoke_call"])
    ours["revoke_to_skip_ms"] = _p50(revoke["revoke_to_revoked_result"])
    return {SYSTEM: ours, "celery": celery}


def _p50(figure: object) -> float:
    assert isinstance(figure, dict)
    return float(figure["p50_ms"])


def main() -> int:
    configure_logging("warning")
    # bench.spine.worker (the control scenario's workers) appends these to every worker it starts.
    os.environ["BENCH_WORKER_ARGS"] = WORKER_ARGS
    return driver.main(
        SYSTEM, lambda job: Clockwork(job.broker_url, wide=job.wide), {"control": control_plane}
    )


if __name__ == "__main__":
    sys.exit(main())
