"""Rejections: the fate of a delivery that will never run here, with the reply and event it owes.

Four kinds of delivery are settled without a child: one that fails to decode or validate (refused:
FAILURE reply if it can be addressed, dead-lettered), one naming a task this app does not register
(FAILURE ``NotRegistered``, dead-lettered), one whose canvas this worker cannot honour (FAILURE,
dead-lettered) and one revoked or expired before it started (REVOKED).
Each still answers its caller, emits its task event and is acked, so the consumer loop goes on.
They live apart from the consumer because they share one shape — reply, dead letter or not, event,
ack (carried out by ``worker.consume.settle``) — and none of the consumer's run bookkeeping.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import aio_pika.abc
import structlog

from broker_svc import signals
from broker_svc.wire.codec import reply_type
from broker_svc.wire.result_message import Outcome, wire_exception
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage
from worker.consume.admission import UNKNOWN_TASK_HINT
from worker.consume.outcomes import OutcomeHandler
from worker.consume.publish import ReplyPublisher
from worker.consume.settle import ACK, Disposition, Owed
from worker.events import EventDispatcher

__all__ = ["Rejections", "broker_dead_letter"]

log = structlog.get_logger(__name__)


class Rejections:
    """Decides the fate of deliveries that never run: refused, unregistered, revoked or expired.

    Args:
        replies: publishes results and dead letters.
        events: sends task events.
        outcomes: replies to a decoded request as its finished run would.
    """

    def __init__(self, *, replies: ReplyPublisher, events: EventDispatcher, outcomes: OutcomeHandler) -> None:
        self._replies = replies
        self._events = events
        self._outcomes = outcomes
        # Tasks of names this app does not register, by name (inspect ``stats``: ``unknown_tasks``).
        self.unknown: collections.Counter[str] = collections.Counter()

    async def refuse(
        self, message: aio_pika.abc.AbstractIncomingMessage, *, reason: str, error: str
    ) -> Disposition:
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
        return Disposition.dead_letter(
            reason, error, owed=self._rejected(task_id) if isinstance(task_id, str) else None
        )

    async def unregistered(self, request: TaskMessage) -> Disposition:
        """Dead-letter a task this app does not register (FAILURE ``NotRegistered``)."""
        self.unknown[request.task] += 1
        if self.unknown[request.task] == 1:
            # The usual cause: two apps consume one queue (both on Celery's default 'celery').
            log.error("task_unknown", task_name=request.task, hint=UNKNOWN_TASK_HINT)
        else:
            log.error("task_unknown", task_name=request.task, seen=self.unknown[request.task])
        error = wire_exception("NotRegistered", request.task)
        await self._outcomes.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error))
        await self._outcomes.chord_part(request, State.FAILURE, error)
        return Disposition.dead_letter(
            "NotRegistered", f"task {request.task!r} is not registered", owed=self._rejected(request.id)
        )

    async def cannot_honour(self, request: TaskMessage, why: str) -> Disposition:
        """Dead-letter a task whose message asks for what this worker cannot do (a chord, say).

        Refused before it runs, as a whole: running part of a canvas and dropping the rest would
        lose work silently. Its caller gets a FAILURE saying why.
        """
        log.error("task_canvas_refused", why=why)
        await self._outcomes.reply(request, Outcome(
            task_id=request.id, status=State.FAILURE,
            result=wire_exception("NotImplementedError", why, module="builtins"),
        ))  # fmt: skip
        body = request.embed.get("chord")
        body_options = body.get("options") if isinstance(body, Mapping) else None
        reply_to = (body_options or {}).get("reply_to") or request.reply_to
        if isinstance(body_options, Mapping) and isinstance(body_options.get("task_id"), str) and reply_to:
            # A chord that cannot be joined: its body's caller learns why instead of waiting.
            await self._replies.publish_result(
                Outcome(task_id=body_options["task_id"], status=State.FAILURE,
                        result=wire_exception("ChordError", f"chord refused: {why}")),
                reply_to=reply_to,
                correlation_id=body_options["task_id"],
                content_type=reply_type(request.content_type),
            )  # fmt: skip
        return Disposition.dead_letter("unsupported_canvas", why, owed=self._rejected(request.id))

    async def skip_revoked(self, request: TaskMessage, *, expired: bool) -> Disposition:
        """Answer a revoked (or expired) task without running it; its delivery is acked."""
        # A revoked (or expired) task never runs: REVOKED result, task-revoked event, then the ack.
        reason = "expired" if expired else "revoked"
        log.info("task_revoked_skipped", reason=reason)
        error = wire_exception("TaskRevokedError", reason)
        await self._outcomes.reply(request, Outcome(task_id=request.id, status=State.REVOKED, result=error))
        await self._outcomes.chord_part(request, State.REVOKED, error)
        await self._events.send(
            "task-revoked", uuid=request.id, terminated=False, signum=None, expired=expired
        )
        signals.task_revoked.send(
            sender=request.task, request=request, terminated=False, signum=None, expired=expired
        )
        return ACK

    async def dropped_by_broker(
        self, request: TaskMessage, *, reason: str, origin: str | None
    ) -> Disposition:
        """Answer a task RabbitMQ dead-lettered for another reason than expiry (a length limit, say).

        It reached ``clockwork.expired`` through the operator's policy; it is not run, its caller
        gets a FAILURE saying why, and it is kept in ``clockwork.expired.dead``.
        """
        why = f"the broker dead-lettered this task from queue {origin!r} ({reason}); it did not run"
        log.error("task_dropped_by_broker", reason=reason, origin=origin)
        error = wire_exception("RuntimeError", why, module="builtins")
        await self._outcomes.reply(request, Outcome(task_id=request.id, status=State.FAILURE, result=error))
        await self._outcomes.chord_part(request, State.FAILURE, error)
        return Disposition.dead_letter(f"broker_{reason}", why, owed=self._rejected(request.id))

    def _rejected(self, task_id: str) -> Owed:
        # Sent once the dead letter is confirmed: the task is rejected only if it is kept there.
        async def announce() -> None:
            await self._events.send("task-rejected", uuid=task_id, requeue=False)

        return announce


def broker_dead_letter(headers: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """Why RabbitMQ dead-lettered a message, and from which queue (its newest ``x-death`` entry)."""
    deaths = (headers or {}).get("x-death")
    if isinstance(deaths, list | tuple) and deaths and isinstance(deaths[0], Mapping):
        newest = deaths[0]
        reason, origin = newest.get("reason"), newest.get("queue")
        return (
            reason if isinstance(reason, str) else "unknown",
            origin if isinstance(origin, str) else None,
        )
    return "unknown", None
