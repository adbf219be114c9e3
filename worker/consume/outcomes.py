"""What happens after a job ends: the result to the client, and the delivery's disposition."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker_svc import signals
from broker_svc.app import App
from broker_svc.canvas.follow_ups import FollowUp
from broker_svc.wire.codec import reply_type
from broker_svc.wire.event_fields import describe_repr
from broker_svc.wire.result_message import (
    CELERY_EXCEPTIONS_MODULE,
    Outcome,
    describe_wire_exception,
    wire_exception,
)
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage, safe_repr
from broker_svc.wire.task_state import WORKER_STATES, result_expiration
from worker.consume.admission import DELIVERY_LIMIT_REASON, delivery_count, expected_failure, recount
from worker.consume.canvas import Canvas
from worker.consume.disposition import retry_copy, retry_eta
from worker.consume.eta import EtaScheduler
from worker.consume.job_request import reply_wanted
from worker.consume.publish import ReplyPublisher
from worker.consume.settle import HAND_BACK, LEFT_TO_BROKER, Disposition, Fate
from worker.consume.states import TaskStates
from worker.events import EventDispatcher
from worker.pool.pool import JobOutcome, JobStatus

if TYPE_CHECKING:
    import aio_pika.abc

__all__ = ["OutcomeHandler"]

log = structlog.get_logger(__name__)

_STATUS_TO_STATE: Final = {
    JobStatus.SUCCESS: State.SUCCESS,
    JobStatus.FAILURE: State.FAILURE,
    JobStatus.TIME_LIMIT: State.FAILURE,
    JobStatus.TERMINATED: State.REVOKED,
    JobStatus.LOST: State.FAILURE,
    JobStatus.RETRY: State.RETRY,
}


class OutcomeHandler:
    """Publishes states and outcomes in order, and decides what becomes of each finished delivery.

    Args:
        app: the app (for per-task ``ignore_result``).
        replies: the confirm-mode publisher for results.
        eta: where retries are parked until due.
        events: where task-* events go.
        delivery_limit: how many deliveries of one message may end without finishing (its child or
            worker died) before the next is dead-lettered (``worker.consume.admission``).
        namespace: the control namespace, which names the chord join queue.
        states: writes each outcome to the task-state stream (``task_states``).
    """

    def __init__(
        self,
        *,
        app: App,
        replies: ReplyPublisher,
        eta: EtaScheduler,
        events: EventDispatcher,
        delivery_limit: int,
        namespace: str = "celery",
        states: TaskStates | None = None,
    ) -> None:
        self._app = app
        self._states = states
        self._replies = replies
        self._eta = eta
        self._events = events
        self._delivery_limit = delivery_limit
        # A chain's next step, callbacks and errbacks (worker.consume.canvas).
        self._canvas = Canvas(app=app, replies=replies, namespace=namespace)
        # Each running task's chain of update publishes: updates, then the outcome, in order.
        self._updates: dict[str, asyncio.Future[None]] = {}
        self.processed = 0
        self.totals: collections.Counter[str] = collections.Counter()

    def update(self, request: TaskMessage, payload: dict[str, Any]) -> None:
        """A running task reported a state (``update_state``, STARTED): send it, in order."""
        state = payload.get("state")
        if not isinstance(state, str) or not state:
            log.warning("task_update_ignored", task_id=request.id)
            return
        task_id = request.id
        outcome = Outcome(task_id=task_id, status=state, result=payload.get("meta"))
        previous = self._updates.get(task_id)
        self._updates[task_id] = asyncio.ensure_future(self._publish_update(previous, request, outcome))

    async def _publish_update(
        self, previous: asyncio.Future[None] | None, request: TaskMessage, outcome: Outcome
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            await self.reply(request, outcome)
        except Exception as exc:  # a lost progress update must not fail the task
            log.warning("task_update_not_sent", state=outcome.status, error=str(exc))

    async def finish(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        request: TaskMessage,
        outcome: JobOutcome,
        *,
        stopping: bool,
        signum: int | None = None,
    ) -> Disposition:
        """Report a job's outcome to its client; what becomes of its delivery (ack, retry, dead letter).

        ``signum`` is the signal a ``revoke(terminate=True)`` sent, if any.
        """
        self.processed += 1
        self.totals[request.task] += 1
        runtime_ms = round(outcome.runtime_s * 1000, 3)
        if outcome.status == JobStatus.LOST:
            if stopping:
                return LEFT_TO_BROKER  # killed at the shutdown deadline: unacked, so the broker redelivers it
            return await self._child_lost(message, request, outcome)
        pending_updates = self._updates.pop(request.id, None)
        if pending_updates is not None:
            await asyncio.wait([pending_updates])  # progress first, then the outcome
        if outcome.status == JobStatus.RETRY:
            return self._retry(request, outcome)
        if outcome.status == JobStatus.IGNORED:
            log.info("task_ignored", runtime_ms=runtime_ms)  # the task saw to its own outcome
            return _FINISHED
        if outcome.status == JobStatus.REJECTED:
            return await self._rejected(request, outcome)
        state = _STATUS_TO_STATE[outcome.status]
        planned: list[FollowUp] = []
        if outcome.status == JobStatus.SUCCESS:
            log.info("task_succeeded", runtime_ms=runtime_ms, pid=outcome.pid)
            if Canvas.wants_anything(request):
                planned = Canvas.after_success(request, outcome.value)
            # Celery's result.children: what the body sent, then the callbacks and the next step.
            children = [*outcome.children, *(item.message.id for item in planned)]
            result = Outcome(
                task_id=request.id, status=state, result=outcome.value, children=_child_tuples(children)
            )
            if self._events.task_events:  # off by default: skip the repr and the coroutine
                await self._events.send(
                    "task-succeeded",
                    uuid=request.id,
                    result=safe_repr(outcome.value),
                    runtime=outcome.runtime_s,
                )
        elif outcome.status == JobStatus.TERMINATED:
            log.warning("task_terminated", runtime_ms=runtime_ms, signum=signum)
            result = Outcome(task_id=request.id, status=state, result=outcome.error)
            await self._events.send(
                "task-revoked",
                uuid=request.id,
                terminated=True,
                signum=str(signum) if signum is not None else None,
                expired=False,
            )
            signals.task_revoked.send(
                sender=request.task, request=request, terminated=True, signum=signum, expired=False
            )
        else:
            if self._expected(request.task, outcome.error):
                described = describe_wire_exception(outcome.error)
                log.info("task_failed_expected", runtime_ms=runtime_ms, error=described)
            else:
                # Once per task, with its traceback (retries log task_retried without one).
                log.warning(
                    "task_failed", runtime_ms=runtime_ms, status=outcome.status.value, error=outcome.error,
                    traceback=outcome.traceback,
                )  # fmt: skip
            error = outcome.error or wire_exception("Exception", "unknown failure", module="builtins")
            result = Outcome(task_id=request.id, status=state, result=error, traceback=outcome.traceback)
            await self._events.send(
                "task-failed",
                uuid=request.id,
                exception=describe_repr(error),
                traceback=outcome.traceback or "",
            )
        await self.reply(request, result, failed=state == State.FAILURE)
        await self.chord_part(request, state, result.result)
        if Canvas.wants_anything(request):
            # Confirmed before the ack (at-least-once): the caller's get() on a later step waits.
            if outcome.status == JobStatus.SUCCESS:
                await self._canvas.send(planned, why="after_success")
            elif state == State.FAILURE:
                await self._canvas.after_failure(request)
        if outcome.retries_exhausted:
            return Disposition.dead_letter(
                "max_retries_exceeded",
                f"failed after {request.retries} retries: {describe_wire_exception(outcome.error)}",
                ran=True,
                finished=True,
            )
        return _FINISHED

    def _retry(self, request: TaskMessage, outcome: JobOutcome) -> Disposition:
        # The copy (same id, retries + 1, new eta) is confirmed by the broker before the original
        # is acked: a failed republish raises there and the original goes back to the queue. Only
        # then are the retry's log line, event and RETRY state true.
        value = outcome.value if isinstance(outcome.value, dict) else {}
        when = retry_eta(value)
        eta = when.isoformat()

        async def announce() -> None:
            described = describe_wire_exception(outcome.error)
            log.info("task_retried", retries=request.retries + 1, eta=eta, error=described)
            error = outcome.error or wire_exception("Retry", "retry", module=CELERY_EXCEPTIONS_MODULE)
            await self._events.send(
                "task-retried",
                uuid=request.id,
                exception=describe_repr(error),
                traceback=outcome.traceback or "",
            )
            await self.reply(request, Outcome(
                task_id=request.id, status=State.RETRY, result=error, traceback=outcome.traceback
            ))  # fmt: skip

        return retry_copy(request, value, eta, delay_ms=self._eta.bucket_for(when), owed=announce)

    async def _rejected(self, request: TaskMessage, outcome: JobOutcome) -> Disposition:
        # ``Reject(requeue=True)`` hands it back (each time counts toward the delivery limit);
        # otherwise the caller learns of it and the message is kept in the dead-letter queue.
        value = outcome.value if isinstance(outcome.value, dict) else {}
        requeue = bool(value.get("requeue"))
        await self._events.send("task-rejected", uuid=request.id, requeue=requeue)
        if requeue:
            log.info("task_rejected_requeued")
            return HAND_BACK
        error = outcome.error or wire_exception("Reject", "rejected", module=CELERY_EXCEPTIONS_MODULE)
        log.warning("task_rejected", error=describe_wire_exception(error))
        await self.reply(
            request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True
        )
        await self.chord_part(request, State.FAILURE, error)
        return Disposition.dead_letter("rejected", describe_wire_exception(error), finished=True)

    async def _child_lost(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage, outcome: JobOutcome
    ) -> Disposition:
        # The broker saw nothing fail (our connection is fine), so the count goes on a copy.
        count = delivery_count(message.headers, redelivered=message.redelivered) + 1
        if count > self._delivery_limit:
            why = f"its child died; {count} deliveries did not finish (delivery_limit={self._delivery_limit})"
            return await self.limit_reached(request, error=outcome.error, why=why, ran=True)
        log.warning("task_child_lost_retrying", deliveries=count, error=outcome.error)
        return recount(count, ran=True)

    async def limit_reached(
        self, request: TaskMessage, *, error: dict[str, Any] | None, why: str, ran: bool = False
    ) -> Disposition:
        """Answer a message past the delivery limit as a task whose worker died; dead-letter it.

        Celery's name for a task whose process died under it (``WorkerLostError``) goes to the
        client first; the ``task-failed`` event follows once the dead letter is confirmed.
        """
        log.error("task_delivery_limit_reached", why=why)
        failure = error or wire_exception("WorkerLostError", why, module="billiard.exceptions")
        await self.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=failure))
        await self.chord_part(request, State.FAILURE, failure)

        async def announce() -> None:
            await self._events.send(
                "task-failed", uuid=request.id, exception=describe_repr(failure), traceback=""
            )

        return Disposition.dead_letter(DELIVERY_LIMIT_REASON, why, owed=announce, ran=ran)

    def _expected(self, name: str, error: dict[str, Any] | None) -> bool:
        # A failure with one of the task's ``throws`` classes is part of its contract, not an error.
        task = self._app.tasks.get(name)
        return task is not None and expected_failure(task.throws, error)

    async def chord_part(self, request: TaskMessage, state: State, result: Any) -> None:
        """A chord header task ended for good: its part goes to the chord's joiner (confirmed)."""
        if request.embed.get("chord") is not None:
            await self._canvas.chord_part(request, state, result)

    async def reply(self, request: TaskMessage, outcome: Outcome, *, failed: bool = False) -> None:
        """Publish a state to the task's ``reply_to``, unless results are ignored.

        ``failed``: a final failure, which ``store_errors_even_if_ignored`` sends all the same.
        """
        if self._states is not None and outcome.status in WORKER_STATES:
            await self._states.record(request, outcome.status, outcome.result)
        reply_to = request.reply_to
        if reply_to is None or not reply_wanted(request, self._app.tasks.get(request.task), failed=failed):
            return
        await self._replies.publish_result(
            outcome,
            reply_to=reply_to,
            correlation_id=request.correlation_id,
            content_type=reply_type(request.content_type),
            expiration=result_expiration(request.extra_headers),
        )


# A run that ended in a final outcome (success, failure, revoked): its delivery is simply acked.
_FINISHED: Final = Disposition(Fate.ACK, ran=True, finished=True)


def _child_tuples(ids: list[str]) -> list[Any]:
    # Celery's AsyncResult.as_tuple(): ((id, parent), None); the parent is this task, known already.
    return [[[task_id, None], None] for task_id in ids]
