"""Rejections: settling a delivery that will never run here, with the reply and event it owes.

Three kinds of delivery are settled without a child: one that fails to decode or validate (refused:
FAILURE reply if it can be addressed, dead-lettered), one naming a task this app does not register
(FAILURE ``NotRegistered``, dead-lettered) and one revoked or expired before it started (REVOKED).
Each still answers its caller, emits its task event and is acked, so the consumer loop goes on.
They live apart from the consumer because they share one shape — reply, dead letter or not, event,
ack — and none of the consumer's run bookkeeping.
"""

from __future__ import annotations

import aio_pika.abc
import structlog

from broker_svc.states import State
from broker_svc.wire.result_message import Outcome, wire_exception
from broker_svc.wire.task_message import TaskMessage
from worker.consume.outcomes import OutcomeHandler, reply_type, settle
from worker.consume.publish import ReplyPublisher
from worker.events import EventDispatcher

__all__ = ["Rejections"]

log = structlog.get_logger(__name__)


class Rejections:
    """Settles deliveries that never run: refused, unregistered, revoked or expired.

    Args:
        replies: publishes results and dead letters.
        events: sends task events.
        outcomes: replies to a decoded request as its finished run would.
    """

    def __init__(self, *, replies: ReplyPublisher, events: EventDispatcher, outcomes: OutcomeHandler) -> None:
        self._replies = replies
        self._events = events
        self._outcomes = outcomes

    async def refuse(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, *, reason: str, error: str
    ) -> None:
        """Dead-letter a delivery that failed to decode or validate (poison input)."""
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
                content_type=reply_type(message.content_type),
            )
        await self._replies.dead_letter(message, queue=queue, reason=reason, error=error)
        if isinstance(task_id, str):
            await self._events.send("task-rejected", uuid=task_id, requeue=False)
        await settle(message.ack())

    async def unregistered(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> None:
        """Dead-letter a task this app does not register (FAILURE ``NotRegistered``)."""
        log.error("task_unknown", task_name=request.task)
        await self._outcomes.reply(request, Outcome(
            task_id=request.id, status=State.FAILURE, result=wire_exception("NotRegistered", request.task)
        ))  # fmt: skip
        await self._replies.dead_letter(
            message, queue=queue, reason="NotRegistered", error=f"task {request.task!r} is not registered"
        )
        await self._events.send("task-rejected", uuid=request.id, requeue=False)
        await settle(message.ack())

    async def skip_revoked(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage, *, expired: bool
    ) -> None:
        """Settle a revoked (or expired) task without running it."""
        # A revoked (or expired) task never runs: REVOKED result, task-revoked event, then the ack.
        reason = "expired" if expired else "revoked"
        log.info("task_revoked_skipped", reason=reason)
        await self._outcomes.reply(request, Outcome(
            task_id=request.id, status=State.REVOKED, result=wire_exception("TaskRevokedError", reason)
        ))  # fmt: skip
        await self._events.send(
            "task-revoked", uuid=request.id, terminated=False, signum=None, expired=expired
        )
        await settle(message.ack())
