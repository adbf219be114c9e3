"""A signature and its send options as the task message to send, and where it goes.

What ``App.send_task``/``apply_async`` build before handing a message to the publisher: the
options checked against ``SEND_OPTIONS``, the route (``task_routes``, or Celery's ``exchange``
and ``routing_key``), ETA and expiry as aware datetimes, the parent and root of a task sent from
a task, and protocol v2's embed (callbacks, errbacks, the rest of a chain, a chord's body).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from broker_svc import signals
from broker_svc.canvas.signature import Signature
from broker_svc.clock import LamportClock
from broker_svc.results.result import AsyncResult
from broker_svc.sending.dedup_keys import dedup_call
from broker_svc.sending.park_records import park_records
from broker_svc.sending.routes import route_for
from broker_svc.settings import Settings
from broker_svc.tasks.request import SEND_OPTIONS, countdown_to_eta, current_request
from broker_svc.topology import DEFAULT_EXCHANGE, QueueSpec, task_states_stream
from broker_svc.wire.records.dedup import (
    DEADLINE_HEADER,
    KEY_HEADER,
    MAX_DEDUP_TIMEOUT_S,
    TIMEOUT_HEADER,
    dedup_headers,
)
from broker_svc.wire.records.task_state import CONTENT_TYPE as STATE_CONTENT_TYPE
from broker_svc.wire.records.task_state import JobState, StateRecord
from broker_svc.wire.task.stamps import message_stamps
from broker_svc.wire.task.task_message import TaskMessage

if TYPE_CHECKING:
    from broker_svc.apps.conf import Config
    from broker_svc.connection.pending import PendingPublish
    from broker_svc.results.store import ResultStore
    from broker_svc.sending.batch import Batch
    from broker_svc.sending.producer import Producer

__all__ = [
    "CLIENT_HOSTNAME",
    "Destination",
    "after_publish",
    "before_publish",
    "build_message",
    "send_signatures",
    "state_publish",
]

# How a client names itself in the records it writes to the task-state stream.
CLIENT_HOSTNAME = f"client{os.getpid()}@{platform.node()}"


def build_message(
    sig: Signature, *, conf: Mapping[str, Any], settings: Settings, clock: LamportClock, reply_queue: str
) -> tuple[TaskMessage, Destination, str | None]:
    """A signature as the task message to send, where to send it, and its serializer (None: default).

    A send with a dedup key (its ``dedup_key`` option, formed by ``resolve_dedup``) carries the
    gate's headers (``broker_svc/wire/records/dedup.py``), the destination queue among them.

    Raises:
        TypeError: an unknown send option, kwargs that are not a map, ``stamped_headers`` that is
            not a list of names, an eta or expires of the wrong type, an exchange that is not a
            name, or a dedup key with a named exchange.
        ValueError: a dedup key or timeout out of range.
    """
    options = sig.options
    # Stamps are send options of their own names (Celery's ``Signature.stamp``).
    stamped_headers, stamps = message_stamps(options)
    unknown = set(options) - SEND_OPTIONS - set(stamped_headers or ())
    if unknown:
        raise TypeError(f"unknown send option(s) {sorted(unknown)}; known: {sorted(SEND_OPTIONS)}")
    if not isinstance(sig.kwargs, Mapping):
        raise TypeError("kwargs must be a mapping")
    if "queue" not in options:
        routed = route_for(conf.get("task_routes"), sig.task, sig.args, sig.kwargs, options)
        options = {**routed, **options}
    if "priority" not in options and conf.get("task_default_priority") is not None:
        options = {**options, "priority": conf["task_default_priority"]}
    eta = options.get("eta")
    if options.get("countdown") is not None:
        eta = countdown_to_eta(float(options["countdown"]))
    expires = options.get("expires")
    if isinstance(expires, int | float):
        expires = countdown_to_eta(float(expires))
    for label, value in (("eta", eta), ("expires", expires)):
        if value is not None and not isinstance(value, dt.datetime):
            raise TypeError(f"{label} must be a datetime (or a number of seconds for expires)")
    eta = _aware(eta)
    expires = _aware(expires)
    task_id = options.get("task_id") or TaskMessage.new_id()
    ignore_result = bool(options.get("ignore_result", conf.get("task_ignore_result", False)))
    # A task sent from inside a running task is its child: parent_id/root_id link the tree.
    parent = current_request()
    if parent is not None and not parent.called_directly:
        options = {"parent_id": parent.id, "root_id": parent.root_id or parent.id, **options}
    exchange = _other_exchange(options)
    if exchange is None:
        destination = Destination(_queue(options) or settings.default_queue)
    else:
        # Celery's routing key on the named exchange (a queue's key, by default its name).
        key = options.get("routing_key")
        destination = Destination(key if isinstance(key, str) else options.get("queue") or "", exchange)
    extra_headers = dict(options.get("headers") or {})
    if extra_headers:
        # A task sent with its parent's headers (``headers=self.request.headers``) must not take
        # its parent's dedup key along: its worker would release the parent's key.
        for name in (KEY_HEADER, TIMEOUT_HEADER, DEADLINE_HEADER):
            extra_headers.pop(name, None)
    if "dedup_key" in options or "dedup_timeout" in options:
        dedup = dedup_call(sig.task, options)
        if dedup is not None:
            if exchange is not None:
                raise TypeError("dedup_key sends to a queue, not to a named exchange; drop exchange=")
            if eta is not None:
                # Its safety timeout runs from its ETA, and the gate holds its head marker till then.
                held_s = (eta - dt.datetime.now(dt.UTC)).total_seconds() + dedup.timeout_s
                if held_s > MAX_DEDUP_TIMEOUT_S:
                    raise ValueError(
                        f"task {sig.task!r}: an ETA {held_s - dedup.timeout_s:.0f} s away plus its "
                        f"dedup_timeout passes {MAX_DEDUP_TIMEOUT_S:.0f} s, longer than the broker lets "
                        "the gate hold a task (consumer_timeout); send it closer to its time"
                    )
            # To the key's gate shard (``prepare_publish``), which sends it on to ``destination``.
            extra_headers.update(dedup_headers(dedup.key, dedup.timeout_s, destination.queue))
    message = TaskMessage(
        id=task_id,
        task=sig.task,
        args=list(sig.args),
        kwargs=dict(sig.kwargs),
        root_id=options.get("root_id"),
        parent_id=options.get("parent_id"),
        retries=int(options.get("retries", 0)),
        eta=eta,
        expires=expires,
        timelimit=(options.get("time_limit"), options.get("soft_time_limit")),
        ignore_result=ignore_result,
        shadow=options.get("shadow"),
        clock=clock.forward(),
        reply_to=options.get("reply_to") or reply_queue,
        correlation_id=task_id,
        priority=options.get("priority"),
        extra_headers=extra_headers,
        embed=_embed(options),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        replaced_task_nesting=int(options.get("replaced_task_nesting") or 0),
        stamped_headers=stamped_headers,
        stamps=stamps,
    )
    return message, destination, options.get("serializer")


def before_publish(message: TaskMessage, queue: str, exchange: str) -> TaskMessage:
    # Celery's before_task_publish: receivers see the headers and may add their own.
    headers = {
        "task": message.task, "id": message.id, "root_id": message.root_id, "parent_id": message.parent_id,
        "retries": message.retries, **message.extra_headers,
    }  # fmt: skip
    standard = dict(headers)
    signals.before_task_publish.send(
        sender=message.task, body=(message.args, message.kwargs, message.embed), exchange=exchange,
        routing_key=queue, headers=headers, properties={}, declare=[], retry_policy=None,
    )  # fmt: skip
    added = {k: v for k, v in headers.items() if k not in standard or standard[k] is not v}
    if not added:
        return message
    return dataclasses.replace(message, extra_headers={**message.extra_headers, **added})


def send_signatures(
    signatures: Sequence[Signature],
    producer: Producer,
    *,
    batch: Batch | None,
    wait: bool,
    conf: Config,
    settings: Settings,
    clock: LamportClock,
    reply_queue: str,
    results: ResultStore,
) -> list[AsyncResult]:
    """``App.send_task``/``send_many``: prepare each task, register its result, hand them over.

    They go to ``batch`` when a ``with app.batch()`` block is open on this thread, else to the
    producer (the connection, or the spool) in one piece; ``wait`` as ``Producer.submit``.
    """
    publisher = producer.publisher
    prepared: list[tuple[PendingPublish, str]] = []
    messages: list[TaskMessage] = []
    queues: list[str] = []  # where each goes: a dedup send's target queue, not its gate shard
    announce = signals.before_task_publish.has_receivers or signals.after_task_publish.has_receivers
    for sig in signatures:
        message, (queue, exchange), serializer = build_message(
            sig, conf=conf, settings=settings, clock=clock, reply_queue=reply_queue
        )
        if announce:
            message = before_publish(message, queue, exchange or "")
        pending = publisher.prepare(
            message,
            queue=queue,
            queue_type=settings.queue_type(queue),
            serializer=serializer,
            exchange=exchange,
        )
        prepared.append((pending, message.id))
        messages.append(message)
        queues.append(queue)
    # Results register before the publish, so even an instant reply finds its waiter.
    handles = [AsyncResult(task_id, store=results, publish=p) for p, task_id in prepared]
    sent = [pending for pending, _ in prepared]
    if settings.task_states and settings.spool_dir is None:
        # QUEUED, in the same hand-over: one more pipelined publish per task, confirmed alongside.
        # (Not through a spool: its records name task queues only; docs/design.md, "Task states".)
        stream = task_states_stream(settings.namespace)
        now = time.time()
        for (pending, task_id), queue in zip(prepared, queues, strict=True):
            headers = pending.message.headers
            record = StateRecord(
                task_id=task_id, state=JobState.QUEUED, at=now, clock=int(headers.get("clock") or 0),
                hostname=CLIENT_HOSTNAME, name=headers.get("task"), queue=queue,
            )  # fmt: skip
            queued = state_publish(record, stream)
            results.note_queued(task_id, queued)  # app.jobs waits for it: read-your-writes
            sent.append(queued)
    if settings.spool_dir is None:
        # inspect scheduled: what goes straight to a delay queue, recorded after it (park_records.py).
        # (Not through a spool either: its drain routes a task only when it sends it.)
        pairs = [(pending, message) for (pending, _), message in zip(prepared, messages, strict=True)]
        sent.extend(park_records(pairs, namespace=settings.namespace, now=time.time()))
    if batch is not None:
        batch.keep(sent, handles)  # sent at the end of the ``with app.batch()`` block
    else:
        producer.submit(sent, wait=wait)
    running = current_request()
    if running is not None:  # sent from a task: its children, as Celery's result.children lists
        running.children.extend(task_id for _, task_id in prepared)
    if announce:
        after_publish(sent)
    return handles


def state_publish(record: StateRecord, stream: QueueSpec) -> PendingPublish:
    """A state record on its way to the app's task-state stream (declared first on each connection)."""
    from broker_svc.connection.pending import PendingPublish  # pure bookkeeping; no pika

    return PendingPublish(
        record.wire(), exchange=DEFAULT_EXCHANGE, routing_key=stream.name, declare=(stream,)
    )


