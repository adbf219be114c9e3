"""The answers a consuming child gives a task: to its caller, its chord, its errbacks, and in events.

``FeedHandler`` (``worker/consume/handle.py``) decides a delivery's fate; these are what it owes on the
way: a result to ``reply_to`` (unless results are ignored), a refusal of poison input or of a canvas
the child cannot honour, a revoked task skipped, a failure for good. Each returns the delivery's
:class:`~worker.rules.disposition.Disposition` where it decides one; the settle point carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from broker_svc import signals
from broker_svc.amqp.feed_connection import TaskDelivery
from broker_svc.app import App
from broker_svc.wire.codec import reply_type
from broker_svc.wire.event_fields import describe_repr
from broker_svc.wire.records.task_state import WORKER_STATES, result_expiration
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import TaskMessage
from worker.consume.canvas import FeedCanvas
from worker.consume.ledger import FeedLedger
from worker.consume.records.events import FeedEvents
from worker.consume.records.states import FeedStates
from worker.consume.replies import FeedReplies
from worker.rules import canvas_plan
from worker.rules.disposition import ACK, Disposition
from worker.rules.job_request import reply_wanted, result_stored

__all__ = ["FeedAnswers", "Handled"]

log = structlog.get_logger(__name__)

# A delivery's disposition, and what it owes once its copy is confirmed (before the ack).
Handled = tuple[Disposition, Callable[[], None] | None]


class FeedAnswers:
    """What a consuming child tells a task's caller, chord and watchers, and the dispositions that go with it.

    Args:
        app: the app whose tasks run here (for ``ignore_result`` and ``store_errors_even_if_ignored``).
        replies: publishes results, confirmed.
        canvas: the child's follow-ups and chord parts.
        events: sends task events.
        ledger: the child's counts (revoked tasks).
        terminated: ids whose child the worker ended, with the signal (kept by the control thread).
        states: writes each outcome to the task-state stream (``task_states``).
    """

    def __init__(
        self,
        *,
        app: App,
        replies: FeedReplies,
        canvas: FeedCanvas,
        events: FeedEvents,
        ledger: FeedLedger,
        terminated: Mapping[str, int],
        states: FeedStates | None = None,
    ) -> None:
        self._app = app
        self._states = states
        self._replies = replies
        self._canvas = canvas
        self._events = events
        self._ledger = ledger
        self._terminated = terminated

    def failed(self, request: TaskMessage, error: dict[str, Any], traceback: str | None) -> None:
        """A failure for good: the caller, the chord and the errbacks learn of it."""
        self.reply(
            request,
            Outcome(task_id=request.id, status=State.FAILURE, result=error, traceback=traceback),
            failed=True,
        )
        self._canvas.chord_part(request, State.FAILURE, error)
        if canvas_plan.wants_anything(request):
            self._canvas.after_failure(request)
        self._events.send(
            "task-failed", uuid=request.id, exception=describe_repr(error), traceback=traceback or ""
        )

    def rejected(self, task_id: str) -> Callable[[], None]:
        """Sent once the dead letter is confirmed: the task is rejected only if it is kept there."""
        return lambda: self._events.send("task-rejected", uuid=task_id, requeue=False)

    def skip_revoked(self, request: TaskMessage, *, expired: bool) -> Disposition:
        """A revoked or expired task, answered as such and acked unrun."""
        # A copy of a task whose child the worker ended (terminate) is answered as terminated: the
        # run it had was the one the caller asked to end.
        signum = None if expired else self._terminated.get(request.id)
        terminated = signum is not None
        reason = "expired" if expired else "terminated" if terminated else "revoked"
        if terminated:
            log.warning("task_terminated", signum=signum)
        else:
            log.info("task_revoked_skipped", reason=reason)
        self._ledger.revoked(request.task)
        error = wire_exception("TaskRevokedError", reason)
        self.reply(request, Outcome(task_id=request.id, status=State.REVOKED, result=error))
        self._canvas.chord_part(request, State.REVOKED, error)
        self._events.send(
            "task-revoked", uuid=request.id, terminated=terminated,
            signum=str(signum) if terminated else None, expired=expired,
        )  # fmt: skip
        signals.task_revoked.send(
            sender=request.task, request=request, terminated=terminated, signum=signum, expired=expired
        )
        return ACK

    def dropped_by_broker(self, request: TaskMessage, *, reason: str, origin: str | None) -> Handled:
        """A task RabbitMQ dead-lettered for another reason than expiry (a length limit, say).

        It reached ``clockwork.expired`` through the operator's policy; it is not run, its caller
        gets a FAILURE saying why, and it is kept in ``clockwork.expired.dead``.
        """
        why = f"the broker dead-lettered this task from queue {origin!r} ({reason}); it did not run"
        log.error("task_dropped_by_broker", reason=reason, origin=origin)
        return self.fail(request, f"broker_{reason}", why, exc=("RuntimeError", why, "builtins"))

    def cannot_honour(self, request: TaskMessage, why: str) -> Disposition:
        """A canvas field the child cannot honour: refused, dead-lettered, its callers told why."""
        # Refused before it runs, as a whole: running part of a canvas and dropping the rest
        # would lose work silently. Its caller (and a chord body's) learns why.
        log.error("task_canvas_refused", why=why)
        error = wire_exception("NotImplementedError", why, module="builtins")
        self.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True)
        body = request.embed.get("chord")
        options = body.get("options") if isinstance(body, Mapping) else None
        reply_to = (options or {}).get("reply_to") or request.reply_to
        if isinstance(options, Mapping) and isinstance(options.get("task_id"), str):
            refused = wire_exception("ChordError", f"chord refused: {why}")
            body_failed = Outcome(task_id=options["task_id"], status=State.FAILURE, result=refused)
            if self._canvas.redis is not None:
                self._canvas.redis.store_alone(body_failed)
            if reply_to:
                self._replies.result(
                    body_failed, reply_to=reply_to, correlation_id=options["task_id"],
                    content_type=reply_type(request.content_type),
                )  # fmt: skip
        return Disposition.dead_letter("unsupported_canvas", why)

    def fail(self, request: TaskMessage, reason: str, why: str, *, exc: tuple[str, str, str]) -> Handled:
        """A task that will never run here: its caller learns why, the message is kept."""
        exc_type, message, module = exc
        error = wire_exception(exc_type, message, module=module)
        self.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True)
        self._canvas.chord_part(request, State.FAILURE, error)
        return Disposition.dead_letter(reason, why), self.rejected(request.id)

    def refuse(self, delivery: TaskDelivery, *, reason: str, error: str) -> Disposition:
        """Poison input: dead-lettered; a caller we can name gets a FAILURE."""
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

    def reply(self, request: TaskMessage, outcome: Outcome, *, failed: bool = False) -> None:
        """To ``reply_to``, unless results are ignored (a final failure goes when errors are stored),
        and first to the Redis result backend when the app has one.

        Raises:
            BrokerSvcError: the result was not confirmed, or not stored in Redis (the delivery
                must not be acked).
        """
        if self._states is not None and outcome.status in WORKER_STATES:
            self._states.record(request, outcome.status, outcome.result)
        backend = self._canvas.redis
        if backend is not None and result_stored(request, self._app.tasks.get(request.task), failed=failed):
            backend.store(request, outcome)
        reply_to = request.reply_to
        if reply_to is None or not reply_wanted(request, self._app.tasks.get(request.task), failed=failed):
            return
        self._replies.result(
            outcome,
            reply_to=reply_to,
            correlation_id=request.correlation_id,
            content_type=reply_type(request.content_type),
            expiration=result_expiration(request.extra_headers),
            task_name=request.task,
        )
