"""One consumer of a consuming child: its connection's deliveries, one at a time, from read to settle.

A child runs one (its main thread) or, with ``--threads N``, N of them, each in a thread, all on the
child's one ``SharedFeedConnection``; ``Shared`` holds what they share, the worker's orders as the
child's control thread hears them. A lost connection is connected again with a backoff; what it had
delivered goes back to the queues. When it is lost after a run, before the ack went through, the
consumer connects again at once and sends the run's outcome, and a copy the broker sends back to any
child of the worker is joined to that run, not run again (``worker/child/redeliveries.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Final

import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars

from broker_svc.amqp.feed_connection import ConnectionLost, FeedConnection, TaskDelivery
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerUnavailable
from worker.child.hard_limit import HardLimit
from worker.child.redeliveries import FeedRedeliveries, RecentRuns, Verdict, task_identity
from worker.child.run import run_limited
from worker.child.soft_limits import SoftLimit
from worker.child.spec import FeedSpec
from worker.child.stall import StallWatch, hand_back
from worker.child.task_loop import TaskLoop
from worker.consume.handle import FeedHandler
from worker.consume.records.events import FeedEvents
from worker.consume.replies import FeedReplies
from worker.consume.settle import CopiesInFlight, FeedSettler
from worker.consume.updates import FeedUpdates
from worker.ipc import Job
from worker.rules.deliveries import delivery_count
from worker.rules.disposition import ACK, HAND_BACK, Fate
from worker.rules.prefetch_budget import PrefetchBudget
from worker.rules.recycling import worn_out
from worker.rules.revoked_stamps import RevokedStamps
from worker.shared.board import Board, BoardSlot

__all__ = ["STOP_CHECK_S", "Consumer", "Shared"]

log = structlog.get_logger(__name__)

_FAILED_HAND_BACK_PAUSE_S: Final = 0.5  # a failed delivery's pause before it is handed back
STOP_CHECK_S: Final = 0.5  # how often the loop looks up from an idle connection: must it stop?
# How often a parked copy's first run is looked at (between deliveries) while the connection is idle.
_PARKED_CHECK_S: Final = 0.05
# How long a child tries to connect again to send the outcome of a run whose connection failed.
_OUTCOME_RECONNECT_S: Final = 30.0
_BACKOFF_S: Final = (0.2, 5.0)


class Shared:
    """What the threads of one child share: the worker's orders, as its control thread hears them."""

    def __init__(self, *, revoked: set[str], wanted: list[str], budget: PrefetchBudget | None = None) -> None:
        self.revoked = revoked
        self.revoked_stamps = RevokedStamps()  # revoke_by_stamped_headers, as the worker tells them
        self.wanted = wanted  # the queues to consume; add_consumer/cancel_consumer change it
        self.time_limits: dict[str, tuple[float | None, float | None]] = {}  # the time_limit command's
        self.stopping = threading.Event()
        self.may_consume = threading.Event()
        self.terminated: dict[str, int] = {}  # task id -> the signal that ended its child (terminate)
        self.timed_out: dict[str, float] = {}  # task id -> the hard limit past which the worker ended it
        self.processed: list[int] = []  # one count per thread, summed for --max-tasks-per-child
        # The connection's prefetch from its task times (--prefetch-budget); None: fixed.
        self.budget = budget
        self._budget_lock = threading.Lock()
        self._seen_generation = 0  # the last connection said to be consuming (once per connection)
        self._seen_lock = threading.Lock()

    def first_to_see(self, generation: int) -> bool:
        """Whether this thread is the first of the child's to see connection ``generation``: it
        logs it, so a child logs each connection (and its prefetch) once, not once per thread."""
        with self._seen_lock:
            if generation <= self._seen_generation:
                return False
            self._seen_generation = generation
            return True

    def task_took(self, seconds: float, *, long: bool) -> int | None:
        """A task of this child took ``seconds`` (``long``: past the budget, what it held went back):
        the connection's new prefetch, if it must change."""
        if self.budget is None:
            return None
        with self._budget_lock:
            return self.budget.observe(seconds, long=long)


