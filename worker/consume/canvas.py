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

from typing import Any

import structlog

from broker_svc.app import App
from broker_svc.canvas.follow_ups import FollowUp
from broker_svc.topology import chord_join_queue
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage
from worker.consume import canvas_plan
from worker.consume.publish import ReplyPublisher

__all__ = ["Canvas"]

log = structlog.get_logger(__name__)


class Canvas:
    """Sends what a finished task's message asks for: its chain's next step, callbacks, errbacks.

    What to send is decided in ``worker/consume/canvas_plan.py``; this class publishes it.

    Args:
        app: the worker's app (its routes, default queue and quorum queues).
        replies: the confirm-mode publisher.
    """

    def __init__(self, *, app: App, replies: ReplyPublisher, namespace: str) -> None:
        self._app = app
        self._replies = replies
        self._join_queue = chord_join_queue(namespace)

    refusal = staticmethod(canvas_plan.refusal)
    wants_anything = staticmethod(canvas_plan.wants_anything)
    after_success = staticmethod(canvas_plan.after_success)

    async def chord_part(self, request: TaskMessage, state: State, result: Any) -> None:
        """If ``request`` is a chord's header task, leave its end with the chord's joiner; confirmed.

        Called once the task has ended for good, before its delivery is acked.

        Raises:
            aio_pika.exceptions.AMQPError: the part was not confirmed (the caller must not ack).
        """
        planned = canvas_plan.chord_part(request, state, result)
        if planned is None:
            return
        part, payload, ctype, encoding = planned
        await self._replies.publish_to(payload, content_type=ctype, encoding=encoding, queue=self._join_queue)
        log.info(
            "chord_part_sent", group_id=part.group_id, index=part.index, size=part.size, state=part.state
        )

    async def send(self, planned: list[FollowUp], *, why: str) -> None:
        """Send follow-ups, each confirmed.

        Raises:
            aio_pika.exceptions.AMQPError: a follow-up was not confirmed (the caller must not ack).
        """
        settings = self._app.settings
        for item in planned:
            wire, queue = canvas_plan.follow_up_wire(self._app, item)
            await self._replies.publish_task(wire, queue=settings.task_queue(queue))
            log.info(
                "task_follow_up_sent", follow_up_id=item.message.id, follow_up=item.message.task, queue=queue,
                why=why,
            )  # fmt: skip

    async def after_failure(self, request: TaskMessage) -> None:
        """Send each errback that is not run in the child, with the failed task's id as argument.

        Raises:
            aio_pika.exceptions.AMQPError: an errback was not confirmed (the caller must not ack).
        """
        await self.send(canvas_plan.errbacks_to_send(self._app, request), why="after_failure")
