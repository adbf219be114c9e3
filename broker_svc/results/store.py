"""``ResultStore``: the latest states of the tasks a client waits for, with thread-safe waits, fed
by its ``rpc://`` reply queue's consumer and, with a Redis result backend, by a ``ResultSource``."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Final, Protocol

from broker_svc.connection.pending import Delivery, PendingPublish
from broker_svc.errors import MessageError, ResultTimeout, ResultUnreachable
from broker_svc.logging import get_logger
from broker_svc.wire import codec
from broker_svc.wire.results.message import Outcome

__all__ = ["OnMessage", "ResultSource", "ResultStore"]

log = get_logger(__name__)

# States kept per task for ``get(on_message=...)`` replay; progress updates beyond this are dropped
# oldest-first (the latest state is always kept).
_HISTORY_LIMIT: Final = 256

OnMessage = Callable[[dict[str, Any]], None]

# Results of tasks nobody waits for yet (a callback or child task whose handle comes later, from
# ``result.children`` or ``AsyncResult(id)``), kept for that many tasks, oldest dropped first.
_STRAY_KEPT: Final = 1000
# QUEUED records this client sent and may still be waiting on (read-your-writes for app.jobs):
# the newest ones, as a status asked right after a send is what needs it.
_QUEUED_KEPT: Final = 10_000


class ResultSource(Protocol):
    """Where states come from besides the reply queue (the Redis backend's ``RedisResults``)."""

    def watch(self, task_id: str) -> None:
        """Follow ``task_id``: offer its stored state and every later one."""

    def unwatch(self, task_id: str) -> None:
        """Stop following ``task_id``."""

    def forget(self, task_id: str) -> None:
        """Delete ``task_id``'s stored state."""

    def save_group(self, group_id: str, value: Any) -> None:
        """Store a group's ``as_tuple()`` under its id."""

    def restore_group(self, group_id: str) -> Any | None:
        """A group's stored ``as_tuple()``, or None."""

    def delete_group(self, group_id: str) -> None:
        """Delete a stored group."""

    def add_to_chord(self, group_id: str) -> None:
        """Count one more task in a chord counted in Redis."""

    def store(self, meta: dict[str, Any]) -> None:
        """Store and publish a task's state."""


class ResultStore:
    """The latest states of the tasks one client is waiting for, fed by its reply-queue consumer.

    Tasks this client registered are kept while a handle holds them; the results of the last
    ``_STRAY_KEPT`` others wait for a handle (Celery's rpc backend keeps them too, unbounded), so a
    stray or late result costs bounded memory.
    """

    def __init__(self, *, accept: frozenset[str], max_bytes: int) -> None:
        self._accept = accept
        self._max_bytes = max_bytes
        self._cond = threading.Condition()
        self._wanted: dict[str, int] = {}
        self._history: dict[str, deque[Outcome]] = {}
        self._queued: OrderedDict[str, PendingPublish] = OrderedDict()
        self._stray: OrderedDict[str, deque[Outcome]] = OrderedDict()
        # The task-state stream's answer for a task with no result here (``App`` sets it; it
        # returns None unless ``task_states`` is on).
        self.state_lookup: Callable[[str], str | None] | None = None
        # Why no result can arrive now (no connection to the broker), or None; set by the app.
        self.unreachable: Callable[[], str | None] | None = None
        # The app's other source of states (a Redis result backend), or None; set by the app.
        self.source: Callable[[], ResultSource | None] | None = None
        # The app's ``control.revoke`` (``AsyncResult.revoke``), or None; set by the app.
        self.revoke: Callable[..., Any] | None = None

    def register(self, task_id: str) -> None:
        """Start keeping results for ``task_id`` (one call per ``AsyncResult`` holding it)."""
        with self._cond:
            count = self._wanted[task_id] = self._wanted.get(task_id, 0) + 1
            stray = self._stray.pop(task_id, None)
            if stray is not None:
                self._history.setdefault(task_id, stray)
        source = self.source() if self.source is not None and count == 1 else None
        if source is not None:
            source.watch(task_id)  # outside the lock: it offers what it reads

    def release(self, task_id: str) -> None:
        """Stop keeping results for ``task_id`` once no ``AsyncResult`` holds it."""
        with self._cond:
            count = self._wanted.get(task_id, 0) - 1
            if count > 0:
                self._wanted[task_id] = count
            else:
                self._wanted.pop(task_id, None)
                self._history.pop(task_id, None)
        source = self.source() if self.source is not None and count <= 0 else None
        if source is not None:
            source.unwatch(task_id)

    def forget(self, task_id: str) -> None:
        """Drop the states received so far for ``task_id``, and its stored state in the source.

        Raises:
            ResultBackendUnavailable: the source (Redis) could not be reached.
        """
        with self._cond:
            self._history.pop(task_id, None)
        source = self.source() if self.source is not None else None
        if source is not None:
            source.forget(task_id)

    def on_delivery(self, delivery: Delivery) -> None:
        """Consumer callback (I/O thread): decode one result and wake its waiters."""
        try:
            body = codec.decode(
                delivery.body, delivery.content_type, accept=self._accept, max_bytes=self._max_bytes
            )
            outcome = Outcome.from_wire(body, correlation_id=delivery.correlation_id)
        except MessageError as exc:
            log.warning("result_refused", error=str(exc), correlation_id=delivery.correlation_id)
            return
        self.offer(outcome)

    def offer(self, outcome: Outcome) -> None:
        """A state received (from the reply queue or a ``ResultSource``): keep it, wake its waiters."""
        with self._cond:
            if outcome.task_id not in self._wanted:
                self._keep_stray(outcome)
                return
            history = self._history.setdefault(outcome.task_id, deque(maxlen=_HISTORY_LIMIT))
            if history and history[-1].ready and not outcome.ready:
                return  # read late from a second source (Redis and the reply queue): it ended already
            history.append(outcome)
            self._cond.notify_all()

    def _keep_stray(self, outcome: Outcome) -> None:
        stray = self._stray.get(outcome.task_id)
        if stray is None:
            stray = self._stray[outcome.task_id] = deque(maxlen=_HISTORY_LIMIT)
            if len(self._stray) > _STRAY_KEPT:
                self._stray.popitem(last=False)
        stray.append(outcome)

    def note_queued(self, task_id: str, record: PendingPublish) -> None:
        """This client sent ``task_id``'s QUEUED record to the task-state stream (``record``)."""
        with self._cond:
            self._queued[task_id] = record
            while len(self._queued) > _QUEUED_KEPT:
                self._queued.popitem(last=False)

    def queued_record(self, task_id: str) -> PendingPublish | None:
        """The QUEUED record this client sent for ``task_id`` and the broker has not confirmed yet."""
        with self._cond:
            record = self._queued.get(task_id)
            if record is not None and record.done:
                del self._queued[task_id]  # confirmed (or failed): nothing left to wait for
                return None
            return record

    def latest(self, task_id: str) -> Outcome | None:
        """The newest state received for ``task_id``, if any."""
        with self._cond:
            history = self._history.get(task_id)
            return history[-1] if history else None

    def wait(
        self,
        task_id: str,
        *,
        timeout: float | None,
        on_message: OnMessage | None = None,
        publish: PendingPublish | None = None,
    ) -> Outcome:
        """Block until a ready state arrives; call ``on_message`` for each state, in order.

        Raises:
            ResultTimeout: no ready state within ``timeout``.
            ResultUnreachable: no ready state within ``timeout``, and no connection to the broker
                (a ``ResultTimeout`` and a ``BrokerUnavailable``, saying why).
            PublishError: the task's own publish failed, so no result can ever come.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                history = self._history.get(task_id, ())
                for outcome in list(history)[seen:]:
                    seen += 1
                    if on_message is not None:
                        self._cond.release()
                        try:
                            on_message(outcome.to_wire())
                        finally:
                            self._cond.acquire()
                if history and history[-1].ready:
                    return history[-1]
                if publish is not None and publish.error is not None:
                    raise publish.error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    why = self.unreachable() if self.unreachable is not None else None
                    if why is not None:
                        raise ResultUnreachable(f"no result for task {task_id} within {timeout} s: {why}")
                    raise ResultTimeout(f"no result for task {task_id} within {timeout} s")
                # Wake at least every second to notice a failed publish.
                self._cond.wait(1.0 if remaining is None else min(remaining, 1.0))
