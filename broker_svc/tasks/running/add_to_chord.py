"""``Task.add_to_chord(sig)``: a chord's header task adds a task to its chord (Celery's).

The added task joins the chord as its adder's sibling: it carries the adder's chord id, place
(``group_index``) and body, and the body waits for it too, its value right after the adder's. A
chord joined on RabbitMQ is told first, by a growth record in its join queue confirmed before the
task is sent (``wire/records/chord_part.py``), so the joiner knows of it before the adder's own part or the
added task's part can reach it. A chord a Celery client sent on Redis results is counted in Redis,
as Celery's workers count it (``<group>.t`` + 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker_svc.topology import chord_join_queue
from broker_svc.wire.records.chord_part import ChordGrowth, encode_growth, join_namespace
from broker_svc.wire.task.task_message import WireMessage

if TYPE_CHECKING:
    from broker_svc.canvas.signature import Signature
    from broker_svc.tasks.request import Request
    from broker_svc.tasks.task_app import TaskApp

__all__ = ["add_to_chord"]


def add_to_chord(app: TaskApp, request: Request, sig: Signature, *, lazy: bool = False) -> Any:
    """Add ``sig`` to the chord ``request``'s task is a header task of; send it unless ``lazy``.

    Returns the added task's result, or (``lazy``) ``sig``, counted already, for the caller to send.

    Raises:
        ValueError: the running task is not a chord's header task.
        NotImplementedError: the chord is counted in Redis and the app's results are ``rpc://``.
        PublishError: the chord's joiner could not be told (nothing was sent).
    """
    body = request.chord
    if not body or not request.group:
        raise ValueError("Current task is not member of any chord")
    sig.set(group_id=request.group, group_index=request.group_index, chord=body, root_id=request.root_id)
    result = sig.freeze()
    size = body.get("chord_size")
    if isinstance(size, int):
        growth = ChordGrowth(group_id=request.group, size=size, added=(result.id,))
        payload, content_type, encoding = encode_growth(growth, "json")
        queue = chord_join_queue(join_namespace(body, app.settings.namespace))
        message = WireMessage(body=payload, content_type=content_type, content_encoding=encoding, headers={})
        app.publish_confirmed(queue, message)
    else:
        app.backend.add_to_chord(request.group, result)
    return sig if lazy else sig.delay()
