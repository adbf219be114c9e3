"""A consuming child's hard time limit: past it, the task's caller is answered and the child ends.

The task still runs when the limit passes, so a watchdog thread takes the connection's socket over,
answers FAILURE ``TimeLimitExceeded``, acks the delivery and ends the process; the pool starts
another child in its slot.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import structlog

from broker_svc.amqp.feed_connection import FeedConnection, TaskDelivery
from worker.consume.settle import FeedSettler
from worker.ipc import EXIT_TIME_LIMIT, Job
from worker.rules.disposition import ACK

__all__ = ["HardLimit", "signals_blocked"]

log = structlog.get_logger(__name__)


class HardLimit:
    """Ends a task past its hard time limit: FAILURE to its caller, its delivery acked, the child gone.

    Exactly one of the main thread and the watchdog settles a delivery: whoever claims it first.
    """

    def __init__(self, settler: FeedSettler, connection: FeedConnection) -> None:
        self._settler, self._connection = settler, connection
        self.answer: Callable[[Job], None] = lambda job: None  # the caller, the chord, the errbacks
        self.settled: Callable[[], None] = lambda: None  # once acked: off the worker's board
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.current: TaskDelivery | None = None
        self._claimed: TaskDelivery | None = None
        self._job: Job | None = None
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def claim(self, delivery: TaskDelivery) -> bool:
        """Whether the caller may settle ``delivery`` (nobody did yet)."""
        with self._lock:
            if self._claimed is delivery:
                return False
            self._claimed = delivery
            return True

    def arm(self, job: Job, limit_s: float) -> None:
        with self._lock:
            self._job, self._deadline = job, time.monotonic() + limit_s
            if self._thread is None:
                with signals_blocked():
                    self._thread = threading.Thread(
                        target=self._watch, name="clockwork-hard-limit", daemon=True
                    )
                    self._thread.start()
            self._wake.notify()

    def disarm(self) -> None:
        with self._lock:
            self._job, self._deadline = None, None

    def _watch(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                job, delivery = self._job, self.current
                if job is None or delivery is None or self._claimed is delivery:
                    self._deadline = None
                    continue
                self._claimed = delivery
                break
        log.error("task_time_limit_exceeded", task_id=job.task_id, limit_s=job.hard_time_limit_s)
        try:
            with self._connection.taken_over():  # the task still runs: the socket is ours now
                self.answer(job)
                self._settler.settle(delivery, ACK)
                self.settled()  # answered, not lost: the worker must not log it as a lost task
                self._connection.close()
        finally:
            os._exit(EXIT_TIME_LIMIT)  # the pool's cue: replaced because of the limit, not a crash


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    # A thread inherits the signal mask of the thread that starts it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
