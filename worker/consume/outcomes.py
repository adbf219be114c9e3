"""What happens after a job ends: the result to the client, then ack, retry or dead-letter."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.app import App
from broker_svc.states import State
from broker_svc.wire import codec
from broker_svc.wire.result_message import CELERY_EXCEPTIONS_MODULE, Outcome, wire_exception
from broker_svc.wire.task_message import TaskMessage, parse_iso_datetime, safe_repr
from worker.consume.admission import (
    BROKER_COUNT_HEADER,
    DELIVERIES_HEADER,
    DELIVERY_LIMIT_REASON,
    DedupeWindow,
    carries_count,
    delivery_count,
)
from worker.consume.eta import EtaScheduler
from worker.consume.publish import ReplyPublisher
from worker.events import EventDispatcher
from worker.pool.pool import JobOutcome, JobStatus

__all__ = ["OutcomeHandler", "describe_repr", "reply_type", "settle"]

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
    """Publishes states and outcomes in order, and settles each delivery once its copy is safe.

    Args:
        app: the app (for per-task ``ignore_result``).
        replies: the confirm-mode publisher for results, dead letters and copies.
        eta: where retries are parked until due.
        events: where task-* events go.
        delivery_limit: how many deliveries of one message may end without finishing (its child or
            worker died) before the next is dead-lettered (``worker.consume.admission``).
        dedupe: finished task ids, to skip duplicate deliveries; None: at-least-once (the default).
    """

    def __init__(
        self,
        *,
        app: App,
        replies: ReplyPublisher,
        eta: EtaScheduler,
        events: EventDispatcher,
        delivery_limit: int,
        dedupe: DedupeWindow | None = None,
    ) -> None:
        self._app = app
        self._replies = replies
        self._eta = eta
        self._events = events
        self._delivery_limit = delivery_limit
        self._dedupe = dedupe
        # Each running task's chain of update publishes: updates, then the outcome, in order.
        self._updates: dict[str, asyncio.Future[None]] = {}
        self.processed = 0
        self.totals: collections.Counter[str] = collections.Counter()

    async def admit(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> bool:
        """Decide whether a decoded delivery may go on to run; settle it here if not.

        A duplicate of a task finished (or running) here is acked unrun (with dedupe on). A message
        whose earlier deliveries reached the delivery limit without finishing is dead-lettered with
        a FAILURE for its client. A classic-queue redelivery is published again with its count
        (the broker keeps none) and acked, so the count survives a worker that dies running it.
        Pair every True with :meth:`release`.

        Raises:
            aio_pika.exceptions.AMQPError: a copy or dead letter was not confirmed (nothing acked).
        """
        dedupe = self._dedupe
        if dedupe is not None and dedupe.seen((request.id, request.retries)):
            dedupe.skipped += 1
            log.info("task_duplicate_skipped")
            await settle(message.ack())
            return False
        headers, redelivered = message.headers, message.redelivered
        if redelivered or (headers and (DELIVERIES_HEADER in headers or BROKER_COUNT_HEADER in headers)):
            count = delivery_count(headers, redelivered=redelivered)
            if count > self._delivery_limit:
                why = f"{count} deliveries did not finish (delivery_limit={self._delivery_limit})"
                await self._delivery_limit_reached(message, queue, request, error=None, why=why)
                return False
            if not carries_count(headers, redelivered=redelivered):
                await self._replies.republish(
                    message, queue=queue, headers={DELIVERIES_HEADER: count}, drop=(BROKER_COUNT_HEADER,)
                )
                await settle(message.ack())
                log.info("task_redelivery_counted", deliveries=count)
                return False
        if dedupe is not None:
            dedupe.start((request.id, request.retries))
        return True

    def release(self, request: TaskMessage) -> None:
        """The admitted delivery of ``request`` is settled, whatever became of it."""
        if self._dedupe is not None:
            self._dedupe.release((request.id, request.retries))

    def _finished(self, request: TaskMessage) -> None:
        if self._dedupe is not None:
            self._dedupe.finished((request.id, request.retries))

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
        queue: str,
        request: TaskMessage,
        outcome: JobOutcome,
        *,
        stopping: bool,
        signum: int | None = None,
    ) -> None:
        """Report a job's outcome to its client, then ack (or retry, or dead-letter) its message.

        ``signum`` is the signal a ``revoke(terminate=True)`` sent, if any.
        """
        self.processed += 1
        self.totals[request.task] += 1
        runtime_ms = round(outcome.runtime_s * 1000, 3)
        if outcome.status == JobStatus.LOST:
            if stopping:
                return  # killed at the shutdown deadline: unacked, so the broker redelivers it
            await self._child_lost(message, queue, request, outcome)
            return
        pending_updates = self._updates.pop(request.id, None)
        if pending_updates is not None:
            await asyncio.wait([pending_updates])  # progress first, then the outcome
        if outcome.status == JobStatus.RETRY:
            await self._retry(message, queue, request, outcome)
            self._finished(request)
            return
        state = _STATUS_TO_STATE[outcome.status]
        if outcome.status == JobStatus.SUCCESS:
            log.info("task_succeeded", runtime_ms=runtime_ms, pid=outcome.pid)
            result = Outcome(task_id=request.id, status=state, result=outcome.value)
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
        else:
            log.warning(
                "task_failed", runtime_ms=runtime_ms, status=outcome.status.value, error=outcome.error
            )
            error = outcome.error or wire_exception("Exception", "unknown failure", module="builtins")
            result = Outcome(task_id=request.id, status=state, result=error, traceback=outcome.traceback)
            await self._events.send(
                "task-failed",
                uuid=request.id,
                exception=describe_repr(error),
                traceback=outcome.traceback or "",
            )
        await self.reply(request, result)
        if outcome.retries_exhausted:
            await self._replies.dead_letter(
                message,
                queue=queue,
                reason="max_retries_exceeded",
                error=f"failed after {request.retries} retries: {_describe(outcome.error)}",
            )
        await settle(message.ack())
        self._finished(request)

    async def _retry(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        queue: str,
        request: TaskMessage,
        outcome: JobOutcome,
    ) -> None:
        # The copy (same id, retries + 1, new eta) is confirmed by the broker before the original
        # is acked: a failed republish raises here and the original goes back to the queue.
        value = outcome.value if isinstance(outcome.value, dict) else {}
        when = _eta_of(value.get("eta"))
        eta = when.isoformat()
        headers = {"retries": request.retries + 1, "eta": eta}
        await self._eta.publish_delayed(message, queue=queue, eta=when, headers=headers)
        log.info("task_retried", retries=request.retries + 1, eta=eta, error=_describe(outcome.error))
        error = outcome.error or wire_exception("Retry", "retry", module=CELERY_EXCEPTIONS_MODULE)
        await self._events.send(
            "task-retried", uuid=request.id, exception=describe_repr(error), traceback=outcome.traceback or ""
        )
        await self.reply(request, Outcome(
            task_id=request.id, status=State.RETRY, result=error, traceback=outcome.traceback
        ))  # fmt: skip
        await settle(message.ack())

    async def _child_lost(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        queue: str,
        request: TaskMessage,
        outcome: JobOutcome,
    ) -> None:
        # The broker saw nothing fail (our connection is fine), so the count goes on a copy.
        count = delivery_count(message.headers, redelivered=message.redelivered) + 1
        if count > self._delivery_limit:
            why = f"its child died; {count} deliveries did not finish (delivery_limit={self._delivery_limit})"
            await self._delivery_limit_reached(message, queue, request, error=outcome.error, why=why)
            return
        log.warning("task_child_lost_retrying", deliveries=count, error=outcome.error)
        await self._replies.republish(
            message, queue=queue, headers={DELIVERIES_HEADER: count}, drop=(BROKER_COUNT_HEADER,)
        )
        await settle(message.ack())

    async def _delivery_limit_reached(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        queue: str,
        request: TaskMessage,
        *,
        error: dict[str, Any] | None,
        why: str,
    ) -> None:
        # Celery's name for a task whose process died under it, so clients see what they know.
        log.error("task_delivery_limit_reached", why=why)
        failure = error or wire_exception("WorkerLostError", why, module="billiard.exceptions")
        await self.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=failure))
        await self._replies.dead_letter(message, queue=queue, reason=DELIVERY_LIMIT_REASON, error=why)
        await self._events.send(
            "task-failed", uuid=request.id, exception=describe_repr(failure), traceback=""
        )
        await settle(message.ack())

    async def reply(self, request: TaskMessage, outcome: Outcome) -> None:
        """Publish a state to the task's ``reply_to``, unless results are ignored."""
        if request.reply_to is None or request.ignore_result:
            return
        task = self._app.tasks.get(request.task)
        if task is not None and task.ignore_result:
            return
        await self._replies.publish_result(
            outcome,
            reply_to=request.reply_to,
            correlation_id=request.correlation_id,
            content_type=reply_type(request.content_type),
        )


