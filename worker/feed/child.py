"""A consuming pool child's loop: its own connection, its deliveries one at a time, its time limits.

Three threads, so the broker connection lives while a task runs (heartbeats, acks):

- the main thread runs each delivery from decode to ack (``FeedHandler`` → ``FeedSettler``), and
  the task body with it, so the soft time limit (SIGALRM) lands in the task;
- the connection's I/O thread (``BrokerConnection`` with a ``TaskFeed``) reads deliveries into the
  inbox and sends acks, results and copies;
- a control thread reads the worker's socket: revoked ids, and end of file, which means stop.

The hard time limit is kept by a watchdog thread, started on the first task that has one: past it,
the task is answered FAILURE ``TimeLimitExceeded``, its delivery acked, and the child exits (the
pool starts another).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.connection.io_thread import BrokerConnection
from broker_svc.connection.task_feed import TaskDelivery, TaskFeed
from broker_svc.wire.result_message import Outcome, wire_exception
from broker_svc.wire.states import State
from worker.consume.disposition import ACK, HAND_BACK
from worker.feed.handle import FeedHandler
from worker.feed.replies import FeedReplies, reply_type
from worker.feed.settle import FeedSettler
from worker.feed.spec import FeedSpec
from worker.pool.child import ChildChannel, SoftLimit, run_job
from worker.pool.ipc import Job

__all__ = ["serve"]

log = structlog.get_logger(__name__)

# How long a failed delivery waits before it is handed back: a backoff for a loop of failures.
_FAILED_HAND_BACK_PAUSE_S: Final = 0.5
# How long stopping waits for the broker to cancel the consumers, and the connection to close.
_STOP_WAIT_S: Final = 5.0


def serve(app: App, spec: FeedSpec, channel: ChildChannel, soft_limit: SoftLimit) -> None:
    """Consume ``spec.queues`` and run their tasks here until the worker closes the socket."""
    inbox: queue.SimpleQueue[TaskDelivery | None] = queue.SimpleQueue()
    revoked: set[str] = set(spec.revoked)
    stopping = threading.Event()
    clock = LamportClock()
    feed = TaskFeed(spec.queues, prefetch=spec.prefetch, on_delivery=inbox.put)
    connection = BrokerConnection(spec.settings, name=f"{spec.hostname}.child-{os.getpid()}", feed=feed)
    with _signals_blocked():  # the threads started here never take the main thread's signals
        threading.Thread(
            target=_follow_worker, args=(channel, connection, inbox, revoked, stopping),
            name="clockwork-feed-control", daemon=True,
        ).start()  # fmt: skip
    signal.signal(signal.SIGALRM, soft_limit.on_signal)
    replies = FeedReplies(connection, clock=clock, persistent=spec.settings.result_persistent)
    settler = FeedSettler(connection, replies)
    watchdog = _HardLimit(replies, settler, connection)
    handler = FeedHandler(
        app=app, spec=spec, replies=replies, revoked=revoked, clock=clock,
        run=lambda job: _run_limited(app, job, channel, soft_limit, watchdog),
    )  # fmt: skip
    log.info("feed_child_consuming", queues=list(spec.queues), prefetch=spec.prefetch, pid=os.getpid())
    try:
        while (delivery := inbox.get()) is not None:
            if stopping.is_set():
                settler.settle(delivery, HAND_BACK)  # delivered, never started: another worker runs it
                continue
            watchdog.current = delivery
            try:
                disposition, then = handler.handle(delivery)
                if watchdog.claim(delivery):
                    settler.settle(delivery, disposition, then=then)
            except Exception:
                # Typically the connection went away mid-publish: hand it back (it runs again).
                log.exception("delivery_failed", queue=delivery.queue)
                time.sleep(_FAILED_HAND_BACK_PAUSE_S)
                if watchdog.claim(delivery):
                    settler.settle(delivery, HAND_BACK)
        connection.stop_consuming(_STOP_WAIT_S)
        while True:  # anything delivered since goes back
            try:
                late = inbox.get_nowait()
            except queue.Empty:
                break
            if late is not None:
                settler.settle(late, HAND_BACK)
    finally:
        connection.close(_STOP_WAIT_S)
        log.info("feed_child_stopped", processed=handler.processed)


def _run_limited(
    app: App, job: Job, channel: ChildChannel, soft_limit: SoftLimit, watchdog: _HardLimit
) -> dict[str, Any]:
    # The soft limit is a SIGALRM to this thread; the hard one the watchdog's.
    if job.soft_time_limit_s:
        signal.setitimer(signal.ITIMER_REAL, job.soft_time_limit_s)
    if job.hard_time_limit_s:
        watchdog.arm(job, job.hard_time_limit_s)
    try:
        return run_job(app, job, channel, soft_limit)
    finally:
        if job.soft_time_limit_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if job.hard_time_limit_s:
            watchdog.disarm()


class _HardLimit:
    """Ends a task past its hard time limit: FAILURE to its caller, its delivery acked, the child gone.

    Exactly one of the main thread and the watchdog settles a delivery: whoever claims it first.
    """

    def __init__(self, replies: FeedReplies, settler: FeedSettler, connection: BrokerConnection) -> None:
        self._replies, self._settler, self._connection = replies, settler, connection
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
                with _signals_blocked():
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
            reply_to = job.request.get("reply_to")
            if reply_to and not job.request.get("ignore_result"):
                error = wire_exception("TimeLimitExceeded", job.hard_time_limit_s)
                self._replies.result(
                    Outcome(task_id=job.task_id, status=State.FAILURE, result=error),
                    reply_to=reply_to,
                    correlation_id=job.request.get("correlation_id"),
                    content_type=reply_type(delivery.content_type),
                )
            self._settler.settle(delivery, ACK)
        finally:
            self._connection.close(_STOP_WAIT_S)  # the ack goes out before the close
            os._exit(1)


def _follow_worker(
    channel: ChildChannel,
    connection: BrokerConnection,
    inbox: queue.SimpleQueue[TaskDelivery | None],
    revoked: set[str],
    stopping: threading.Event,
) -> None:
    # "consume" once the worker knows every revoke (its state file, the log, Mingle); revoked ids
    # as it learns them; end of file (the worker closed our socket): stop.
    try:
        while (frame := channel.receive()) is not None:
            op = frame.get("op")
            if op == "consume":
                connection.start()  # its I/O thread inherits this thread's blocked signals
            elif op == "revoke":
                revoked.update(str(task_id) for task_id in frame.get("ids") or ())
            else:
                log.warning("feed_child_unknown_frame", op=frame.get("op"))
    except OSError:
        pass
    finally:
        stopping.set()
        inbox.put(None)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    # A thread inherits the signal mask of the thread that starts it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