class Consumer:
    """One connection consuming and running its deliveries one at a time, in one thread."""

    def __init__(
        self,
        app: App,
        spec: FeedSpec,
        shared: Shared,
        *,
        clock: LamportClock,
        board: Board | None,
        index: int,
        soft_limit: SoftLimit,
        connection: FeedConnection | None = None,
        recent: RecentRuns | None = None,
        copies: CopiesInFlight | None = None,
    ) -> None:
        self.index, self._spec, self._shared = index, spec, shared
        # Under --threads the child's threads share one connection, which the child closes.
        self._owns_connection = connection is None
        if connection is None:
            connection = FeedConnection(
                spec.settings, name=spec.connection_name(os.getpid()), queues=spec.queues,
                prefetch=spec.connection_prefetch, declare=spec.queue_specs,
            )  # fmt: skip
        self.connection = connection
        replies = FeedReplies(connection, clock=clock, persistent=spec.settings.result_persistent)
        self.settler = FeedSettler(connection, replies, namespace=spec.settings.namespace, copies=copies)
        self.watchdog = watchdog = HardLimit(self.settler, connection)
        self.events = FeedEvents(connection, hostname=spec.hostname, clock=clock, enabled=spec.task_events)
        own_slot = spec.slot * spec.threads + index
        self.shown = shown = BoardSlot(board, own_slot)
        self.redeliveries = redeliveries = FeedRedeliveries.for_consumer(
            spec, board, own_slot=own_slot, connection=connection, recent=recent
        )

        def close_seen(lost: ConnectionLost) -> None:  # by the heartbeat thread, while tasks run
            _log_lost(lost, retry_in_s=None)
            redeliveries.connection_lost(lost)  # the acks of its last runs may be lost with it

        connection.on_close_seen = close_seen
        alarm = spec.threads == 1  # threads get theirs from ThreadSoftLimits, inside the body
        self.task_loop = task_loop = TaskLoop()  # this thread's, for async def tasks
        self.handler = handler = FeedHandler(
            app=app, spec=spec, replies=replies, revoked=shared.revoked, terminated=shared.terminated,
            revoked_stamps=shared.revoked_stamps,
            clock=clock, events=self.events, timed_out=shared.timed_out,
            run=lambda job: run_limited(
                app, job, updates, soft_limit, watchdog, connection, shown, alarm, task_loop
            ),
        )  # fmt: skip
        replies.on_confirmed = handler.ledger.confirmed  # the worker's confirm-latency histogram
        updates = FeedUpdates(handler)  # update_state and STARTED: published here, not via the worker

        def answer(job: Job) -> None:
            if handler.current is not None:
                handler.time_limit_exceeded(handler.current, job.hard_time_limit_s)

        watchdog.answer = answer
        watchdog.settled = shown.end
        shared.processed.append(0)
        # With a prefetch budget, what a child holds behind a task that outlives it goes back
        # (worker/child/stall.py); a --threads child's other threads take what one holds.
        self.stall: StallWatch | None = None
        self._suspecting = False  # at prefetch 1 while redelivered tasks come (_guard_against_crashers)
        if spec.prefetch_budget_s is not None and spec.threads == 1:
            self.stall = StallWatch(connection, self.settler, updates.lock, spec.prefetch_budget_s)

    def run(self, retiring: Callable[[], None]) -> None:
        try:
            self._consume(retiring)
        finally:
            self.task_loop.close()
            if self._owns_connection:
                self.connection.close()
            self.handler.ledger.close()
            self.redeliveries.close()
            log.info("feed_child_stopped", processed=self.handler.processed)

    def _consume(self, retiring: Callable[[], None]) -> None:
        connection, settler, shared, spec = self.connection, self.settler, self._shared, self._spec
        connected, backoff_s = False, _BACKOFF_S[0]
        while not shared.stopping.is_set():
            try:
                if not connected:
                    self._connect()
                    connected, backoff_s = True, _BACKOFF_S[0]
                wanted = tuple(shared.wanted)
                if wanted != connection.queues:  # add_consumer / cancel_consumer, between tasks
                    connection.set_queues(list(wanted))
                    log.debug("feed_child_queues", queues=list(wanted))
                self._look_at_parked()
                connection.catch_up()  # the whole prefetch again, once a resubscribe's leftovers are settled
                delivery = connection.next_delivery(
                    _PARKED_CHECK_S if self.redeliveries.parked else STOP_CHECK_S
                )
                if delivery is None:
                    continue
                if shared.stopping.is_set():
                    # Delivered, never started: another worker runs it (an ordered queue's: handed
                    # back by the close at the end).
                    if not connection.ordered:
                        _hand_back_uncounted(settler, [delivery], why="task_requeued_on_shutdown")
                    continue
                if delivery.queue not in shared.wanted:
                    # cancel_consumer came while it was on its way (the worker has already answered
                    # that nobody here consumes the queue): back to the queue; the loop cancels next.
                    _hand_back_uncounted(settler, [delivery], why=None)
                    continue
                # A copy of a task run here (with --dedupe-window, the window skips it instead).
                if delivery.redelivered and not self.handler.ledger.dedupes and self._joined(delivery):
                    continue
                self._take(delivery)
                shared.processed[self.index] = self.handler.processed
                if (why := worn_out(spec, sum(shared.processed), _resident_kib)) is not None:
                    # Past a limit, checked as a task ends: stop taking tasks, hand back the rest,
                    # exit; the pool starts another child in this slot.
                    log.info("pool_child_recycled", pid=os.getpid(), reason=why, jobs=sum(shared.processed))
                    retiring()
                    break
            except BrokerUnavailable as exc:
                # Lost (or never made): what it delivered is the broker's again; connect anew
                # (declaring the task queues first: a deleted one is back before it is consumed).
                if (told := connection.loss_to_tell(exc)) is not None:  # once, not once per thread
                    _log_lost(told, retry_in_s=backoff_s)
                self.redeliveries.connection_lost(exc)  # its last runs' acks may be lost with it
                if self._owns_connection:  # a shared one was dropped by the failure; maybe replaced
                    connection.drop()
                connected = False
                shared.stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, _BACKOFF_S[1])
        if connected and connection.ordered:
            # An ordered queue's next consumer must get what we hold before anything behind it:
            # a cancel would let it start on the next task first. Closing the connection (run's
            # end) requeues what we hold and moves the queue on in one step in the broker.
            log.info("feed_child_stops_ordered", handed_back_by_close=True)
        elif connected:
            with contextlib.suppress(BrokerUnavailable):
                unstarted = [*connection.cancel(), *(parked.delivery for parked in self.redeliveries.parked)]
                # Another worker runs them.
                _hand_back_uncounted(settler, unstarted, why="task_requeued_on_shutdown")

    def _connect(self) -> None:
        self.connection.connect()
        self.redeliveries.forget()  # what it parked went back with the old connection
        if self._shared.first_to_see(self.connection.generation):  # a --threads child's threads share it
            log.debug(
                "feed_child_consuming", queues=list(self._spec.queues), prefetch=self.connection.prefetch,
                threads=self._spec.threads, pid=os.getpid(),
            )  # fmt: skip

    def _take(self, delivery: TaskDelivery) -> None:
        # One delivery from read to settle; it shows on the board from its run's start until then.
        started, stall = time.monotonic(), self.stall
        guarded = stall is not None and self._guard_against_crashers(delivery)
        if stall is not None:
            stall.arm(delivery)
        try:
            self._settle(delivery)
        finally:
            if stall is not None:
                stall.disarm()
        if self._shared.budget is not None:
            # Past the budget if the stall watcher handed back what waited behind it.
            self._follow_budget(started, long=self.connection.paused and not guarded)
        if self.connection.paused:  # what it held went back while the task ran: consume again
            self.connection.resume()

    def _guard_against_crashers(self, delivery: TaskDelivery) -> bool:
        # A redelivered task may be the one that crashed its last child: nothing of ours waits
        # behind it. A crash brings many back at once, each a suspect: rather than a pause and a
        # hand-back of all the rest before each, they come one at a time (prefetch 1) until a
        # task that never failed comes, and the budget's prefetch is back before that one runs
        # (its consumer holds it alone then: nothing is on its way to a consumer made anew).
        # Whether it paused the connection for this task.
        if delivery_count(delivery.headers, redelivered=delivery.redelivered):
            if self._suspecting or (held := self.connection.pause()) is None:
                return False
            if held:
                hand_back(self.settler, held)
                log.info("tasks_handed_back_behind_redelivery", count=len(held))
            self._suspecting = True
            self.connection.set_prefetch(1)  # paused: consumes at 1 once this task ends
            return True
        if self._suspecting:
            self._suspecting = False
            budget = self._shared.budget
            if budget is not None and budget.current != self.connection.prefetch:
                self.connection.set_prefetch(budget.current)
                log.info("feed_prefetch_changed", prefetch=budget.current)
        return False

    def _follow_budget(self, started: float, *, long: bool) -> None:
        # The task's own run, not the child's work around it (decode, settle, ack), which the
        # broker's share of the CPU stretches on a small machine; a delivery that did not run
        # (revoked, refused, parked) counts as the whole of its handling.
        concluding = self.handler.concluding
        took_s = concluding[2] / 1000 if concluding is not None else time.monotonic() - started
        prefetch = self._shared.task_took(took_s, long=long)
        if prefetch is not None and not self._suspecting:  # else set when a task that never failed comes
            self.connection.set_prefetch(prefetch)
            log.info("feed_prefetch_changed", prefetch=prefetch)

    def _settle(self, delivery: TaskDelivery) -> None:
        handler, settled = self.handler, None
        if self.settler.copies is not None:  # a copy a sibling published: its original is acked first
            self.settler.copies.wait_for_original(delivery)
        with handler.ledger.settling(delivery):  # its --dedupe-window claim ends once settled
            try:
                settled = _one(delivery, handler, self.settler, self.watchdog)
                self.redeliveries.settled(delivery, settled, ran=handler.concluding is not None)
                self.connection.check(delivery)  # a close that came with the ack: the ack was lost
            except BrokerUnavailable as exc:
                if handler.concluding is None:
                    raise  # nothing ran: the broker has the delivery back, and it runs again
                self._outcome_after_loss(delivery, exc, settled=settled)
            finally:
                self.shown.end()

    def _outcome_after_loss(
        self, delivery: TaskDelivery, exc: BrokerUnavailable, *, settled: Fate | None
    ) -> None:
        # The run ended but its connection failed before its ack went through: the broker requeued
        # the delivery. Connect again, send the outcome (unless it went out before the ack), and
        # remember it: a copy that reaches any child of this worker is acked, not run again.
        assert self.handler.concluding is not None
        request = self.handler.concluding[0]
        if (told := self.connection.loss_to_tell(exc)) is not None:
            _log_lost(told, retry_in_s=0.0)
        claim = self.redeliveries.sending_outcome(request.id, request.retries)
        sent = settled is not None and settled is not Fate.HAND_BACK
        try:
            if settled is None:
                # The runs settled before it on the lost connection: their acks may be lost too
                # (a close a read after their acks would have seen). Raised, the loop does this.
                self.redeliveries.connection_lost(exc)
                self._connect_for_outcome()
                handled = self.handler.conclude_again()
                assert handled is not None
                disposition, then = handled
                self.settler.settle(delivery, disposition, then=then)  # its ack is not sent: the tag is gone
                self.handler.log_success()
                sent = disposition.fate is not Fate.HAND_BACK
                log.info("task_outcome_sent_after_reconnect", fate=disposition.fate.name.lower())
        finally:
            self.redeliveries.outcome_sent(claim, sent=sent)
        if settled is not None:
            raise exc  # the loop connects again

    def _connect_for_outcome(self) -> None:
        deadline, backoff_s = time.monotonic() + _OUTCOME_RECONNECT_S, _BACKOFF_S[0]
        while True:
            try:
                self._connect()
                return
            except BrokerUnavailable as exc:
                if self._shared.stopping.is_set() or time.monotonic() + backoff_s > deadline:
                    raise
                _log_lost(exc, retry_in_s=backoff_s)
                self._shared.stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, _BACKOFF_S[1])

    def _joined(self, delivery: TaskDelivery) -> bool:
        # A redelivered copy of a task this worker runs or ran: parked or acked here, not run.
        if (identity := task_identity(delivery)) is None:
            return False
        task_id, retries = identity
        verdict = self.redeliveries.verdict(task_id, retries)
        if verdict is Verdict.RUN:
            return False
        clear_contextvars()
        bind_contextvars(queue=delivery.queue, task_id=task_id)
        if verdict is Verdict.DONE:
            log.info("task_redelivery_done_acked")  # its outcome went out; only the ack was lost
            self.settler.settle(delivery, ACK)
        else:
            self.redeliveries.park(delivery, task_id, retries)
        return True

    def _look_at_parked(self) -> None:
        # Between deliveries: a parked copy whose first run ended is acked (done) or runs (it died).
        if self.redeliveries.parked:
            self.redeliveries.forget()  # another thread may have connected again meanwhile
        for parked in list(self.redeliveries.parked):
            verdict = self.redeliveries.verdict(parked.task_id, parked.retries)
            if verdict is Verdict.RUNNING:
                continue
            self.redeliveries.unpark(parked)
            if verdict is Verdict.DONE:
                bind_contextvars(task_id=parked.task_id)
                log.info("task_settled_by_redelivery")  # the first run's outcome went out
                self.settler.settle(parked.delivery, ACK)
            else:
                log.info("task_redelivery_runs", task_id=parked.task_id)  # its first run did not finish
                self._take(parked.delivery)


