"""A consuming child's canvas: a finished task's follow-ups and chord part, each confirmed before the ack.

What to send is decided in ``worker/rules/canvas_plan.py``, as for the worker's consumer; this
module sends it on the child's connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from broker_svc.app import App
from broker_svc.canvas.follow_ups import FollowUp
from broker_svc.topology import chord_join_queue
from broker_svc.wire.records.chord_part import join_namespace
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import TaskMessage
from worker.consume.replies import FeedReplies
from worker.rules import canvas_plan

if TYPE_CHECKING:
    from worker.consume.backend import FeedBackend

__all__ = ["FeedCanvas"]

log = structlog.get_logger(__name__)


class FeedCanvas:
    """Sends a finished task's chain step, callbacks, errbacks and chord part.

    Args:
        app: the app (its routes, default queue and quorum queues).
        replies: the child's confirmed publisher.
        namespace: the app namespace, whose joiner joins chords that name none (older clients').
    """

    def __init__(self, *, app: App, replies: FeedReplies, namespace: str) -> None:
        self._app = app
        self._replies = replies
        self._namespace = namespace
        # The app's Redis result backend: it counts the chords a Redis client sent (no chord_size).
        self.redis: FeedBackend | None = None

    def chord_part(self, request: TaskMessage, state: State, result: Any) -> None:
        """If ``request`` is a chord header task, its end goes to the chord's joiner.

        Raises:
            BrokerSvcError: the part was not confirmed (the delivery must not be acked).
        """
        body = request.embed.get("chord")
        if self.redis is not None and body is not None and "chord_size" not in body:
            if request.group is not None:
                self.redis.chord_part(
                    request, state, result, send=lambda planned: self.send(planned, why="chord_body")
                )
            return
        planned = canvas_plan.chord_part(request, state, result)
        if planned is None:
            return
        part, payload, ctype, encoding = planned
        queue = chord_join_queue(join_namespace(part.body, self._namespace))
        self._replies.internal(payload, content_type=ctype, encoding=encoding, queue=queue)
        log.info(
            "chord_part_sent", group_id=part.group_id, index=part.index, size=part.size, state=part.state
        )

    def send(self, planned: list[FollowUp], *, why: str) -> None:
        """Send follow-ups, each confirmed.

        Raises:
            BrokerSvcError: a follow-up was not confirmed (the delivery must not be acked).
        """
        settings = self._app.settings
        for item in planned:
            wire, queue = canvas_plan.follow_up_wire(self._app, item)
            self._replies.task(wire, queue=settings.task_queue(queue))
            log.info(
                "task_follow_up_sent", follow_up_id=item.message.id, follow_up=item.message.task, queue=queue,
                why=why,
            )  # fmt: skip

    def after_failure(self, request: TaskMessage) -> None:
        """Send each errback the child did not run itself (with the failed task's id).

        Raises:
            BrokerSvcError: an errback was not confirmed (the delivery must not be acked).
        """
        self.send(canvas_plan.errbacks_to_send(self._app, request), why="after_failure")
