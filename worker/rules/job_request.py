"""The job request: what a task's run carries into its child besides its arguments.

A child sees ``task.request`` as Celery builds it — id, retries, hostname, parents, eta, expiry,
reply address, time limits and ``delivery_info`` (which marks a repeat run as redelivered) — and is
held to hard and soft time limits chosen from the call, the ``time_limit`` command, the task and the
worker's defaults. These are pure functions of the decoded message and the delivery's attributes;
they are apart from the consumer so that what a task is told is written down in one place, with
no I/O next to it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final, Protocol

from broker_svc.tasks.task import Task
from broker_svc.wire.records.dedup import head_deadline
from broker_svc.wire.task.task_message import RESENT_HEADER, TaskMessage, eta_and_expires
from worker.rules.deliveries import delivery_count

__all__ = [
    "DeliveryFacts",
    "custom_headers",
    "delivery_info",
    "message_properties",
    "past_dedup_deadline",
    "reply_wanted",
    "request_context",
    "time_limits",
]


class DeliveryFacts(Protocol):
    """What ``delivery_info`` reads of a delivery (aio-pika's, or a consuming child's)."""

    @property
    def headers(self) -> Mapping[str, Any] | None: ...
    @property
    def redelivered(self) -> bool | None: ...
    @property
    def exchange(self) -> str | None: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def priority(self) -> int | None: ...


def time_limits(
    request: TaskMessage,
    task: Task,
    *,
    override: tuple[float | None, float | None],
    defaults: tuple[float | None, float | None],
) -> tuple[float | None, float | None]:
    """The (hard, soft) time limits of one run.

    Args:
        request: the decoded task message (the call's own limits).
        task: the registered task (its class limits).
        override: the limits the ``time_limit`` command set for this task name.
        defaults: the worker's default limits.

    Returns:
        The hard and soft limits in seconds, None for none.
    """
    # The call's limits win, then the task's own, then the worker's defaults (as Celery).
    hard, soft = request.timelimit
    override_hard, override_soft = override
    hard = hard if hard is not None else override_hard
    soft = soft if soft is not None else override_soft
    hard = hard if hard is not None else task.time_limit or defaults[0]
    soft = soft if soft is not None else task.soft_time_limit or defaults[1]
    deadline = head_deadline(request.extra_headers)
    if deadline is not None:
        # A dedup key's head may not outlive its safety timeout: past it the gate sends the next
        # task of its key, and two must never run at once.
        left = max(deadline - time.time(), 0.001)
        hard = left if hard is None else min(hard, left)
    return hard, soft


def past_dedup_deadline(request: TaskMessage) -> bool:
    """A dedup key's head that starts after its deadline: the gate has evicted it, and it must not run."""
    deadline = head_deadline(request.extra_headers)
    return deadline is not None and deadline <= time.time()


def reply_wanted(request: TaskMessage, task: Task | None, *, failed: bool = False) -> bool:
    """Whether a state of ``request`` goes to its ``reply_to``: not when results are ignored.

    ``failed``: a final failure, which ``store_errors_even_if_ignored`` sends all the same.
    """
    return request.reply_to is not None and result_stored(request, task, failed=failed)


def result_stored(request: TaskMessage, task: Task | None, *, failed: bool = False) -> bool:
    """Whether a state of ``request`` is kept for its caller at all (``ignore_result`` and
    ``store_errors_even_if_ignored``), by ``reply_to`` or in a result backend."""
    ignored = request.ignore_result or (task is not None and task.ignore_result)
    return not ignored or (failed and task is not None and task.store_errors_even_if_ignored)


def request_context(
    request: TaskMessage,
    delivery: dict[str, Any],
    *,
    hostname: str,
    properties: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``task.request`` context a child sees for ``request``.

    Args:
        request: the decoded task message.
        delivery: its ``delivery_info``.
        hostname: the worker's node name.
        properties: its AMQP properties as Celery shows them (``message_properties``).
    """
    embed = request.embed
    context: dict[str, Any] = {
        "properties": properties,
        "id": request.id,
        "retries": request.retries,
        "hostname": hostname,
        "root_id": request.root_id,
        "parent_id": request.parent_id,
        "group": request.group,
        **eta_and_expires(request),
        "reply_to": request.reply_to,
        "correlation_id": request.correlation_id,
        "origin": request.origin,
        "ignore_result": request.ignore_result,
        "timelimit": list(request.timelimit),
        "delivery_info": delivery,
    }
    # Only what the message carries, in this order (a key per ``if``: this runs once per task).
    # The child calls new-style errbacks (request, exc, traceback) itself, as Celery's does.
    if embed.get("errbacks"):
        context["errbacks"] = embed["errbacks"]
    # What Task.replace hands on to a replacement: the rest of the canvas, the group place.
    for key in _CANVAS_KEYS:
        if embed.get(key):
            context[key] = embed[key]
    if request.group_index is not None:
        context["group_index"] = request.group_index
    if request.replaced_task_nesting:
        context["replaced_task_nesting"] = request.replaced_task_nesting
    if request.extra_headers and (headers := custom_headers(request)):
        context["headers"] = headers
    # Celery's task sees both headers as sent: None and {} on a task nobody stamped.
    context["stamped_headers"] = request.stamped_headers
    context["stamps"] = request.stamps
    return context


_CANVAS_KEYS: Final = ("callbacks", "chain", "chord")


def custom_headers(request: TaskMessage) -> dict[str, Any]:
    """The message's headers that are neither Celery's nor the broker's nor ours (Celery's rule)."""
    return {
        key: value
        for key, value in request.extra_headers.items()
        if not key.startswith(_NOT_CUSTOM_PREFIXES) and key not in _NOT_CUSTOM
    }


# RabbitMQ's dead-lettering and delivery counts, and Clockwork's own bookkeeping.
_NOT_CUSTOM_PREFIXES: Final = ("x-clockwork-", "x-death", "x-first-death-", "x-last-death-", "x-delivery-")
_NOT_CUSTOM: Final = frozenset({"meth"})


def message_properties(properties: object | None) -> dict[str, Any] | None:
    """A delivery's AMQP properties as a Celery task sees them (``request.properties``).

    ``properties`` is a content header as a child reads it (``broker_svc.amqp.frames.Properties``).
    py-amqp's names and order, the headers as ``application_headers``, only those the message
    carries: what kombu hands a Celery worker, so code reading ``priority`` or ``app_id`` there
    works unchanged.
    """
    if properties is None:
        return None
    found: dict[str, Any] = {}
    for name, attribute in _PROPERTY_NAMES:
        value = getattr(properties, attribute, None)
        if value is not None:
            found[name] = value
    return found


# (Celery's name, the content header's attribute), in the order py-amqp decodes them.
_PROPERTY_NAMES: Final = (
    ("content_type", "content_type"), ("content_encoding", "content_encoding"),
    ("application_headers", "headers"), ("delivery_mode", "delivery_mode"), ("priority", "priority"),
    ("correlation_id", "correlation_id"), ("reply_to", "reply_to"), ("expiration", "expiration"),
    ("message_id", "message_id"), ("timestamp", "timestamp"), ("type", "type"), ("user_id", "user_id"),
    ("app_id", "app_id"),
)  # fmt: skip


def delivery_info(message: DeliveryFacts) -> dict[str, Any]:
    """Celery's ``delivery_info`` for ``message``, with ``redelivered`` set on any repeat run."""
    # ``redelivered`` also marks a copy the worker made of a redelivery (classic queues) or of a
    # delivery whose child died, and a message our client sent again after a lost confirm: a
    # repeat run is marked either way. ``delivery_count`` is how many earlier deliveries did not
    # finish (worker.rules.deliveries).
    count = delivery_count(message.headers, redelivered=message.redelivered)
    resent = bool(message.headers and message.headers.get(RESENT_HEADER))
    return {
        "exchange": message.exchange,
        "routing_key": message.routing_key,
        "priority": message.priority,
        "redelivered": message.redelivered or count > 0 or resent,
        "delivery_count": count,
    }
