"""A consuming child's ledger: the duplicates it turns away, and the counts it reports to its worker.

The child's loop wraps each delivery in ``settling``; inside it, ``FeedHandler`` tells the ledger of
the decoded delivery (``duplicate``, which claims it on the worker's shared dedupe window,
``worker/shared/dedupe.py``), the fate it decided (``decided``), its run (``timed``) or its revoke.
Once the delivery is settled its claim ends: finished (remembered for the window) or released (a
copy of it may run). What a delivery has at hand is kept per thread, so threads that each take
their own deliveries from read to settle may share one ledger. The counts (``worker/consume/tally.py``)
go to the worker over the child's socket from a thread of their own, at most every
``report_every_s`` and once more as the child stops, so no message crosses per task.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog

from broker_svc.amqp.feed_connection import TaskDelivery
from broker_svc.topology import DEAD_LETTER_REQUEUED_HEADER
from broker_svc.wire.task.task_message import TaskMessage
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.spec import FeedSpec
from worker.consume.tally import Tally
from worker.ipc import Job, JobStatus, job_status
from worker.rules.disposition import Disposition, Fate
from worker.shared.dedupe import Claim, SharedDedupe

__all__ = ["FeedLedger"]

log = structlog.get_logger(__name__)

REPORT_EVERY_S: Final = 1.0
_T = TypeVar("_T")
# The outcomes whose runtime celery-exporter's histogram keeps; the metric each status counts in.
_TIMED: Final = frozenset({JobStatus.SUCCESS, JobStatus.FAILURE})
_EVENT: Final = {JobStatus.SUCCESS: "succeeded", JobStatus.RETRY: "retried", JobStatus.REJECTED: "rejected"}
# How a requeued dead letter's last delivery ended (clockwork_requeued_tasks_total's ``outcome``):
# acked (it ran, or was answered unrun: revoked, expired), or kept in ``<queue>.dead`` again.
_REQUEUE_ENDS: Final = {Fate.ACK: "done", Fate.DEAD_LETTER: "dead_lettered"}


class _AtHand:
    # The delivery a thread handles now: its queue (the counts' label) and its dedupe claim.
    __slots__ = ("claim", "finished", "queue", "requeued")

    def __init__(self, queue: str = "", *, requeued: int = 0) -> None:
        self.queue = queue
        self.requeued = requeued  # a dead letter sent back for the n-th time (``x-clockwork-requeued``)
        self.claim: Claim | None = None
        self.finished = False  # it ran to a final outcome: later copies are duplicates


class FeedLedger:
    """One consuming child's dedupe claims and counts.

    Args:
        dedupe: the worker's shared window (``--dedupe-window``); None: every delivery may run.
        report_every_s: how often the counts go to the worker, at most.
    """

    def __init__(self, *, dedupe: SharedDedupe | None, report_every_s: float = REPORT_EVERY_S) -> None:
        self._dedupe = dedupe
        self._every_s = report_every_s
        self._local = threading.local()  # .at_hand: this thread's delivery
        self._running: dict[str, _AtHand] = {}  # by task id, for the hard time limit's watchdog
        self._lock = threading.Lock()  # the counts, between the main thread and the reporter
        self._tally = Tally()
        self._channel: ChildChannel | None = None  # nothing is counted until there is a worker to tell
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    @classmethod
    def for_child(cls, spec: FeedSpec) -> FeedLedger:
        """The ledger of a child started with ``spec``."""
        dedupe = None
        if spec.dedupe_path is not None and spec.dedupe_window_s:
            dedupe = SharedDedupe(Path(spec.dedupe_path), ttl_s=spec.dedupe_window_s, owner=False)
        return cls(dedupe=dedupe)

    @property
    def dedupes(self) -> bool:
        """Whether ``--dedupe-window`` is on: a copy of a task running or run here is a duplicate."""
        return self._dedupe is not None

    # -- FeedHandler's -----------------------------------------------------------------------------

    def duplicate(self, request: TaskMessage, *, redelivered: bool) -> bool:
        """Whether the delivery at hand is a duplicate to ack unrun (``--dedupe-window``); else claim it."""
        at_hand = self._at_hand()
        if redelivered:
            self._count("redelivered", at_hand.queue)
        dedupe = self._dedupe
        if dedupe is None:
            return False
        # A requeued dead letter runs anew (its first run may be in the window): a key of its own.
        key = f"{request.id}#requeued{at_hand.requeued}" if at_hand.requeued else request.id
        claim = dedupe.claim(key, request.retries)
        if claim is None:
            log.info("task_duplicate_skipped")
            return True
        at_hand.claim = claim
        return False

    def decided(self, handled: tuple[Disposition, _T]) -> tuple[Disposition, _T]:
        """The fate the handler decided for the delivery at hand; returned as it came."""
        disposition, at_hand = handled[0], self._at_hand()
        at_hand.finished = disposition.finished
        if disposition.fate is Fate.DEAD_LETTER:
            self._count("dead_lettered", at_hand.queue, disposition.reason or "unknown")
        if at_hand.requeued and disposition.fate in _REQUEUE_ENDS:
            # Once per requeue: its retries and parked copies carry the header too, but end here once.
            self._count("requeued", at_hand.queue, _REQUEUE_ENDS[disposition.fate])
        return handled

    def timed(self, run: Callable[[Job], dict[str, Any]]) -> Callable[[Job], dict[str, Any]]:
        """``run``, counted: received and started before it, its outcome and runtime after."""

        def counted(job: Job) -> dict[str, Any]:
            at_hand = self._at_hand()
            name, queue = job.task_name, at_hand.queue
            if self._channel is not None:
                with self._lock:
                    self._tally.count("received", name, queue)
                    self._tally.count("started", name, queue)
            self._running[job.task_id] = at_hand
            started = time.monotonic()
            done: dict[str, Any] | None = None
            try:
                done = run(job)
                return done
            finally:
                self._running.pop(job.task_id, None)
                if self._channel is not None:
                    self._ended(name, queue, done, time.monotonic() - started)

        return counted

    def confirmed(self, kind: str, seconds: float) -> None:
        """One of the child's publishes was confirmed after ``seconds`` (``FeedReplies.on_confirmed``)."""
        if self._channel is not None:
            with self._lock:
                self._tally.confirmed(kind, seconds)

    def unknown(self, task_name: str) -> None:
        """A task of a name the app does not register was dead-lettered (inspect stats ``unknown_tasks``)."""
        self._count("unknown", task_name)

    def revoked(self, task_name: str) -> None:
        """A revoked or expired task was answered without running."""
        self._count("revoked", task_name, self._at_hand().queue)

    def time_limit_exceeded(self, request: TaskMessage, runtime_s: float) -> None:
        """``request`` passed its hard time limit and this child ends now: count it, report at once.

        Called by the watchdog's thread. Its delivery is acked next, so it is finished for the window.
        """
        at_hand = self._running.pop(request.id, None) or _AtHand()
        at_hand.finished = True
        self._end_claim(at_hand)
        if self._channel is not None:
            done = {"status": JobStatus.FAILURE, "error": {"exc_type": "TimeLimitExceeded"}}
            self._ended(request.task, at_hand.queue, done, runtime_s)
            self.report()

    # -- the child loop's --------------------------------------------------------------------------

    def settling(self, delivery: TaskDelivery) -> AbstractContextManager[None]:
        """Around ``delivery``, from its read to its settle: then its dedupe claim ends.

        A delivery whose run ended in a final outcome is remembered for the window even when its ack
        then fails (the connection is gone): the broker's copy of it is the duplicate it catches.
        """
        return _Settling(self, delivery.queue, _requeue_count(delivery.headers))

    def _begin(self, queue: str, requeued: int) -> _AtHand:
        at_hand = self._local.at_hand = _AtHand(queue, requeued=requeued)
        return at_hand

    def _settled(self, at_hand: _AtHand) -> None:
        self._local.at_hand = None
        self._end_claim(at_hand)

    def report_to(self, channel: ChildChannel) -> None:
        """Count from now on and send the counts over ``channel``, at most every ``report_every_s``."""
        self._channel = channel
        # The main thread alone takes the child's signals (the soft time limit's SIGALRM).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self._reporter = threading.Thread(
                target=self._report_often, name="clockwork-feed-ledger", daemon=True
            )
            self._reporter.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def report(self) -> None:
        """Send the counts kept since the last report now (also when ``inspect stats`` asks)."""
        with self._lock:
            tally, self._tally = self._tally, Tally()
        if tally and self._channel is not None:
            with contextlib.suppress(OSError):  # the worker is gone: nobody to tell
                self._channel.send(ipc.encode_frame(tally.to_frame()))

    def close(self) -> None:
        """Send what is left and stop reporting; let go of the dedupe window."""
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=5)
        self.report()
        if self._dedupe is not None:
            self._dedupe.close()

    # -- inside --------------------------------------------------------------------------------------

    def _at_hand(self) -> _AtHand:
        at_hand: _AtHand | None = getattr(self._local, "at_hand", None)
        if at_hand is None:  # outside ``settling``: counted, never claimed
            return _AtHand()
        return at_hand

    def _end_claim(self, at_hand: _AtHand) -> None:
        claim, at_hand.claim = at_hand.claim, None
        if claim is not None and self._dedupe is not None:
            self._dedupe.release(claim, finished=at_hand.finished)

    def _count(self, event: str, *labels: str) -> None:
        if self._channel is not None:
            with self._lock:
                self._tally.count(event, *labels)

    def _ended(self, name: str, queue: str, done: dict[str, Any] | None, runtime_s: float) -> None:
        status = None if done is None else job_status(done["status"])
        with self._lock:
            tally = self._tally
            tally.count("total", name)
            if status in _TIMED:
                tally.ran(name, queue, runtime_s)
            if status is JobStatus.FAILURE:
                exception = str(((done or {}).get("error") or {}).get("exc_type") or "Exception")
                tally.count("failed", name, queue, exception)
            elif status in _EVENT:
                tally.count(_EVENT[status], name, queue)

    def _report_often(self) -> None:
        while not self._stop.wait(self._every_s):
            self.report()


class _Settling:
    # FeedLedger.settling's: a class, not a generator, as it is entered once per delivery.
    __slots__ = ("_at_hand", "_ledger", "_queue", "_requeued")

    def __init__(self, ledger: FeedLedger, queue: str, requeued: int) -> None:
        self._ledger, self._queue, self._requeued = ledger, queue, requeued

    def __enter__(self) -> None:
        self._at_hand = self._ledger._begin(self._queue, self._requeued)

    def __exit__(self, *exc: object) -> None:
        self._ledger._settled(self._at_hand)


def _requeue_count(headers: dict[str, Any]) -> int:
    # ``x-clockwork-requeued``'s count (at least 1 when the header is there at all); 0 without it.
    requeued = headers.get(DEAD_LETTER_REQUEUED_HEADER)
    if requeued is None:
        return 0
    count = requeued.get("count") if isinstance(requeued, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
