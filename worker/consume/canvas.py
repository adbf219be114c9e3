"""The canvas on the worker: what a finished task's message asks to run next.

Protocol v2 carries a canvas in the body's embed (WIRE.md §3.3): ``chain`` (the steps after this
one, last first), ``callbacks`` (``link``: run with the result after a success), ``errbacks``
(``link_error``: run with the task id after a failure for good) and ``chord`` (this task is in a
chord's header; the field is the body). The worker honours the first three as Celery's does. A
chord header task's end, whatever it is, goes to the chord's joiner as a part
(``broker_svc.wire.chord_part``; worker/consume/chord_join.py joins them). A message whose embed
it cannot honour (a malformed signature) is refused before it runs (``unhonoured``), so no part
of a canvas is ever dropped.

Each follow-up task is confirmed by the broker before the finished task's delivery is acked: a
worker that dies between the two sends it again on redelivery (at-least-once, as in Celery).
A follow-up goes to its signature's queue, else where the app routes its task (``task_routes``),
else the app's default queue, as a Celery worker routes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from broker_svc.app import App
from broker_svc.follow_ups import FollowUp, chord_header_problem, follow_ups, runs_in_process, unhonoured
from broker_svc.routes import route_for
from broker_svc.topology import chord_join_queue
from broker_svc.wire.chord_part import ChordPart, encode_part
from broker_svc.wire.result_message import wire_exception
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage, encode_task
from worker.consume.publish import ReplyPublisher

__all__ = ["Canvas", "follow_up_queue"]

log = structlog.get_logger(__name__)


class Canvas:
    """Sends what a finished task's message asks for: its chain's next step, callbacks, errbacks.

    Args:
        app: the worker's app (its routes, default queue and quorum queues).
        replies: the confirm-mode publisher.
    """

    def __init__(self, *, app: App, replies: ReplyPublisher, namespace: str) -> None:
        self._app = app
        self._replies = replies
        self._join_queue = chord_join_queue(namespace)

    @staticmethod
    def refusal(request: TaskMessage) -> str | None:
        """Why ``request``'s canvas cannot be honoured, or None (then it may run)."""
        return unhonoured(request.embed) or chord_header_problem(
            request.embed, request.group, request.group_index
        )

    @staticmethod
    def wants_anything(request: TaskMessage) -> bool:
        """Whether the message carries a chain, callbacks or errbacks (most carry none)."""
        embed = request.embed
        return bool(embed.get("chain") or embed.get("callbacks") or embed.get("errbacks"))

    async def chord_part(self, request: TaskMessage, state: State, result: Any) -> None:
        """If ``request`` is a chord's header task, leave its end with the chord's joiner; confirmed.

        ``state`` is SUCCESS (``result`` the value) or FAILURE/REVOKED (``result`` the exception
        map). Called once the task has ended for good, before its delivery is acked.

        Raises:
            aio_pika.exceptions.AMQPError: the part was not confirmed (the caller must not ack).
        """
        body = request.embed.get("chord")
        if body is None or request.group is None or request.group_index is None:
            return
        part = ChordPart(
            group_id=request.group,
            index=request.group_index,
            size=int(body["chord_size"]),
            task_id=request.id,
            state=state.value,
            result=result,
            body=body,
            reply_to=request.reply_to,
            root_id=request.root_id,
        )
        content_type = "json" if request.content_type == "application/json" else "msgpack"
        try:
            payload, ctype, encoding = encode_part(part, content_type)
        except (TypeError, ValueError, OverflowError) as exc:
            # The result reached the caller in another shape; the chord fails rather than hangs.
            error = wire_exception("EncodeError", f"chord part cannot be encoded as {content_type}: {exc}")
            failed = dataclasses.replace(part, state=State.FAILURE.value, result=error)
            payload, ctype, encoding = encode_part(failed, content_type)
        await self._replies.publish_to(payload, content_type=ctype, encoding=encoding, queue=self._join_queue)
        log.info(
            "chord_part_sent", group_id=part.group_id, index=part.index, size=part.size, state=part.state
        )

    @staticmethod
    def after_success(request: TaskMessage, value: Any) -> list[FollowUp]:
        """The callbacks with ``value``, then the chain's next step with it (Celery's order).

        Built before the task's result is sent, so the result lists them as its children; sent by
        ``send`` after it.
        """
        embed = request.embed
        planned: list[FollowUp] = []
        for callback in embed.get("callbacks") or ():
            planned.extend(follow_ups(callback, parent=request, partial=(value,)))
        steps = list(embed.get("chain") or ())
        if steps:
            planned.extend(follow_ups(steps[-1], parent=request, partial=(value,), chain_rest=steps[:-1]))
        return planned

    async def send(self, planned: list[FollowUp], *, why: str) -> None:
        """Send follow-ups, each confirmed.

        Raises:
            aio_pika.exceptions.AMQPError: a follow-up was not confirmed (the caller must not ack).
        """
        await self._send(planned, why=why)

    async def after_failure(self, request: TaskMessage) -> None:
        """Send each errback that is not run in the child, with the failed task's id as argument.

        The rest of a chain never runs after a failed step (its caller gets the failure).

        Raises:
            aio_pika.exceptions.AMQPError: an errback was not confirmed (the caller must not ack).
        """
        sent: list[FollowUp] = []
        for errback in request.embed.get("errbacks") or ():
            if not runs_in_process(self._app, errback):
                sent.extend(follow_ups(errback, parent=request, partial=(request.id,)))
        await self._send(sent, why="after_failure")

    async def _send(self, follow: list[FollowUp], *, why: str) -> None:
        settings = self._app.settings
        for item in follow:
            message = item.message
            queue = follow_up_queue(self._app, item)
            serializer = "json" if message.content_type == "application/json" else "msgpack"
            wire = encode_task(message, serializer=serializer)
            await self._replies.publish_task(wire, queue=queue, queue_type=settings.queue_type(queue))
            log.info(
                "task_follow_up_sent", follow_up_id=message.id, follow_up=message.task, queue=queue, why=why
            )


def follow_up_queue(app: App, item: FollowUp) -> str:
    """Where a follow-up goes: its signature's queue, else the app's route for it, else the default."""
    if item.queue is not None:
        return item.queue
    message = item.message
    routed = route_for(app.conf.get("task_routes"), message.task, message.args, message.kwargs, {})
    queue: str = routed.get("queue") or app.settings.default_queue
    if routed.get("exchange"):
        log.warning(
            "follow_up_route_not_honoured", follow_up=message.task, exchange=routed["exchange"], queue=queue,
            hint="a worker sends a chain's steps, callbacks and chord bodies to a queue by name: give "
            "this task's route a queue",
        )  # fmt: skip
    return queue
