"""A task's request (``self.request``), the one of the task running now, and the send options.

Kept apart from ``broker_svc.tasks.task`` (which imports them from here, as it did) because the pool
child, the eager runner and the trace need a request without the ``Task`` class's machinery.
"""

from __future__ import annotations

import contextvars
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["SEND_OPTIONS", "ExceptionInfo", "Request", "countdown_to_eta", "current_request", "executing"]


# Options ``apply_async``/``send_task`` accept; anything else is a TypeError with this list, so a
# typo (``countdwon=``) is caught at the call instead of silently ignored.
SEND_OPTIONS: Final = frozenset(
    {
        "task_id", "queue", "priority", "countdown", "eta", "expires", "time_limit",
        "soft_time_limit", "ignore_result", "serializer", "headers", "shadow",
        "parent_id", "root_id", "retries", "reply_to",
        # the canvas: callbacks, errbacks, the rest of a chain, a group's id and place
        "link", "link_error", "chain", "chord", "group_id", "group_index",
        # set on the tasks a ``Task.replace`` sends (Celery's header)
        "replaced_task_nesting",
        # Celery's routing and publish-retry options (docs/migrating-from-celery.md)
        "routing_key", "exchange", "retry", "retry_policy",
        # keyed deduplication (broker_svc/sending/dedup_keys.py)
        "dedup_key", "dedup_timeout",
        # Celery's stamps: the names of the options that are stamps (broker_svc/wire/task/stamps.py)
        "stamped_headers",
    }
)  # fmt: skip


@dataclass(slots=True, kw_only=True)
class Request:
    """What a running task knows about its own call (``self.request`` in a bound task).

    ``called_directly`` is True when the task body runs in-process (``task(...)``), not in a worker.
    """

    id: str | None = None
    task: str = ""
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    retries: int = 0
    hostname: str | None = None
    delivery_info: dict[str, Any] = field(default_factory=dict)
    root_id: str | None = None
    parent_id: str | None = None
    group: str | None = None
    eta: str | None = None
    expires: str | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    origin: str | None = None
    ignore_result: bool = False
    # The message's ``timelimit`` header, ``(hard, soft)``; ``time_limit``/``soft_time_limit`` read it.
    timelimit: tuple[float | None, float | None] = (None, None)
    # The message's AMQP properties as Celery shows them (``content_type``, ``application_headers``,
    # ``priority``, ``reply_to``, ...); None outside a worker.
    properties: dict[str, Any] | None = None
    called_directly: bool = True
    # Run here by ``apply()`` (Celery's eager mode), not by a worker.
    is_eager: bool = False
    # The signatures to run if this task fails for good (``link_error``), as the message carried them.
    errbacks: list[dict[str, Any]] | None = None
    # The rest of the canvas, as the message carried it (Celery's names): callbacks (``link``), the
    # chain's next steps (last first), the chord's body, this task's place in its group; and how many
    # ``replace`` calls led here. ``Task.replace`` hands them on to the replacement.
    callbacks: list[dict[str, Any]] | None = None
    chain: list[dict[str, Any]] | None = None
    chord: dict[str, Any] | None = None
    group_index: int | None = None
    replaced_task_nesting: int = 0
    # The message's own headers (``apply_async(headers=...)``), also readable as attributes, as
    # Celery shows them: ``self.request.headers["tenant"]`` or ``self.request.tenant``.
    headers: dict[str, Any] | None = None
    # Celery's stamps (``Signature.stamp``) as the message carried them: the names, and their values.
    stamped_headers: list[str] | None = None
    stamps: dict[str, Any] | None = None
    # The ids of the tasks this run has sent (Celery's ``request.children``; ``result.children``).
    children: list[str] = field(default_factory=list)
    # Set by the worker: sends a state update ({"state", "meta"}) to the task's client.
    send_update: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    # Set by ``Task.retry`` when no retries are left, so the worker dead-letters the message.
    retries_exhausted: bool = False

    @property
    def time_limit(self) -> float | None:
        """The hard time limit the message carries (its ``timelimit`` header), as Celery's request.

        None when the sender set none, although the worker may hold the run to its own default.
        """
        return self.timelimit[0]

    @property
    def soft_time_limit(self) -> float | None:
        """The soft time limit the message carries; None when the sender set none."""
        return self.timelimit[1]

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: a custom header, as Celery's Context has them.
        headers = object.__getattribute__(self, "headers")
        if headers and name in headers:
            return headers[name]
        raise AttributeError(f"the request has no attribute or header {name!r}")

    @classmethod
    def from_worker(
        cls,
        context: Mapping[str, Any],
        *,
        task: str,
        args: list[Any],
        kwargs: dict[str, Any],
        send_update: Callable[[dict[str, Any]], None] | None,
    ) -> Request:
        """Build the request of a task the worker is running, from the context it sent along."""
        get = context.get  # some thirty lookups, once per task run
        limits = get("timelimit") or (None, None)
        return cls(
            id=get("id"),
            task=task,
            args=args,
            kwargs=kwargs,
            retries=int(get("retries") or 0),
            hostname=get("hostname"),
            delivery_info=dict(get("delivery_info") or {}),
            root_id=get("root_id"),
            parent_id=get("parent_id"),
            group=get("group"),
            eta=get("eta"),
            expires=get("expires"),
            reply_to=get("reply_to"),
            correlation_id=get("correlation_id"),
            origin=get("origin"),
            ignore_result=bool(get("ignore_result")),
            timelimit=(limits[0], limits[1]),
            properties=get("properties"),
            errbacks=get("errbacks"),
            callbacks=get("callbacks"),
            chain=get("chain"),
            chord=get("chord"),
            group_index=get("group_index"),
            replaced_task_nesting=int(get("replaced_task_nesting") or 0),
            headers=get("headers"),
            stamped_headers=get("stamped_headers"),
            stamps=get("stamps"),
            called_directly=False,
            send_update=send_update,
        )


@dataclass(frozen=True, slots=True)
class ExceptionInfo:
    """The ``einfo`` passed to ``on_failure``/``on_retry``/``after_return`` (as Celery's)."""

    exception: BaseException
    traceback: str


# The request of the task running in this context; set only around a task call by the worker,
# so tasks sent from inside a task inherit parent_id and root_id.
_current: contextvars.ContextVar[Request | None] = contextvars.ContextVar("clockwork_request", default=None)


def current_request() -> Request | None:
    """The request of the task running in this context, or None outside a task."""
    return _current.get()


class executing:
    """Make ``request`` the current one while a task body runs (used by the worker).

    A class, not a generator: it is entered once per task, and costs a third as much.
    """

    __slots__ = ("_request", "_token")

    def __init__(self, request: Request) -> None:
        self._request = request

    def __enter__(self) -> Request:
        self._token = _current.set(self._request)
        return self._request

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


def countdown_to_eta(countdown: float) -> dt.datetime:
    """The ETA ``countdown`` seconds from now, in UTC (as Celery's client converts it)."""
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=countdown)
