"""``Task.replace(sig)``: a running task hands its place to a signature, a chain or a group (Celery's).

The replacement's last task takes the replaced task's id and result queue, so the caller's
``get()`` answers with the replacement's result; it also takes the replaced task's callbacks,
errbacks, chord and group place, so a chord whose header held the replaced task still joins. The
rest of the replaced task's chain runs after the replacement, each step with its own id. Every
task sent has ``replaced_task_nesting`` one higher than the replaced one's. A group is made a chord
with ``celery.accumulate`` as its body (sent to the replaced task's queue), so its list of results
is one result with that id. Then the
replaced task raises ``Ignore``: its worker acks it and answers nothing (eager: the replacement's
value is returned instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker_svc.canvas.signature import Signature, chain, chord, group, maybe_signature
from broker_svc.errors import Ignore
from broker_svc.wire import codec

if TYPE_CHECKING:
    from broker_svc.tasks.request import Request
    from broker_svc.tasks.task_app import TaskApp

__all__ = ["replace"]


def replace(app: TaskApp, request: Request, sig: Signature) -> Any:
    """Send ``sig`` in the place of the task ``request`` runs; raises ``Ignore`` (eager: its value).

    Raises:
        ValueError: ``sig`` carries a chord of its own, or is an empty chain.
        Ignore: always, once the replacement is sent (the worker acks the replaced task unanswered).
    """
    if "chord" in sig.options:
        raise ValueError("a signature replacing a task must not be part of a chord")
    sig = sig.clone()
    if isinstance(sig, chain) and not sig.tasks:
        raise ValueError("cannot replace a task with an empty chain")
    if isinstance(sig, group):
        # Celery's: a group gets a body, so its results come back as one result, the replaced one.
        # Its body goes to the replaced task's own queue, which a worker of this app consumes.
        where = request.delivery_info.get("routing_key")
        body = Signature("celery.accumulate", (), {"index": 0}, {"queue": where} if where else {}, app=app)
        sig = chord(sig.tasks, body, app=app)
    steps = list(sig.tasks) if isinstance(sig, chain) else [sig]
    last = steps[-1]
    final = last.body if isinstance(last, chord) and last.body is not None else last
    nesting = request.replaced_task_nesting + 1
    for callback in request.callbacks or ():
        final.link(maybe_signature(callback, app))
    final.options["task_id"] = request.id
    if request.reply_to:
        final.options["reply_to"] = request.reply_to
    if request.chord is not None:  # a chord's header task: the replacement's end is its part
        final.options.update(chord=request.chord, group_id=request.group, group_index=request.group_index)
    rest = [maybe_signature(step, app) for step in reversed(request.chain or ())]
    everything = [*steps, *rest]
    # In the replaced task's serializer, as a worker's follow-ups: its caller reads that one.
    serializer = codec.serializer_of((request.properties or {}).get("content_type"))
    for step in everything:
        step.options["replaced_task_nesting"] = nesting
        if serializer is not None:
            step.options.setdefault("serializer", serializer)
        if request.root_id:
            step.options["root_id"] = request.root_id
        for errback in request.errbacks or ():
            step.link_error(maybe_signature(errback, app))
    replacement = everything[0] if len(everything) == 1 else chain(*everything, app=app)
    if request.is_eager:
        return replacement.apply().get()
    replacement.apply_async()
    raise Ignore("Replaced by new task")