def _one(
    delivery: TaskDelivery, handler: FeedHandler, settler: FeedSettler, watchdog: HardLimit
) -> Fate | None:
    # The fate ``delivery`` was settled with (None: the hard time limit's watchdog settled it).
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
            return Fate.HAND_BACK
        return None
    if watchdog.claim(delivery):
        settler.settle(delivery, disposition, then=then)
        handler.log_success()  # after the ack, while the broker sends the next delivery
        return disposition.fate
    return None


def _hand_back_uncounted(settler: FeedSettler, unstarted: list[TaskDelivery], *, why: str | None) -> None:
    # Never started here, so not a delivery that failed: each goes back as a copy carrying the
    # count it came with. A nack would count one more, and a task held by a few workers in a row
    # that stop (a rolling deploy) could reach its delivery limit without ever running.
    if unstarted:
        hand_back(settler, unstarted)
        if why is not None:
            log.info(why, count=len(unstarted))


def _log_lost(exc: BrokerUnavailable, *, retry_in_s: float | None) -> None:
    # The facts an alert keys on (consumer_cancelled_by_broker, consumer_timeout=true). A close
    # seen while a task ran was logged then (retry_in_s None), once.
    if isinstance(exc, ConnectionLost) and exc.reported:
        return
    if isinstance(exc, ConnectionLost) and exc.cancelled_queue is not None:
        log.warning("consumer_cancelled_by_broker", queue=exc.cancelled_queue)
    timed_out = isinstance(exc, ConnectionLost) and exc.consumer_timeout
    (log.error if timed_out else log.warning)(
        "feed_connection_lost", error=str(exc), consumer_timeout=timed_out, retry_in_s=retry_in_s
    )


def _resident_kib() -> int | None:
    # This process's resident memory (Linux's /proc), None where it cannot be read.
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except (OSError, ValueError, IndexError):
        return None
