"""One delivery in a consuming child: decode, the guards, the run, its outcome → the delivery's disposition.

Every step decides a :class:`~worker.rules.disposition.Disposition` and the child's settle point
(``worker/consume/settle.py``) carries it out. A canvas field the child cannot honour is refused
(dead-lettered, its caller answered), never silently skipped. What a task's caller, chord and
watchers are told on the way is ``worker/consume/answers.py``'s; a finished run's outcome is
``worker/consume/outcomes.py``'s.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping, Set
from pathlib import Path
from typing import Any

import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars

from broker_svc import signals
from broker_svc.amqp.feed_connection import TaskDelivery
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.logging import HotLogger
from broker_svc.topology import DELAY_HOLD_WINDOW_S, delay_bucket_ms, expired_queue
from broker_svc.wire import codec
from broker_svc.wire.results.message import CELERY_EXCEPTIONS_MODULE, Outcome, wire_exception
from broker_svc.wire.results.meta import is_redis_url
from broker_svc.wire.task.stamps import task_stamps
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import TaskMessage, decode_task, eta_and_expires, safe_repr
from worker.child.spec import FeedSpec
from worker.consume.answers import FeedAnswers, Handled
from worker.consume.canvas import FeedCanvas
from worker.consume.ledger import FeedLedger
from worker.consume.outcomes import FeedOutcomes
from worker.consume.records.events import FeedEvents
from worker.consume.records.parked import FeedParked
from worker.consume.records.states import FeedStates
from worker.consume.replies import FeedReplies
from worker.ipc import Job
from worker.rules import canvas_plan
from worker.rules.deliveries import (
    DELIVERY_LIMIT_REASON,
    UNKNOWN_TASK_HINT,
    broker_dead_letter,
    carries_count,
    delivery_count,
    recount,
)
from worker.rules.disposition import ACK, Disposition
from worker.rules.gate_forward import to_gate
from worker.rules.job_request import (
    delivery_info,
    message_properties,
    past_dedup_deadline,
    request_context,
    time_limits,
)
from worker.rules.rate_limits import RATE_RESERVED_HEADER
from worker.rules.revoked_stamps import RevokedStamps
from worker.shared.rates import SharedRates

__all__ = ["FeedHandler", "Handled"]

log = structlog.get_logger(__name__)
success_log = HotLogger(__name__)  # task_succeeded: once per task


class FeedHandler:
    """Decides each delivery's fate in a consuming child, running its task when it may run.

    Args:
        app: the app whose tasks run here.
        spec: the child's start-up order (settings, hostname, default time limits).
        replies: publishes results, confirmed.
        revoked: ids revoked so far (the child's socket adds to it).
        revoked_stamps: stamp values revoked so far (``revoke_by_stamped_headers``), likewise.
        clock: the child's Lamport clock.
        run: runs one job in this process and returns the child's done frame.
        events: sends task events.
    """

    def __init__(
        self,
        *,
        app: App,
        spec: FeedSpec,
        replies: FeedReplies,
        revoked: Set[str],
        terminated: Mapping[str, int] | None = None,
        timed_out: Mapping[str, float] | None = None,
        revoked_stamps: RevokedStamps | None = None,
        clock: LamportClock,
        run: Callable[[Job], dict[str, Any]],
        events: FeedEvents,
    ) -> None:
        self._app = app
        self._spec = spec
        self._settings = spec.settings
        self._accept = codec.accept_set(spec.settings.accept_content)
        self._expired_queue = expired_queue(spec.settings.namespace)
        self._revoked = revoked
        self._revoked_stamps = revoked_stamps
        self._unknown: set[str] = set()  # names logged with the hint once already
        self._clock = clock
        self.ledger = FeedLedger.for_child(spec)  # --dedupe-window, and the counts for stats and metrics
        self._run = self.ledger.timed(run)
        self.events = events  # task-* events while enabled (-E, enable_events)
        self._rates = (
            SharedRates(Path(spec.rates_path), spec.task_names, owner=False) if spec.rates_path else None
        )
        self._canvas = FeedCanvas(app=app, replies=replies, namespace=spec.settings.namespace)
        self._parked = FeedParked(replies, hostname=spec.hostname, namespace=spec.settings.namespace)
        if is_redis_url(app.conf.get("result_backend")):  # lazy: redis-py only where it is used
            from worker.consume.backend import FeedBackend

            self._canvas.redis = FeedBackend.for_app(app, hostname=spec.hostname, replies=replies)
        self._terminated: Mapping[str, int] = terminated if terminated is not None else {}
        self._timed_out: Mapping[str, float] = timed_out if timed_out is not None else {}
        self._states = FeedStates(
            replies, hostname=spec.hostname, clock=clock, enabled=spec.settings.task_states,
            namespace=spec.settings.namespace,
        )  # fmt: skip
        self._answers = FeedAnswers(
            app=app,
            replies=replies,
            canvas=self._canvas,
            events=events,
            ledger=self.ledger,
            terminated=self._terminated,
            states=self._states,
        )
        self._outcomes = FeedOutcomes(
            app=app, answers=self._answers, canvas=self._canvas, events=events, terminated=self._terminated
        )
        self.processed = 0
        self.current: TaskMessage | None = None  # the request running now (the hard time limit's)
        # Per-task limits the time_limit command set: (hard, soft), kept by the worker's control thread.
        self.time_limits: dict[str, tuple[float | None, float | None]] = {}
        # The run just ended, until the next delivery: (request, done frame, runtime ms).
        self.concluding: tuple[TaskMessage, dict[str, Any], float] | None = None

    def handle(self, delivery: TaskDelivery) -> Handled:
        """The fate of one delivery (its task run here if it may run)."""
        self._outcomes.succeeded_ms = None
        self.concluding = None
        clear_contextvars()
        raw_id = delivery.headers.get("id")
        bind_contextvars(queue=delivery.queue, task_id=raw_id if isinstance(raw_id, str) else None)
        if self._canvas.redis is not None:
            self._canvas.redis.queue = delivery.queue  # result_extended's ``queue``
        ordered = delivery.queue in self._settings.ordered_queues
        if ordered and delivery.redelivered:
            # An ordered queue's failover: the one task its last consumer held comes first here,
            # and may have run (in part) there. Every line of its run carries the mark.
            bind_contextvars(ordered_redelivery=True)
            log.warning("ordered_redelivery")
        try:
            request = decode_task(
                delivery.body,
                delivery.headers,
                content_type=delivery.content_type,
                accept=self._accept,
                max_bytes=self._settings.max_body_bytes,
                correlation_id=delivery.correlation_id,
                reply_to=delivery.reply_to,
                priority=delivery.priority,
            )
        except MessageError as exc:
            rejected = self._answers.rejected(raw_id) if isinstance(raw_id, str) else None
            return self.ledger.decided(
                (self._answers.refuse(delivery, reason=type(exc).__name__, error=str(exc)), rejected)
            )
        self._clock.adjust(request.clock)
        bind_contextvars(task_name=request.display_name, attempt=request.retries + 1)
        if self.ledger.duplicate(request, redelivered=delivery.redelivered):
            return ACK, None  # running or finished in this worker within --dedupe-window
        return self.ledger.decided(self._guarded(delivery, request))

    def log_success(self) -> None:
        """The ``task_succeeded`` line of the delivery just settled, if its task succeeded."""
        outcomes = self._outcomes
        if outcomes.succeeded_ms is not None:
            success_log.info("task_succeeded", runtime_ms=outcomes.succeeded_ms)
            outcomes.succeeded_ms = None

    def _guarded(self, delivery: TaskDelivery, request: TaskMessage) -> Handled:
        # The guards, in order; one that passes them all runs.
        if delivery.queue == self._expired_queue:
            # Dead-lettered by the broker (the operator's policy): answered, never run.
            reason, origin = broker_dead_letter(delivery.headers)
            if reason == "expired":
                return self._answers.skip_revoked(request, expired=True), None
            return self._answers.dropped_by_broker(request, reason=reason, origin=origin)
        task = self._app.tasks.get(request.task)
        if task is None:
            if request.task in self._unknown:
                log.error("task_unknown", task_name=request.task)
            else:
                self._unknown.add(request.task)
                log.error("task_unknown", task_name=request.task, hint=UNKNOWN_TASK_HINT)
            self.ledger.unknown(request.task)
            not_registered = ("NotRegistered", request.task, CELERY_EXCEPTIONS_MODULE)
            return self._answers.fail(
                request, "NotRegistered", f"task {request.task!r} is not registered", exc=not_registered
            )
        if (why := canvas_plan.refusal(request, redis_chords=self._canvas.redis is not None)) is not None:
            return self._answers.cannot_honour(request, why), self._answers.rejected(request.id)
        if (
            gated := to_gate(task, request, delivery.headers, delivery.queue, self._settings.namespace)
        ) is not None:
            return gated, None  # its own dedup key, but it did not come through its gate
        if (limit_s := self._timed_out.get(request.id)) is not None:
            # The worker ended its child past its hard time limit (the task held the GIL, so the
            # child's watchdog could not): answered as the watchdog would have, not run again.
            log.error("task_time_limit_exceeded", limit_s=limit_s, ended_by="worker")
            self.time_limit_exceeded(request, limit_s)
            return ACK, None
        count = delivery_count(delivery.headers, redelivered=delivery.redelivered)
        if count > self._settings.delivery_limit:
            why = f"{count} deliveries did not finish (delivery_limit={self._settings.delivery_limit})"
            log.error("task_delivery_limit", deliveries=count)
            return self._answers.fail(
                request, DELIVERY_LIMIT_REASON, why, exc=("WorkerLostError", why, "billiard.exceptions")
            )
        # Not on an ordered queue: its copy would go to the back of the queue. There the broker's
        # x-delivery-count (quorum queues) counts; a classic queue counts only ``redelivered``.
        ordered = delivery.queue in self._settings.ordered_queues
        if not ordered and not carries_count(delivery.headers, redelivered=delivery.redelivered):
            # A classic queue keeps no count: a copy carries it, so a child that dies running
            # this task still brings it nearer the limit (the copy runs; this delivery is acked).
            log.info("task_redelivery_counted", deliveries=count)
            return recount(count), None
        if request.id in self._revoked or self._stamp_revoked(request):
            return self._answers.skip_revoked(request, expired=False), None
        if past_dedup_deadline(request):
            return self._answers.skip_revoked(request, expired=True), None  # evicted from its key
        if request.expires is not None or request.eta is not None:  # the clock only for a dated task
            now = dt.datetime.now(dt.UTC)
            if request.expires is not None and request.expires <= now:
                return self._answers.skip_revoked(request, expired=True), None
            if request.eta is not None and request.eta > now:
                left_s = (request.eta - now).total_seconds()
                bucket_ms = delay_bucket_ms(left_s, hold_window_s=DELAY_HOLD_WINDOW_S)
                if bucket_ms is not None:
                    self._parked.record(request, delivery_info(delivery))  # inspect scheduled lists it
                    return Disposition.republish({}, delay_ms=bucket_ms), None  # back when nearly due
                time.sleep(left_s)  # due within the hold window: this child waits for it
        if (parked := self._rate_limited(delivery, request, in_place=ordered)) is not None:
            return parked, None  # parked until its turn under the task's rate limit
        return self._execute(delivery, request)

    def _stamp_revoked(self, request: TaskMessage) -> bool:
        # Celery's rule: one of the stamps its stamped_headers lists has a revoked value.
        if not self._revoked_stamps or not request.stamped_headers:
            return False
        hit = self._revoked_stamps.matching(task_stamps(request.stamped_headers, request.stamps))
        if hit is not None:
            log.info("task_revoked_by_stamp", stamp=hit[0], value=hit[1])
        return hit is not None

    def _rate_limited(
        self, delivery: TaskDelivery, request: TaskMessage, *, in_place: bool
    ) -> Disposition | None:
        # A token is taken once per task: a copy parked for its turn comes back marked, due.
        # ``in_place`` (an ordered queue): it waits here, as the tasks behind it must.
        rates = self._rates
        if rates is None or delivery.headers.get(RATE_RESERVED_HEADER) is True:
            return None
        delay_s = rates.reserve(request.task)
        if delay_s <= 0:
            return None
        if delay_s <= DELAY_HOLD_WINDOW_S or in_place:
            time.sleep(delay_s)  # due within the hold window: this child waits for it
            return None
        # Its turn is later: it waits in the broker, not in this child, so other tasks go on.
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay_s)
        log.debug("task_rate_limited", delay_s=round(delay_s, 3))
        bucket_ms = delay_bucket_ms(delay_s, hold_window_s=DELAY_HOLD_WINDOW_S)
        return Disposition.republish({"eta": due.isoformat(), RATE_RESERVED_HEADER: True}, delay_ms=bucket_ms)

    def _execute(self, delivery: TaskDelivery, request: TaskMessage) -> Handled:
        task = self._app.tasks[request.task]
        hard, soft = time_limits(
            request,
            task,
            override=self.time_limits.get(request.task, (None, None)),
            defaults=self._spec.default_time_limits,
        )
        job = Job(
            task_id=request.id,
            task_name=request.task,
            args=request.args,
            kwargs=request.kwargs,
            request=request_context(
                request,
                delivery_info(delivery),
                hostname=self._spec.hostname,
                properties=message_properties(delivery.properties),
            ),
            hard_time_limit_s=hard,
            soft_time_limit_s=soft,
        )
        events = self.events
        if signals.task_received.has_receivers:
            signals.task_received.send(sender=self, request=request)
        if events.enabled:  # off by default: skip the reprs
            events.send(
                "task-received", uuid=request.id, name=request.task, args=safe_repr(tuple(request.args)),
                kwargs=safe_repr(request.kwargs), root_id=request.root_id, parent_id=request.parent_id,
                retries=request.retries, **eta_and_expires(request),
            )  # fmt: skip
            events.send("task-started", uuid=request.id)
        self._states.record(request, State.STARTED)
        started = time.monotonic()
        self.current = request
        try:
            done = self._run(job)
        finally:
            self.current = None
        runtime_ms = round((time.monotonic() - started) * 1000, 3)
        self.processed += 1
        # From here the run's outcome is owed even if the connection fails while it goes out.
        self.concluding = (request, done, runtime_ms)
        return self._outcomes.conclude(request, done, runtime_ms)

    def conclude_again(self) -> Handled | None:
        """The last run's outcome once more (its connection failed while it went out); None if none ran.

        The child connects again first. Results, chord parts and events may go out twice; the
        caller keeps the first result and the chord joiner counts a part once.
        """
        if self.concluding is None:
            return None
        request, done, runtime_ms = self.concluding
        return self.ledger.decided(self._outcomes.conclude(request, done, runtime_ms))

    def update(self, payload: dict[str, Any]) -> None:
        """The running task reported a state (``update_state``, STARTED): to its caller, confirmed."""
        request, state = self.current, payload.get("state")
        if request is None or not isinstance(state, str) or not state:
            log.warning("task_update_ignored", state=state)
            return
        try:
            self._answers.reply(
                request, Outcome(task_id=request.id, status=state, result=payload.get("meta"))
            )
        except Exception as exc:  # a lost progress update must not fail the task
            log.warning("task_update_not_sent", state=state, error=str(exc))

    def time_limit_exceeded(self, request: TaskMessage, limit_s: float | None) -> None:
        """Answer a task past its hard time limit as failed (its child is about to end)."""
        self._answers.failed(request, wire_exception("TimeLimitExceeded", limit_s), None)
        self.ledger.time_limit_exceeded(request, limit_s or 0.0)
