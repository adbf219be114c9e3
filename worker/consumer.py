"""The consumer: one delivery → validate → a free child → result → ack (or dead-letter)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc import codec
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.message import TaskMessage, decode_task, parse_iso_datetime
from broker_svc.outcome import CELERY_EXCEPTIONS_MODULE, Outcome, wire_exception
from broker_svc.settings import Settings
from broker_svc.states import State
from worker.eta import EtaScheduler
from worker.pool import Job, JobOutcome, JobStatus, ProcessPool
from worker.replies import ReplyPublisher

__all__ = ["CHILD_DEATHS_HEADER", "TaskConsumer"]

log = structlog.get_logger(__name__)

# How often this message has killed the child running it; travels with the message, so the
# count survives worker restarts (DESIGN §4).
CHILD_DEATHS_HEADER: Final = "x-clockwork-child-deaths"

_STATUS_TO_STATE: Final = {
    JobStatus.SUCCESS: State.SUCCESS,
    JobStatus.FAILURE: State.FAILURE,
    JobStatus.TIME_LIMIT: State.FAILURE,
    JobStatus.TERMINATED: State.REVOKED,
    JobStatus.LOST: State.FAILURE,
    JobStatus.RETRY: State.RETRY,
}


class TaskConsumer:
    """Handles deliveries from the worker's task queues.

    A delivery first waits for one of ``concurrency`` slots (so it only ever goes to a free child);
    while it waits it is *reserved* and, on shutdown, handed back to the broker unstarted.
    """

    def __init__(
        self,
        *,
        app: App,
        pool: ProcessPool,
        replies: ReplyPublisher,
        clock: LamportClock,
        settings: Settings,
        hostname: str,
        concurrency: int,
        max_child_deaths: int,
        eta: EtaScheduler,
        default_time_limits: tuple[float | None, float | None] = (None, None),
    ) -> None:
        self._app = app
        self._pool = pool
        self._replies = replies
        self._clock = clock
        self._settings = settings
        self._hostname = hostname
        self._accept = codec.accept_set(settings.accept_content)
        self._slots = asyncio.Semaphore(concurrency)
        self._max_child_deaths = max_child_deaths
        self._default_limits = default_time_limits
        self._eta = eta
        # Requests now running, for state updates; and each one's chain of update publishes, so
        # updates and the final result reach the client in the order they were made.
        self._running: dict[str, TaskMessage] = {}
        self._updates: dict[str, asyncio.Future[None]] = {}
        self._reserved: set[asyncio.Task[Any]] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self.processed = 0

    @property
    def in_flight(self) -> int:
        """Deliveries being handled (reserved or running)."""
        return len(self._handlers)

    def for_queue(self, queue: str) -> Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]:
        """The aio-pika consumer callback for one queue."""

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            try:
                await self._handle(message, queue)
            except Exception:
                # Typically the connection went away mid-publish. Never leave a delivery held:
                # hand it back (it runs again: at-least-once) and keep consuming.
                log.exception("delivery_failed", queue=queue)
                await _settle(message.nack(requeue=True))
            finally:
                if task is not None:
                    self._handlers.discard(task)

        return on_message

    async def stop(self, *, timeout_s: float) -> None:
        """Hand back reserved deliveries and wait up to ``timeout_s`` for running ones."""
        self._stopping = True
        for task in list(self._reserved):
            task.cancel()
        deadline = time.monotonic() + timeout_s
        while self._handlers and time.monotonic() < deadline:
            await asyncio.wait(set(self._handlers), timeout=max(0.0, deadline - time.monotonic()))

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage, queue: str) -> None:
        if self._stopping:
            await _settle(message.nack(requeue=True))
            return
        raw_id = (message.headers or {}).get("id")
        with structlog.contextvars.bound_contextvars(
            queue=queue, task_id=raw_id if isinstance(raw_id, str) else None
        ):
            try:
                request = decode_task(
                    message.body,
                    message.headers,
                    content_type=message.content_type,
                    accept=self._accept,
                    max_bytes=self._settings.max_body_bytes,
                    correlation_id=message.correlation_id,
                    reply_to=message.reply_to,
                    priority=message.priority,
                )
            except MessageError as exc:
                await self._refuse(message, queue, reason=type(exc).__name__, error=str(exc))
                return
            self._clock.adjust(request.clock)
            with structlog.contextvars.bound_contextvars(
                task_name=request.display_name, attempt=request.retries + 1
            ):
                await self._handle_task(message, queue, request)

    async def _refuse(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, *, reason: str, error: str
    ) -> None:
        headers = message.headers or {}
        log.error(
            "task_refused",
            reason=reason,
            error=error,
            size=len(message.body),
            content_type=message.content_type,
            header_names=sorted(str(k) for k in headers)[:32],
        )
        task_id = headers.get("id")
        if isinstance(task_id, str) and message.reply_to:
            exc_type = "ContentDisallowed" if reason == "ContentDisallowed" else "InvalidTaskError"
            await self._replies.publish_result(
                Outcome(task_id=task_id, status=State.FAILURE, result=wire_exception(exc_type, error)),
                reply_to=message.reply_to,
                correlation_id=message.correlation_id,
                content_type=_reply_type(message.content_type),
            )
        await self._replies.dead_letter(message, queue=queue, reason=reason, error=error)
        await _settle(message.ack())

    async def _handle_task(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> None:
        if request.task not in self._app.tasks:
            log.error("task_unknown", task_name=request.task)
            await self._reply(request, Outcome(
                task_id=request.id, status=State.FAILURE, result=wire_exception("NotRegistered", request.task)
            ))  # fmt: skip
            await self._replies.dead_letter(
                message, queue=queue, reason="NotRegistered", error=f"task {request.task!r} is not registered"
            )
            await _settle(message.ack())
            return
        if request.expires is not None and request.expires <= dt.datetime.now(dt.UTC):
            log.info("task_expired", expires=request.expires.isoformat())
            await self._reply(request, Outcome(
                task_id=request.id, status=State.REVOKED, result=wire_exception("TaskRevokedError", "expired")
            ))  # fmt: skip
            await _settle(message.ack())
            return
        if request.eta is not None and await self._eta.defer(message, queue=queue, eta=request.eta):
            return  # parked in a delay queue until nearly due (and acked here)
        outcome = await self._run(request, message)
        if outcome is None:
            return  # handed back to the broker (shutdown)
        await self._finish(message, queue, request, outcome)

    async def _run(
        self, request: TaskMessage, message: aio_pika.abc.AbstractIncomingMessage
    ) -> JobOutcome | None:
        task = asyncio.current_task()
        assert task is not None
        self._reserved.add(task)
        try:
            await self._slots.acquire()
        except asyncio.CancelledError:
            # Reserved but never started: the broker gets it back for another worker.
            await _settle(message.nack(requeue=True))
            log.info("task_requeued_on_shutdown")
            return None
        finally:
            self._reserved.discard(task)
        try:
            hard, soft = self._time_limits(request)
            job = Job(
                task_id=request.id,
                task_name=request.task,
                args=request.args,
                kwargs=request.kwargs,
                request=self._context(request, message),
                hard_time_limit_s=hard,
                soft_time_limit_s=soft,
            )
            self._running[request.id] = request
            try:
                return await self._pool.run(job)
            finally:
                self._running.pop(request.id, None)
        finally:
            self._slots.release()

    def _time_limits(self, request: TaskMessage) -> tuple[float | None, float | None]:
        # The call's limits win, then the task's own, then the worker's defaults (as Celery).
        task = self._app.tasks[request.task]
        hard, soft = request.timelimit
        hard = hard if hard is not None else task.time_limit or self._default_limits[0]
        soft = soft if soft is not None else task.soft_time_limit or self._default_limits[1]
        return hard, soft

    def on_update(self, task_id: str, payload: dict[str, Any]) -> None:
        """Pool callback: a running task reported a state (``update_state``, STARTED)."""
        request = self._running.get(task_id)
        state = payload.get("state")
        if request is None or not isinstance(state, str) or not state:
            log.warning("task_update_ignored", task_id=task_id)
            return
        outcome = Outcome(task_id=task_id, status=state, result=payload.get("meta"))
        previous = self._updates.get(task_id)
        self._updates[task_id] = asyncio.ensure_future(self._publish_update(previous, request, outcome))

    async def _publish_update(
        self, previous: asyncio.Future[None] | None, request: TaskMessage, outcome: Outcome
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            await self._reply(request, outcome)
        except Exception as exc:  # a lost progress update must not fail the task
            log.warning("task_update_not_sent", state=outcome.status, error=str(exc))

    def _context(self, request: TaskMessage, message: aio_pika.abc.AbstractIncomingMessage) -> dict[str, Any]:
        return {
            "id": request.id,
            "retries": request.retries,
            "hostname": self._hostname,
            "root_id": request.root_id,
            "parent_id": request.parent_id,
            "group": request.group,
            "eta": request.eta.isoformat() if request.eta else None,
            "expires": request.expires.isoformat() if request.expires else None,
            "reply_to": request.reply_to,
            "correlation_id": request.correlation_id,
            "origin": request.origin,
            "ignore_result": request.ignore_result,
            "timelimit": list(request.timelimit),
            "delivery_info": {
                "exchange": message.exchange,
                "routing_key": message.routing_key,
                "priority": message.priority,
                "redelivered": message.redelivered,
            },
        }

    async def _finish(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        queue: str,
        request: TaskMessage,
        outcome: JobOutcome,
    ) -> None:
        self.processed += 1
        runtime_ms = round(outcome.runtime_s * 1000, 3)
        if outcome.status == JobStatus.LOST:
            if self._stopping:
                return  # killed at the shutdown deadline: unacked, so the broker redelivers it
            await self._child_lost(message, queue, request, outcome)
            return
        pending_updates = self._updates.pop(request.id, None)
        if pending_updates is not None:
            await asyncio.wait([pending_updates])  # progress first, then the outcome
        if outcome.status == JobStatus.RETRY:
            await self._retry(message, queue, request, outcome)
            return
        state = _STATUS_TO_STATE[outcome.status]
        if outcome.status == JobStatus.SUCCESS:
            log.info("task_succeeded", runtime_ms=runtime_ms, pid=outcome.pid)
            result = Outcome(task_id=request.id, status=state, result=outcome.value)
        else:
            log.warning(
                "task_failed", runtime_ms=runtime_ms, status=outcome.status.value, error=outcome.error
            )
            error = outcome.error or wire_exception("Exception", "unknown failure", module="builtins")
            result = Outcome(task_id=request.id, status=state, result=error, traceback=outcome.traceback)
        await self._reply(request, result)
        if outcome.retries_exhausted:
            await self._replies.dead_letter(
                message,
                queue=queue,
                reason="max_retries_exceeded",
                error=f"failed after {request.retries} retries: {_describe(outcome.error)}",
            )
        await _settle(message.ack())

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
        eta = value.get("eta")
        if not isinstance(eta, str):
            eta = dt.datetime.now(dt.UTC).isoformat()
        headers = {"retries": request.retries + 1, "eta": eta}
        await self._republish_later(message, queue, eta, headers)
        log.info("task_retried", retries=request.retries + 1, eta=eta, error=_describe(outcome.error))
        error = outcome.error or wire_exception("Retry", "retry", module=CELERY_EXCEPTIONS_MODULE)
        await self._reply(request, Outcome(
            task_id=request.id, status=State.RETRY, result=error, traceback=outcome.traceback
        ))  # fmt: skip
        await _settle(message.ack())

    async def _republish_later(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, eta: str, headers: dict[str, Any]
    ) -> None:
        try:
            when = parse_iso_datetime(eta)
        except ValueError:
            when = dt.datetime.now(dt.UTC)
        await self._eta.publish_delayed(message, queue=queue, eta=when, headers=headers)

    async def _child_lost(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        queue: str,
        request: TaskMessage,
        outcome: JobOutcome,
    ) -> None:
        deaths = _int_header(message.headers, CHILD_DEATHS_HEADER) + 1
        if deaths > self._max_child_deaths:
            log.error("task_killed_its_child_too_often", deaths=deaths)
            error = outcome.error or wire_exception(
                "WorkerLostError", "child died", module="billiard.exceptions"
            )
            await self._reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error))
            await self._replies.dead_letter(
                message, queue=queue, reason="child_lost", error=f"the task killed its child {deaths} times"
            )
        else:
            log.warning("task_child_lost_retrying", deaths=deaths, error=outcome.error)
            await self._replies.republish(message, queue=queue, headers={CHILD_DEATHS_HEADER: deaths})
        await _settle(message.ack())

    async def _reply(self, request: TaskMessage, outcome: Outcome) -> None:
        if request.reply_to is None or request.ignore_result:
            return
        task = self._app.tasks.get(request.task)
        if task is not None and task.ignore_result:
            return
        await self._replies.publish_result(
            outcome,
            reply_to=request.reply_to,
            correlation_id=request.correlation_id,
            content_type=_reply_type(request.content_type),
        )


def _describe(error: dict[str, Any] | None) -> str:
    if not error:
        return "unknown error"
    message = error.get("exc_message")
    text = ", ".join(map(str, message)) if isinstance(message, list) else str(message)
    return f"{error.get('exc_type')}: {text}"


def _reply_type(content_type: str | None) -> str:
    # Results go out in the request's content type; a refused type gets json, which every
    # Celery client accepts.
    return content_type if content_type in (codec.MSGPACK, codec.JSON) else codec.JSON


def _int_header(headers: dict[str, Any] | None, name: str) -> int:
    value = (headers or {}).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


async def _settle(action: Any) -> None:
    # After a reconnect the delivery's channel is gone: acking it would be a stale tag (406).
    # The broker has already requeued it, so there is nothing left to do but note it.
    try:
        await action
    except (aio_pika.exceptions.ChannelInvalidStateError, aio_pika.exceptions.AMQPError) as exc:
        log.warning("settle_skipped_channel_gone", error=str(exc))
