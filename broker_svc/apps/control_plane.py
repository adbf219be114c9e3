"""``app.control``: its shape (what ``control.api.Control`` offers) as Protocols, and its entry point.

The control package sits above this one (imports go worker -> control -> broker_svc), so
``App.control`` is typed by these Protocols and its object comes from the ``clockwork.control``
entry point, without an import from here. ``tests/unit/test_api_surface.py`` checks that
``control.api.Control`` satisfies them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from broker_svc.errors import ConfigurationError
from broker_svc.version import DISTRIBUTION

if TYPE_CHECKING:
    from broker_svc.schedules.client import ScheduleClient
    from broker_svc.wire.records.dead_letter import DeadLetter, RequeueResult

__all__ = [
    "CONTROL_ENTRY_POINT_GROUP",
    "ControlPlane",
    "DeadLetterQueues",
    "Destination",
    "Inspector",
    "Replies",
    "load_control",
]

CONTROL_ENTRY_POINT_GROUP = "clockwork.control"

# One node name, several, or None for every node.
Destination = str | Sequence[str] | None
# The ``{nodename: value}`` maps of the nodes that replied; None for a cast (no reply asked).
Replies = list[dict[str, Any]] | None


class Inspector(Protocol):
    """Read-only queries (``app.control.inspect()``): each returns ``{nodename: value}`` or None."""

    def ping(self) -> Any: ...
    def clock(self) -> Any: ...
    def active(self, safe: bool = False) -> Any: ...
    def reserved(self) -> Any: ...
    def scheduled(self) -> Any: ...
    def revoked(self) -> Any: ...
    def registered(self, *taskinfoitems: str) -> Any: ...
    def stats(self) -> Any: ...
    def query_task(self, *ids: str | Sequence[str]) -> Any: ...
    def active_queues(self) -> Any: ...
    def conf(self, with_defaults: bool = False) -> Any: ...
    def report(self) -> Any: ...
    def dedup(self) -> Any: ...


class DeadLetterQueues(Protocol):
    """The dead letters of ``<queue>.dead`` (``app.control.dead_letters()``; ``control.DeadLetters``)."""

    def dead_queues(self) -> list[str]: ...
    def list(self, queue: str | None = None, *, limit: int | None = None) -> list[DeadLetter]: ...
    def show(self, task_id: str, *, queue: str | None = None) -> Sequence[DeadLetter]: ...

    def requeue(
        self,
        *task_ids: str,
        queue: str | None = None,
        to: str | None = None,
        on_confirmed: Callable[[DeadLetter, str], None] | None = None,
    ) -> RequeueResult: ...

    def requeue_all(
        self,
        queue: str | None = None,
        *,
        to: str | None = None,
        on_confirmed: Callable[[DeadLetter, str], None] | None = None,
    ) -> RequeueResult: ...

    def purge(self, queue: str | None = None) -> dict[str, int]: ...


class ControlPlane(Protocol):
    """Remote control of the workers (``app.control``), shaped like Celery's ``app.control``."""

    def inspect(
        self,
        destination: Destination = None,
        timeout: float = 1.0,
        pattern: str | None = None,
        matcher: Literal["glob", "pcre"] | None = None,
        limit: int | None = None,
    ) -> Inspector: ...

    def broadcast(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        destination: Destination = None,
        reply: bool = False,
        timeout: float = 1.0,
        limit: int | None = None,
        pattern: str | None = None,
        matcher: Literal["glob", "pcre"] | None = None,
    ) -> Replies: ...

    def ping(self, destination: Destination = None, timeout: float = 1.0) -> list[dict[str, Any]]: ...

    def revoke(
        self,
        task_id: str | Sequence[str],
        destination: Destination = None,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        timeout: float = 1.0,
    ) -> Replies: ...

    def revoke_by_stamped_headers(
        self,
        headers: Mapping[str, Any] | Sequence[str],
        destination: Destination = None,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        timeout: float = 1.0,
    ) -> Replies: ...

    def terminate(
        self,
        task_id: str | Sequence[str],
        destination: Destination = None,
        signal: str = "SIGTERM",
        **kwargs: Any,
    ) -> Replies: ...

    def shutdown(self, destination: Destination = None, **kwargs: Any) -> Replies: ...
    def enable_events(self, destination: Destination = None, **kwargs: Any) -> Replies: ...
    def disable_events(self, destination: Destination = None, **kwargs: Any) -> Replies: ...
    def heartbeat(self, destination: Destination = None, **kwargs: Any) -> Replies: ...

    def time_limit(
        self,
        task_name: str,
        soft: float | None = None,
        hard: float | None = None,
        destination: Destination = None,
        **kwargs: Any,
    ) -> Replies: ...

    def add_consumer(
        self,
        queue: str,
        exchange: str | None = None,
        exchange_type: str = "direct",
        routing_key: str | None = None,
        options: dict[str, Any] | None = None,
        destination: Destination = None,
        **kwargs: Any,
    ) -> Replies: ...

    def cancel_consumer(self, queue: str, destination: Destination = None, **kwargs: Any) -> Replies: ...
    def pool_grow(self, n: int = 1, destination: Destination = None, **kwargs: Any) -> Replies: ...
    def pool_shrink(self, n: int = 1, destination: Destination = None, **kwargs: Any) -> Replies: ...

    def autoscale(
        self, max: int | None, min: int | None, destination: Destination = None, **kwargs: Any
    ) -> Replies: ...

    def schedules(self, scheduler: str = "default") -> ScheduleClient: ...
    def dead_letters(self) -> DeadLetterQueues: ...
    def close(self) -> None: ...


def load_control(app: object) -> ControlPlane:
    """The ``ControlPlane`` for ``app``, from the ``clockwork.control`` entry point named ``default``.

    ``app`` (an ``App``) is handed to the entry point's factory as it is.

    Raises:
        ConfigurationError: the entry point is missing (Clockwork is not installed).
    """
    import importlib.metadata  # it imports email, zipfile, csv (3 MiB): not in a process that never asks

    found = importlib.metadata.entry_points(group=CONTROL_ENTRY_POINT_GROUP, name="default")
    if not found:
        raise ConfigurationError(
            f"no {CONTROL_ENTRY_POINT_GROUP!r} entry point named 'default': app.control needs the "
            f"{DISTRIBUTION} distribution installed (pip install -e . in a checkout)"
        )
    factory = next(iter(found)).load()
    return cast(ControlPlane, factory(app))
