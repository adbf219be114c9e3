"""A consuming pool child's loop: its own connection, its deliveries one at a time, its time limits.

The main thread does the work: it reads a delivery from the child's ``FeedConnection``, takes it
from decode to ack (``FeedHandler`` → ``FeedSettler``) and runs the task body on the way, so the
soft time limit (SIGALRM) lands in the task. No thread hands a delivery to another.

Beside it:

- the connection's heartbeat thread writes heartbeats while a task runs;
- a control thread reads the worker's socket: "consume" once the worker knows every revoke,
  revoked ids as it learns them, and end of file, which means stop;
- the hard time limit's watchdog, started on the first task that has one: past the limit it takes
  the socket over, answers FAILURE ``TimeLimitExceeded``, acks, and ends the child (the pool starts
  another).

A lost connection is connected again with a backoff; what it had delivered goes back to the queues.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.connection.feed_connection import FeedConnection, TaskDelivery
from broker_svc.errors import BrokerUnavailable
from worker.consume.disposition import ACK, HAND_BACK
from worker.feed.events import FeedEvents
from worker.feed.handle import FeedHandler, FeedUpdates
from worker.feed.replies import FeedReplies
from worker.feed.settle import FeedSettler
from worker.feed.spec import FeedSpec
from worker.pool import ipc
from worker.pool.board import Board
from worker.pool.child import ChildChannel, SoftLimit, UpdateSink, run_job
from worker.pool.ipc import Job

__all__ = ["serve"]

log = structlog.get_logger(__name__)

# How long a failed delivery waits before it is handed back: a backoff for a loop of failures.
_FAILED_HAND_BACK_PAUSE_S: Final = 0.5
# How often the loop looks up from an idle connection to see whether it must stop.
_STOP_CHECK_S: Final = 0.5
_BACKOFF_S: Final = (0.2, 5.0)


def serve(app: App, spec: FeedSpec, channel: ChildChannel, soft_limit: SoftLimit) -> None:
    """Consume ``spec.queues`` and run their tasks here until the worker closes the socket."""
    revoked: set[str] = set(spec.revoked)
    wanted = list(spec.queues)  # the queues to consume; add_consumer/cancel_consumer change it
    stopping, may_consume = threading.Event(), threading.Event()
    name = f"{spec.hostname}.child-{os.getpid()}"
    connection = FeedConnection(spec.settings, name=name, queues=spec.queues, prefetch=spec.prefetch)
    signal.signal(signal.SIGALRM, soft_limit.on_signal)
    replies = FeedReplies(connection, clock=LamportClock(), persistent=spec.settings.result_persistent)
    settler = FeedSettler(connection, replies)
    watchdog = _HardLimit(settler, connection)
    board = Board.attach(spec.board_path, spec.board_slots) if spec.board_path else None
    events = FeedEvents(connection, hostname=spec.hostname, clock=replies.clock, enabled=spec.task_events)
    handler = FeedHandler(
        app=app, spec=spec, replies=replies, revoked=revoked, clock=replies.clock, events=events,
        run=lambda job: _run_limited(app, job, updates, soft_limit, watchdog, connection, (board, spec.slot)),
    )  # fmt: skip
    updates = FeedUpdates(handler)  # update_state and STARTED: published here, not via the worker
    with _signals_blocked():  # the threads started here never take the main thread's signals
        control = threading.Thread(
            target=_follow_worker,
            args=(channel, revoked, stopping, may_consume, events, handler.time_limits, wanted),
            name="clockwork-feed-control",
        )
        control.daemon = True
        control.start()

    def answer(job: Job) -> None:
        if handler.current is not None:
            handler.time_limit_exceeded(handler.current, job.hard_time_limit_s)

    watchdog.answer = answer
    may_consume.wait()
    try:
        _consume(
            connection,
            handler,
            settler,
            watchdog,
            stopping,
            spec,
            wanted=wanted,
            retiring=lambda: _say_retiring(channel),
        )
    finally:
        connection.close()
        log.info("feed_child_stopped", processed=handler.processed)


def _consume(
    connection: FeedConnection,
    handler: FeedHandler,
    settler: FeedSettler,
    watchdog: _HardLimit,
    stopping: threading.Event,
    spec: FeedSpec,
    *,
    wanted: list[str],
    retiring: Callable[[], None],
) -> None:
    connected, backoff_s = False, _BACKOFF_S[0]
    while not stopping.is_set():
        try:
            if not connected:
                connection.connect()
                connected, backoff_s = True, _BACKOFF_S[0]
                log.info(
                    "feed_child_consuming", queues=list(spec.queues), prefetch=spec.prefetch, pid=os.getpid()
                )
            if tuple(wanted) != connection.queues:  # add_consumer / cancel_consumer, between tasks
                connection.set_queues(list(wanted))
                log.info("feed_child_queues", queues=list(wanted))
            delivery = connection.next_delivery(_STOP_CHECK_S)
            if delivery is None:
                continue
            if stopping.is_set():
                settler.settle(delivery, HAND_BACK)  # delivered, never started: another worker runs it
                continue
            _one(delivery, handler, settler, watchdog)
            if (why := _worn_out(spec, handler.processed)) is not None:
                # Past a limit, checked as a task ends: stop taking tasks, hand back the rest,
                # exit; the pool starts another child in this slot.
                log.info("pool_child_recycled", pid=os.getpid(), reason=why, jobs=handler.processed)
                retiring()
                break
        except BrokerUnavailable as exc:
            # Lost (or never made): what it delivered is the broker's again; connect anew.
            log.warning("feed_connection_lost", error=str(exc), retry_in_s=backoff_s)
            connection.drop()
            connected = False
            stopping.wait(backoff_s)
            backoff_s = min(backoff_s * 2, _BACKOFF_S[1])
    if connected:
        with contextlib.suppress(BrokerUnavailable):
            for late in connection.cancel():
                settler.settle(late, HAND_BACK)


def _one(delivery: TaskDelivery, handler: FeedHandler, settler: FeedSettler, watchdog: _HardLimit) -> None:
    watchdog.current = delivery
    try:
        disposition, then = handler.handle(delivery)
    except BrokerUnavailable:
        raise  # its channel is gone with the connection: the broker has it back
    except Exception:
        log.exception("delivery_failed", queue=delivery.queue)
        time.sleep(_FAILED_HAND_BACK_PAUSE_S)  # a backoff for whatever failed; it may fail again
        if watchdog.claim(delivery):
            settler.settle(delivery, HAND_BACK)
        return
    if watchdog.claim(delivery):
        settler.settle(delivery, disposition, then=then)


def _worn_out(spec: FeedSpec, processed: int) -> str | None:
    # Celery's max_tasks_per_child and max_memory_per_child, for a child that consumes itself.
    if spec.max_tasks_per_child is not None and processed >= spec.max_tasks_per_child:
        return "max_tasks_per_child"
    if spec.max_memory_per_child_kib is not None:
        try:
            with open("/proc/self/statm", "rb") as statm:
                rss_kib = int(statm.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
        except (OSError, ValueError, IndexError):
            return None
        if rss_kib > spec.max_memory_per_child_kib:
            return "max_memory_per_child"
    return None


def _say_retiring(channel: ChildChannel) -> None:
    # The pool then replaces this child without a warning that it died.
    with contextlib.suppress(OSError):
        channel.send(ipc.encode_frame({"op": "retiring"}))


def _run_limited(
    app: App,
    job: Job,
    updates: UpdateSink,
    soft_limit: SoftLimit,
    watchdog: _HardLimit,
    connection: FeedConnection,
    shown: tuple[Board | None, int],
) -> dict[str, Any]:
    # The soft limit is a SIGALRM to this thread; the hard one the watchdog's.
    if job.soft_time_limit_s:
        signal.setitimer(signal.ITIMER_REAL, job.soft_time_limit_s)
    if job.hard_time_limit_s:
        watchdog.arm(job, job.hard_time_limit_s)
    board, slot = shown
    if board is not None:  # what runs here, for the worker's inspect and terminate
        info = {"id": job.task_id, "name": job.task_name, "type": job.task_name, "args": job.args,
                "kwargs": job.kwargs, "delivery_info": job.request.get("delivery_info")}  # fmt: skip
        board.start(slot, info)
    try:
        with connection.running():
            return run_job(app, job, updates, soft_limit)
    finally:
        if board is not None:
            board.end(slot)
        if job.soft_time_limit_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if job.hard_time_limit_s:
            watchdog.disarm()


class _HardLimit:
    """Ends a task past its hard time limit: FAILURE to its caller, its delivery acked, the child gone.

    Exactly one of the main thread and the watchdog settles a delivery: whoever claims it first.
    """

    def __init__(self, settler: FeedSettler, connection: FeedConnection) -> None:
        self._settler, self._connection = settler, connection
        self.answer: Callable[[Job], None] = lambda job: None  # the caller, the chord, the errbacks
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
            with self._connection.taken_over():  # the task still runs: the socket is ours now
                self.answer(job)
                self._settler.settle(delivery, ACK)
                self._connection.close()
        finally:
            os._exit(1)


def _follow_worker(
    channel: ChildChannel,
    revoked: set[str],
    stopping: threading.Event,
    may_consume: threading.Event,
    events: FeedEvents,
    time_limits: dict[str, tuple[float | None, float | None]],
    wanted: list[str],
) -> None:
    # "consume" once the worker knows every revoke (its state file, the log, Mingle); revoked ids
    # as it learns them; end of file (the worker closed our socket): stop.
    try:
        while (frame := channel.receive()) is not None:
            op = frame.get("op")
            if op == "consume":
                may_consume.set()
            elif op == "revoke":
                revoked.update(str(task_id) for task_id in frame.get("ids") or ())
            elif op == "events":  # enable_events / disable_events
                events.enabled = bool(frame.get("on"))
            elif op == "queues":  # add_consumer / cancel_consumer: the main thread applies it
                wanted[:] = [str(queue) for queue in frame.get("queues") or ()]
            elif op == "time_limit":  # the time_limit command: (hard, soft) for one task
                time_limits[str(frame.get("task"))] = (frame.get("hard"), frame.get("soft"))
            else:
                log.warning("feed_child_unknown_frame", op=op)
    except OSError:
        pass
    finally:
        stopping.set()
        may_consume.set()


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    # A thread inherits the signal mask of the thread that starts it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
