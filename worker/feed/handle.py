"""One delivery in a consuming child: decode, the guards, the run, its outcome → the delivery's disposition.

The child's counterpart of ``worker/consume/consumer.py`` and ``outcomes.py``, on the blocking side:
every step decides a :class:`~worker.consume.disposition.Disposition` and the child's settle point
(``worker/feed/settle.py``) carries it out. What a consuming child cannot do yet (task events, the
autoscaler, runtime changes) is refused when the worker starts or by the control command, never
silently skipped.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping, Set
from pathlib import Path
from typing import Any, Final

import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.connection.feed_connection import TaskDelivery
from broker_svc.errors import MessageError
from broker_svc.topology import DELAY_HOLD_WINDOW_S, delay_bucket_ms
from broker_svc.wire import codec
from broker_svc.wire.codec import reply_type
from broker_svc.wire.result_message import CELERY_EXCEPTIONS_MODULE, Outcome, wire_exception
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage, decode_task, eta_and_expires, safe_repr
from worker.consume import canvas_plan
from worker.consume.admission import DELIVERY_LIMIT_REASON, carries_count, delivery_count, recount
from worker.consume.disposition import ACK, HAND_BACK, Disposition, retry_copy, retry_eta
from worker.consume.job_request import delivery_info, request_context, time_limits
from worker.consume.rate_limits import RATE_RESERVED_HEADER
from worker.event_fields import describe_repr
from worker.feed.canvas import FeedCanvas
from worker.feed.events import FeedEvents
from worker.feed.rates import SharedRates
from worker.feed.replies import FeedReplies
from worker.feed.spec import FeedSpec
from worker.pool import ipc
from worker.pool.ipc import Job, JobStatus

__all__ = ["FeedHandler", "FeedUpdates", "Handled"]

log = structlog.get_logger(__name__)

# A delivery's disposition, and what it owes once its copy is confirmed (before the ack).
Handled = tuple[Disposition, Callable[[], None] | None]


class FeedHandler:
    """Decides each delivery's fate in a consuming child, running its task when it may run.

    Args:
        app: the app whose tasks run here.
        spec: the child's start-up order (settings, hostname, default time limits).
        replies: publishes results, confirmed.
        revoked: ids revoked so far (the child's socket adds to it).
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
        clock: LamportClock,
        run: Callable[[Job], dict[str, Any]],
        events: FeedEvents,
    ) -> None:
        self._app = app
        self._spec = spec
        self._settings = spec.settings
        self._accept = codec.accept_set(spec.settings.accept_content)
        self._replies = replies
        self._revoked = revoked
        self._clock = clock
        self._run = run
        self.events = events  # task-* events while enabled (-E, enable_events)
        self._rates = (
            SharedRates(Path(spec.rates_path), spec.task_names, owner=False) if spec.rates_path else None
        )
        self._canvas = FeedCanvas(app=app, replies=replies, namespace=spec.namespace)
        self.processed = 0
        self.current: TaskMessage | None = None  # the request running now (the hard time limit's)
        # Per-task limits the time_limit command set: (hard, soft), kept by the worker's control thread.
        self.time_limits: dict[str, tuple[float | None, float | None]] = {}

    def handle(self, delivery: TaskDelivery) -> Handled:
        """The fate of one delivery (its task run here if it may run)."""
        clear_contextvars()
        raw_id = delivery.headers.get("id")
        bind_contextvars(queue=delivery.queue, task_id=raw_id if isinstance(raw_id, str) else None)
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
            rejected = self._rejected(raw_id) if isinstance(raw_id, str) else None
            return self._refuse(delivery, reason=type(exc).__name__, error=str(exc)), rejected
        self._clock.adjust(request.clock)
        bind_contextvars(task_name=request.display_name, attempt=request.retries + 1)
        return self._guarded(delivery, request)

    def _guarded(self, delivery: TaskDelivery, request: TaskMessage) -> Handled:
        # The guards, in the worker consumer's order; one that passes them all runs.
        task = self._app.tasks.get(request.task)
        if task is None:
            log.error("task_unknown", task_name=request.task)
            return self._fail(request, "NotRegistered", f"task {request.task!r} is not registered", exc=(
                "NotRegistered", request.task, CELERY_EXCEPTIONS_MODULE,
            ))  # fmt: skip
        if (why := canvas_plan.refusal(request)) is not None:
            return self._cannot_honour(request, why), self._rejected(request.id)
        count = delivery_count(delivery.headers, redelivered=delivery.redelivered)
        if count > self._settings.delivery_limit:
            why = f"{count} deliveries did not finish (delivery_limit={self._settings.delivery_limit})"
            log.error("task_delivery_limit", deliveries=count)
            return self._fail(
                request, DELIVERY_LIMIT_REASON, why, exc=("WorkerLostError", why, "billiard.exceptions")
            )
        if not carries_count(delivery.headers, redelivered=delivery.redelivered):
            # A classic queue keeps no count: a copy carries it, so a child that dies running
            # this task still brings it nearer the limit (the copy runs; this delivery is acked).
            log.info("task_redelivery_counted", deliveries=count)
            return recount(count), None
        if request.id in self._revoked:
            return self._skip_revoked(request, expired=False), None
        now = dt.datetime.now(dt.UTC)
        if request.expires is not None and request.expires <= now:
            return self._skip_revoked(request, expired=True), None
        if request.eta is not None and request.eta > now:
            left_s = (request.eta - now).total_seconds()
            bucket_ms = delay_bucket_ms(left_s, hold_window_s=DELAY_HOLD_WINDOW_S)
            if bucket_ms is not None:
                return Disposition.republish({}, delay_ms=bucket_ms), None  # back when nearly due
            time.sleep(left_s)  # due within the hold window: this child waits for it
        if (parked := self._rate_limited(delivery, request)) is not None:
            return parked, None  # parked until its turn under the task's rate limit
        return self._execute(delivery, request)

    def _rate_limited(self, delivery: TaskDelivery, request: TaskMessage) -> Disposition | None:
        # A token is taken once per task: a copy parked for its turn comes back marked, due.
        rates = self._rates
        if rates is None or delivery.headers.get(RATE_RESERVED_HEADER) is True:
            return None
        delay_s = rates.reserve(request.task)
        if delay_s <= 0:
            return None
        if delay_s <= DELAY_HOLD_WINDOW_S:
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
            request=request_context(request, delivery_info(delivery), hostname=self._spec.hostname),
            hard_time_limit_s=hard,
            soft_time_limit_s=soft,
        )
        events = self.events
        if events.enabled:  # off by default: skip the reprs
            events.send(
                "task-received", uuid=request.id, name=request.task, args=safe_repr(tuple(request.args)),
                kwargs=safe_repr(request.kwargs), root_id=request.root_id, parent_id=request.parent_id,
                retries=request.retries, **eta_and_expires(request),
            )  # fmt: skip
            events.send("task-started", uuid=request.id)
        started = time.monotonic()
        self.current = request
        try:
            done = self._run(job)
        finally:
            self.current = None
        runtime_ms = round((time.monotonic() - started) * 1000, 3)
        self.processed += 1
        status = JobStatus(done["status"])
        if status is JobStatus.SUCCESS:
            log.info("task_succeeded", runtime_ms=runtime_ms)
            canvas = canvas_plan.wants_anything(request)
            planned = canvas_plan.after_success(request, done["value"]) if canvas else []
            # Celery's result.children: what the body sent, then the callbacks and the next step.
            sent = [*(done.get("children") or ()), *(item.message.id for item in planned)]
            children = [[[child, None], None] for child in sent]
            value = done["value"]
            self._reply(
                request, Outcome(task_id=request.id, status=State.SUCCESS, result=value, children=children)
            )
            self._canvas.chord_part(request, State.SUCCESS, value)
            if planned:
                self._canvas.send(planned, why="after_success")
            if events.enabled:
                events.send(
                    "task-succeeded", uuid=request.id, result=safe_repr(value), runtime=runtime_ms / 1000
                )
            return _FINISHED, None
        if status is JobStatus.IGNORED:
            log.info("task_ignored", runtime_ms=runtime_ms)
            return _FINISHED, None
        error = done.get("error") or wire_exception("Exception", "unknown failure", module="builtins")
        if status is JobStatus.RETRY:
            return self._retry(request, done, error)
        if status is JobStatus.REJECTED:
            if isinstance(done.get("value"), dict) and done["value"].get("requeue"):
                log.info("task_rejected_requeued")
                events.send("task-rejected", uuid=request.id, requeue=True)
                return HAND_BACK, None
            log.warning("task_rejected", error=_describe(error))
            self._reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True)
            self._canvas.chord_part(request, State.FAILURE, error)
            return Disposition.dead_letter("rejected", _describe(error), finished=True), self._rejected(
                request.id
            )
        log.warning("task_failed", runtime_ms=runtime_ms, error=error, traceback=done.get("traceback"))
        self._failed(request, error, done.get("traceback"))
        if done.get("retries_exhausted"):
            why = f"failed after {request.retries} retries: {_describe(error)}"
            return Disposition.dead_letter("max_retries_exceeded", why, ran=True, finished=True), None
        return _FINISHED, None

    def _retry(self, request: TaskMessage, done: dict[str, Any], error: dict[str, Any]) -> Handled:
        # The copy (same id, retries + 1, new eta) is confirmed before the original is acked; only
        # then are the log line and the RETRY state true.
        value = done["value"] if isinstance(done.get("value"), dict) else {}
        when = retry_eta(value)
        eta = when.isoformat()
        left_s = (when - dt.datetime.now(dt.UTC)).total_seconds()
        delay_ms = delay_bucket_ms(left_s, hold_window_s=DELAY_HOLD_WINDOW_S)

        def announce() -> None:
            log.info("task_retried", retries=request.retries + 1, eta=eta, error=_describe(error))
            self.events.send(
                "task-retried",
                uuid=request.id,
                exception=describe_repr(error),
                traceback=done.get("traceback") or "",
            )
            self._reply(
                request,
                Outcome(
                    task_id=request.id, status=State.RETRY, result=error, traceback=done.get("traceback")
                ),
            )

        return retry_copy(request, value, eta, delay_ms=delay_ms), announce

    def update(self, payload: dict[str, Any]) -> None:
        """The running task reported a state (``update_state``, STARTED): to its caller, confirmed."""
        request, state = self.current, payload.get("state")
        if request is None or not isinstance(state, str) or not state:
            log.warning("task_update_ignored", state=state)
            return
        try:
            self._reply(request, Outcome(task_id=request.id, status=state, result=payload.get("meta")))
        except Exception as exc:  # a lost progress update must not fail the task
            log.warning("task_update_not_sent", state=state, error=str(exc))

    def time_limit_exceeded(self, request: TaskMessage, limit_s: float | None) -> None:
        """Answer a task past its hard time limit as failed (its child is about to end)."""
        self._failed(request, wire_exception("TimeLimitExceeded", limit_s), None)

    def _failed(self, request: TaskMessage, error: dict[str, Any], traceback: str | None) -> None:
        # A failure for good: the caller, the chord and the errbacks learn of it.
        self._reply(
            request,
            Outcome(task_id=request.id, status=State.FAILURE, result=error, traceback=traceback),
            failed=True,
        )
        self._canvas.chord_part(request, State.FAILURE, error)
        if canvas_plan.wants_anything(request):
            self._canvas.after_failure(request)
        self.events.send(
            "task-failed", uuid=request.id, exception=describe_repr(error), traceback=traceback or ""
        )

    def _rejected(self, task_id: str) -> Callable[[], None]:
        # Sent once the dead letter is confirmed: the task is rejected only if it is kept there.
        return lambda: self.events.send("task-rejected", uuid=task_id, requeue=False)

    def _skip_revoked(self, request: TaskMessage, *, expired: bool) -> Disposition:
        reason = "expired" if expired else "revoked"
        log.info("task_revoked_skipped", reason=reason)
        error = wire_exception("TaskRevokedError", reason)
        self._reply(request, Outcome(task_id=request.id, status=State.REVOKED, result=error))
        self._canvas.chord_part(request, State.REVOKED, error)
        self.events.send("task-revoked", uuid=request.id, terminated=False, signum=None, expired=expired)
        return ACK

    def _cannot_honour(self, request: TaskMessage, why: str) -> Disposition:
        # Refused before it runs, as a whole: running part of a canvas and dropping the rest
        # would lose work silently. Its caller (and a chord body's) learns why.
        log.error("task_canvas_refused", why=why)
        error = wire_exception("NotImplementedError", why, module="builtins")
        self._reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True)
        body = request.embed.get("chord")
        options = body.get("options") if isinstance(body, Mapping) else None
        reply_to = (options or {}).get("reply_to") or request.reply_to
        if isinstance(options, Mapping) and isinstance(options.get("task_id"), str) and reply_to:
            refused = wire_exception("ChordError", f"chord refused: {why}")
            self._replies.result(
                Outcome(task_id=options["task_id"], status=State.FAILURE, result=refused),
                reply_to=reply_to,
                correlation_id=options["task_id"],
                content_type=reply_type(request.content_type),
            )
        return Disposition.dead_letter("unsupported_canvas", why)

    def _fail(self, request: TaskMessage, reason: str, why: str, *, exc: tuple[str, str, str]) -> Handled:
        # A task that will never run here: its caller learns why, the message is kept.
        exc_type, message, module = exc
        error = wire_exception(exc_type, message, module=module)
        self._reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True)
        self._canvas.chord_part(request, State.FAILURE, error)
        return Disposition.dead_letter(reason, why), self._rejected(request.id)

    def _refuse(self, delivery: TaskDelivery, *, reason: str, error: str) -> Disposition:
        # Poison input: dead-lettered; a caller we can name gets a FAILURE.
        log.error(
            "task_refused",
            reason=reason,
            error=error,
            size=len(delivery.body),
            content_type=delivery.content_type,
        )
        task_id = delivery.headers.get("id")
        if isinstance(task_id, str) and delivery.reply_to:
            exc_type = "ContentDisallowed" if reason == "ContentDisallowed" else "InvalidTaskError"
            self._replies.result(
                Outcome(task_id=task_id, status=State.FAILURE, result=wire_exception(exc_type, error)),
                reply_to=delivery.reply_to,
                correlation_id=delivery.correlation_id,
                content_type=reply_type(delivery.content_type),
            )
        return Disposition.dead_letter(reason, error)

    def _reply(self, request: TaskMessage, outcome: Outcome, *, failed: bool = False) -> None:
        # To ``reply_to``, unless results are ignored (a final failure goes when errors are stored).
        if request.reply_to is None:
            return
        task = self._app.tasks.get(request.task)
        ignored = request.ignore_result or (task is not None and task.ignore_result)
        if ignored and not (failed and task is not None and task.store_errors_even_if_ignored):
            return
        self._replies.result(
            outcome,
            reply_to=request.reply_to,
            correlation_id=request.correlation_id,
            content_type=reply_type(request.content_type),
        )


class FeedUpdates:
    """Where a running task's updates go in a consuming child: published by the child itself.

    Stands where a job-taking child has the worker's socket (``worker.pool.child.UpdateSink``).
    """

    def __init__(self, handler: FeedHandler) -> None:
        self.lock = threading.Lock()
        self._handler = handler

    def send(self, data: bytes, *, context: Any = None) -> None:
        with self.lock:
            if context is not None and not context.open:
                raise RuntimeError("the task has already finished; its updates are closed")
            frame = ipc.decode_frame(data[ipc.HEADER.size :])
            payload = frame.get("payload")
            self._handler.update(payload if isinstance(payload, dict) else {})


# A run that ended in a final outcome: its delivery is simply acked.
_FINISHED: Final = Disposition(ACK.fate, ran=True, finished=True)


def _describe(error: dict[str, Any]) -> str:
    message = error.get("exc_message")
    text = ", ".join(map(str, message)) if isinstance(message, list) else str(message)
    return f"{error.get('exc_type')}: {text}"
