"""What a finished task's message asks to send next, decided without I/O: follow-ups and chord parts.

Pure, so what a pool child sends (``worker/consume/canvas.py``, on its own connection) is decided
apart from the sending, and unit-tested. The canvas fields are WIRE.md §3.3's: ``chain``,
``callbacks``, ``errbacks`` and ``chord``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from broker_svc.app import App
from broker_svc.canvas.follow_ups import (
    FollowUp,
    chord_header_problem,
    follow_ups,
    runs_in_process,
    unhonoured,
)
from broker_svc.sending.routes import queue_for
from broker_svc.wire import codec
from broker_svc.wire.records.chord_part import ChordPart, encode_part
from broker_svc.wire.results.message import wire_exception
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import TaskMessage, WireMessage, encode_task

__all__ = [
    "after_success",
    "chord_part",
    "errbacks_to_send",
    "follow_up_queue",
    "follow_up_wire",
    "refusal",
    "wants_anything",
]

log = structlog.get_logger(__name__)


def refusal(request: TaskMessage, *, redis_chords: bool = False) -> str | None:
    """Why ``request``'s canvas cannot be honoured, or None (then it may run).

    ``redis_chords``: the worker's app has a Redis result backend, which counts the chords of a
    client whose backend is Redis (their header tasks carry no ``chord_size``).
    """
    return unhonoured(request.embed, redis_chords=redis_chords) or chord_header_problem(
        request.embed, request.group, request.group_index
    )


def wants_anything(request: TaskMessage) -> bool:
    """Whether the message carries a chain, callbacks or errbacks (most carry none)."""
    embed = request.embed
    return bool(embed.get("chain") or embed.get("callbacks") or embed.get("errbacks"))


def after_success(request: TaskMessage, value: Any) -> list[FollowUp]:
    """The callbacks with ``value``, then the chain's next step with it (Celery's order).

    Built before the task's result is sent, so the result lists them as its children.
    """
    embed = request.embed
    planned: list[FollowUp] = []
    for callback in embed.get("callbacks") or ():
        planned.extend(follow_ups(callback, parent=request, partial=(value,)))
    steps = list(embed.get("chain") or ())
    if steps:
        planned.extend(follow_ups(steps[-1], parent=request, partial=(value,), chain_rest=steps[:-1]))
    return planned


def errbacks_to_send(app: App, request: TaskMessage) -> list[FollowUp]:
    """Each errback the child did not run itself, with the failed task's id as its argument.

    The rest of a chain never runs after a failed step (its caller gets the failure).
    """
    sent: list[FollowUp] = []
    for errback in request.embed.get("errbacks") or ():
        if not runs_in_process(app, errback):
            sent.extend(follow_ups(errback, parent=request, partial=(request.id,)))
    return sent


def follow_up_wire(app: App, item: FollowUp) -> tuple[WireMessage, str]:
    """A follow-up encoded in its parent's serializer, and the queue it goes to."""
    message = item.message
    serializer = codec.serializer_of(message.content_type) or "msgpack"
    return encode_task(message, serializer=serializer), follow_up_queue(app, item)


def follow_up_queue(app: App, item: FollowUp) -> str:
    """Where a follow-up goes, as ``delay()`` in this app would send it (``routes.queue_for``).

    A chord body from a client carries its queue (the sending app's route); only one from an older
    client, or a chain step or callback that names none, is routed by this worker's app."""
    message = item.message
    task = app.tasks.get(message.task)
    queue, routed = queue_for(
        app.conf.get("task_routes"), message.task, message.args, message.kwargs,
        {"queue": item.queue} if item.queue is not None else {},
        declared=task.queue if task is not None else None, default=app.settings.default_queue,
    )  # fmt: skip
    if routed.get("exchange"):
        log.warning(
            "follow_up_route_not_honoured", follow_up=message.task, exchange=routed["exchange"], queue=queue,
            hint="a worker sends a chain's steps, callbacks and chord bodies to a queue by name: give "
            "this task's route a queue",
        )  # fmt: skip
    return queue


def chord_part(request: TaskMessage, state: State, result: Any) -> tuple[ChordPart, bytes, str, str] | None:
    """If ``request`` is a chord header task, its part for the joiner, encoded; else None.

    ``state`` is SUCCESS (``result`` the value) or FAILURE/REVOKED (``result`` the exception map).
    A result the request's serializer cannot carry makes the part a FAILURE: the chord fails
    rather than hangs.
    """
    body = request.embed.get("chord")
    if body is None or request.group is None or request.group_index is None:
        return None
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
    content_type = codec.serializer_of(request.content_type) or "msgpack"
    try:
        payload, ctype, encoding = encode_part(part, content_type)
    except (TypeError, ValueError, OverflowError) as exc:
        error = wire_exception("EncodeError", f"chord part cannot be encoded as {content_type}: {exc}")
        part = dataclasses.replace(part, state=State.FAILURE.value, result=error)
        payload, ctype, encoding = encode_part(part, content_type)
    return part, payload, ctype, encoding