def _eta_of(value: Any) -> dt.datetime:
    # The child sends the retry's ETA as ISO-8601; anything unreadable means "now".
    if isinstance(value, str):
        try:
            return parse_iso_datetime(value)
        except ValueError:
            pass
    return dt.datetime.now(dt.UTC)


def _describe(error: dict[str, Any] | None) -> str:
    if not error:
        return "unknown error"
    message = error.get("exc_message")
    text = ", ".join(map(str, message)) if isinstance(message, list) else str(message)
    return f"{error.get('exc_type')}: {text}"


def describe_repr(error: dict[str, Any]) -> str:
    """An exception map as Celery's events show it: ``ValueError('bad')``."""
    message = error.get("exc_message")
    items = message if isinstance(message, list) else [message]
    return f"{error.get('exc_type')}({', '.join(repr(m) for m in items)})"


def reply_type(content_type: str | None) -> str:
    # Results go out in the request's content type; a refused type gets json, which every
    # Celery client accepts.
    return content_type if content_type in (codec.MSGPACK, codec.JSON) else codec.JSON


async def settle(action: Any) -> None:
    """Await an ack or nack, tolerating a channel that is gone."""
    # After a reconnect the delivery's channel is gone: acking it would be a stale tag (406).
    # The broker has already requeued it, so there is nothing left to do but note it.
    try:
        await action
    except (aio_pika.exceptions.ChannelInvalidStateError, aio_pika.exceptions.AMQPError) as exc:
        log.warning("settle_skipped_channel_gone", error=str(exc))
    except asyncio.CancelledError:
        # A channel that closes mid-ack cancels the ack's write instead of failing it; only a
        # cancellation of this task itself goes on up.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("settle_skipped_channel_gone", error="cancelled with its channel")