def after_publish(sent: Sequence[PendingPublish]) -> None:
    # Celery's after_task_publish, once a task is handed over (to the connection, or the spool).
    for pending in sent:
        if pending.best_effort:
            continue  # a park record, not a task
        if pending.message.content_type == STATE_CONTENT_TYPE and "task" not in pending.message.headers:
            continue
        headers = pending.message.headers
        signals.after_task_publish.send(
            sender=headers.get("task"), headers=headers, body=pending.message.body,
            exchange=pending.exchange, routing_key=pending.queue,
        )  # fmt: skip


def _embed(options: Mapping[str, Any]) -> dict[str, Any]:
    # Protocol v2's embed: callbacks (link), errbacks (link_error), the rest of a chain.
    def maps(value: Any) -> list[dict[str, Any]] | None:
        if not value:
            return None
        items = value if isinstance(value, list | tuple) else [value]
        return [
            Signature(item).as_wire() if not isinstance(item, Signature) else item.as_wire() for item in items
        ]

    if (
        "link" not in options
        and "link_error" not in options
        and "chain" not in options
        and "chord" not in options
    ):
        return {"callbacks": None, "errbacks": None, "chain": None, "chord": None}  # most sends
    chord = options.get("chord")  # a chord's body, carried by each header task
    return {
        "callbacks": maps(options.get("link")),
        "errbacks": maps(options.get("link_error")),
        "chain": maps(options.get("chain")),
        "chord": chord.as_wire() if isinstance(chord, Signature) else chord,
    }


class Destination(NamedTuple):
    """Where a task goes: a queue on the default exchange, or a routing key on a named exchange."""

    queue: str
    exchange: str | None = None


def _other_exchange(options: Mapping[str, Any]) -> str | None:
    # A named exchange other than the default (or the queue's own, which routes the same way).
    exchange = options.get("exchange")
    if exchange is None or exchange == "":
        return None
    if not isinstance(exchange, str):
        raise TypeError(f"exchange must be an exchange's name, got {type(exchange).__name__}")
    if exchange in (options.get("queue"), options.get("routing_key")) and (
        options.get("routing_key") in (None, exchange)
    ):
        return None  # Celery's pairing of a queue with its same-named direct exchange
    return exchange


def _queue(options: Mapping[str, Any]) -> str | None:
    # Celery's routing_key on the default exchange names the queue.
    queue: str | None = options.get("queue")
    routing_key = options.get("routing_key")
    if queue is None:
        queue = routing_key
    elif routing_key not in (None, queue):
        raise TypeError(f"routing_key={routing_key!r} names another queue than queue={queue!r}")
    return queue


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value
