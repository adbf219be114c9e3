"""Results over the ``rpc://`` reply queue: one queue per client, many tasks, thread-safe waits."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Final, Generic, Literal, overload

from typing_extensions import TypeVar

from broker_svc.connection.pending import Delivery, PendingPublish
from broker_svc.errors import MessageError, ResultTimeout, TaskDeclined, TaskError
from broker_svc.logging import get_logger
from broker_svc.results.group_result import GroupResult
from broker_svc.wire import codec
from broker_svc.wire.result_message import Outcome, exception_from_wire
from broker_svc.wire.result_view import OutcomeView
from broker_svc.wire.states import State

__all__ = ["AsyncResult", "ResultStore", "outcome_error", "outcome_value"]

# What the task returns (``AsyncResult[int]`` for ``def add(...) -> int``); Any when unknown.
R = TypeVar("R", default=Any)

log = get_logger(__name__)

# States kept per task for ``get(on_message=...)`` replay; progress updates beyond this are dropped
# oldest-first (the latest state is always kept).
_HISTORY_LIMIT: Final = 256

OnMessage = Callable[[dict[str, Any]], None]

# How often a chain's result looks at its earlier steps while it waits.
_PARENT_CHECK_S: Final = 0.2


# Results of tasks nobody waits for yet (a callback or child task whose handle comes later, from
# ``result.children`` or ``AsyncResult(id)``), kept for that many tasks, oldest dropped first.
_STRAY_KEPT: Final = 1000


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
        self._stray: OrderedDict[str, deque[Outcome]] = OrderedDict()
        # The task-state stream's answer for a task with no result here (``App`` sets it; it
        # returns None unless ``task_states`` is on).
        self.state_lookup: Callable[[str], str | None] | None = None

    def register(self, task_id: str) -> None:
        """Start keeping results for ``task_id`` (one call per ``AsyncResult`` holding it)."""
        with self._cond:
            self._wanted[task_id] = self._wanted.get(task_id, 0) + 1
            stray = self._stray.pop(task_id, None)
            if stray is not None:
                self._history.setdefault(task_id, stray)

    def release(self, task_id: str) -> None:
        """Stop keeping results for ``task_id`` once no ``AsyncResult`` holds it."""
        with self._cond:
            count = self._wanted.get(task_id, 0) - 1
            if count > 0:
                self._wanted[task_id] = count
            else:
                self._wanted.pop(task_id, None)
                self._history.pop(task_id, None)

    def forget(self, task_id: str) -> None:
        """Drop the states received so far for ``task_id``."""
        with self._cond:
            self._history.pop(task_id, None)

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
        with self._cond:
            if outcome.task_id not in self._wanted:
                self._keep_stray(outcome)
                return
            history = self._history.setdefault(outcome.task_id, deque(maxlen=_HISTORY_LIMIT))
            history.append(outcome)
            self._cond.notify_all()

    def _keep_stray(self, outcome: Outcome) -> None:
        stray = self._stray.get(outcome.task_id)
        if stray is None:
            stray = self._stray[outcome.task_id] = deque(maxlen=_HISTORY_LIMIT)
            if len(self._stray) > _STRAY_KEPT:
                self._stray.popitem(last=False)
        stray.append(outcome)

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
                    raise ResultTimeout(f"no result for task {task_id} within {timeout} s")
                # Wake at least every second to notice a failed publish.
                self._cond.wait(1.0 if remaining is None else min(remaining, 1.0))


def outcome_value(outcome: Outcome, *, propagate: bool) -> Any:
    """A ready state as ``get()`` returns it: the value, else the task's error raised (or returned).

    Shared by the blocking ``AsyncResult.get`` and the asyncio client's results.

    Raises:
        TaskError: (``propagate``) the task failed (also an instance of the remote builtin type).
        TaskRevokedError: (``propagate``) the task was revoked or expired.
        TaskDeclined: (``propagate``) the task was declined for its dedup key (state DECLINED).
    """
    if outcome.status == State.SUCCESS:
        return outcome.result
    error = outcome_error(outcome)
    if propagate:
        raise error
    return error


def outcome_error(outcome: Outcome) -> TaskError:
    """The error a result that is not a value stands for; a DECLINED one is always ``TaskDeclined``."""
    error: TaskError = exception_from_wire(outcome.result, outcome.traceback)
    if outcome.status == State.DECLINED and not isinstance(error, TaskDeclined):
        # The state decides, even if the body's exception map is not the one the gate sends.
        declined = TaskDeclined(*error.args)
        declined.exc_type, declined.exc_module = "TaskDeclined", TaskDeclined.__module__
        declined.remote_traceback = error.remote_traceback
        return declined
    return error


class AsyncResult(OutcomeView, Generic[R]):
    """A handle on one task's result, as in Celery.

    Args:
        task_id: the task id.
        store: the client's result store.
        publish: the pending publish of the task, when this client sent it.
    """

    def __init__(self, task_id: str, *, store: ResultStore, publish: PendingPublish | None = None) -> None:
        self.id = task_id
        # The step before this one in a chain, or a chord's header (Celery's ``result.parent``).
        self.parent: AsyncResult | GroupResult | None = None
        self._store = store
        self._publish = publish
        store.register(task_id)
        self._finalizer = _Release(store, task_id)

    def __del__(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"<AsyncResult: {self.id}>"

    def _latest(self) -> Outcome | None:
        return self._store.latest(self.id)

    @property
    def state(self) -> str:
        """PENDING until the worker reports; then STARTED, PROGRESS, SUCCESS, FAILURE, DECLINED...

        With ``task_states``, a task with no result here yet is answered from the task-state
        stream instead of PENDING: QUEUED, STARTED, ... or UNKNOWN (never seen), even a task
        another process sent.
        """
        outcome = self._latest()
        if outcome is not None:
            return outcome.status
        lookup = self._store.state_lookup
        stream_state = lookup(self.id) if lookup is not None else None
        return stream_state or State.PENDING.value

    status = state

    @property
    def result(self) -> Any:
        """The return value, the exception of a failed, revoked or declined task, or the meta of a
        custom state."""
        outcome = self._store.latest(self.id)
        if outcome is None:
            return None
        if outcome.status in (State.FAILURE, State.REVOKED, State.RETRY, State.DECLINED):
            return outcome_error(outcome)
        return outcome.result

    info = result

    @property
    def traceback(self) -> str | None:
        """The remote traceback of a failed task."""
        outcome = self._store.latest(self.id)
        return outcome.traceback if outcome is not None else None

    @property
    def children(self) -> list[AsyncResult | GroupResult]:
        """The tasks this one sent, once it succeeded (Celery's ``result.children``); [] before.

        The tasks its body sent, then its callbacks and its chain's next step, in that order. Their
        results come to this client when they answer here: a follow-up without its own ``reply_to``
        answers the caller of the task before it; a task sent from a task's body answers the
        worker's app, as with Celery's ``rpc://`` backend.
        """
        outcome = self._store.latest(self.id)
        if outcome is None or not outcome.ready:
            return []
        return [self._from_tuple(child) for child in outcome.children if _is_result_tuple(child)]

    def _from_tuple(self, value: list[Any]) -> AsyncResult | GroupResult:
        # Celery's as_tuple(): ((id, parent), None) for a task, ((id, parent), [members]) for a group.
        (task_id, _parent), members = value
        if isinstance(members, list):
            return GroupResult(task_id, [self._from_tuple(m) for m in members if _is_result_tuple(m)])
        return AsyncResult(task_id, store=self._store)

    @property
    def publish_error(self) -> Exception | None:
        """Why the task could not be published, if it could not."""
        return self._publish.error if self._publish is not None else None

    @overload
    def get(
        self,
        timeout: float | None = None,
        propagate: Literal[True] = True,
        on_message: OnMessage | None = None,
        interval: float = 0.5,
    ) -> R: ...

    @overload
    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        on_message: OnMessage | None = None,
        interval: float = 0.5,
    ) -> R | TaskError: ...

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        on_message: OnMessage | None = None,
        interval: float = 0.5,
    ) -> R | TaskError:
        """Wait for the task to finish and return its value.

        Args:
            timeout: seconds to wait; None waits forever.
            propagate: raise the task's error if it failed, was revoked or declined (else it is
                returned).
            on_message: called with each state's result body, in order, as it arrives.
            interval: accepted for Celery compatibility; results are pushed, not polled.

        Raises:
            ResultTimeout: nothing ready within ``timeout``.
            TaskError: the task failed (also an instance of the remote builtin type).
            TaskRevokedError: the task was revoked or expired.
            TaskDeclined: the task was declined for its dedup key (``dedup_key``); never run.
            PublishError: the task never reached the broker.
        """
        del interval
        if self.parent is not None:
            outcome = self._wait_following_parents(timeout, on_message)
        else:
            outcome = self._store.wait(self.id, timeout=timeout, on_message=on_message, publish=self._publish)
        value: R | TaskError = outcome_value(outcome, propagate=propagate)
        return value

    def _wait_following_parents(self, timeout: float | None, on_message: OnMessage | None) -> Outcome:
        # A chain's step never comes if a step before it failed: that failure is the answer, as
        # Celery's get() raises a failed parent's error.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            node = self.parent
            while isinstance(node, AsyncResult):  # a chord's header fails its body by itself
                latest = self._store.latest(node.id)
                if latest is not None and latest.ready and latest.status != State.SUCCESS:
                    return latest
                node = node.parent
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(f"no result for task {self.id} within {timeout} s")
            step = _PARENT_CHECK_S if remaining is None else min(remaining, _PARENT_CHECK_S)
            try:
                return self._store.wait(self.id, timeout=step, on_message=on_message, publish=self._publish)
            except ResultTimeout:
                continue

    def forget(self) -> None:
        """Drop what this client holds of the result (the rpc backend keeps nothing elsewhere)."""
        self._store.forget(self.id)


class _Release:
    """Releases a result's registration exactly once, at garbage collection."""

    __slots__ = ("_done", "_store", "_task_id")

    def __init__(self, store: ResultStore, task_id: str) -> None:
        self._store, self._task_id, self._done = store, task_id, False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._store.release(self._task_id)


def _is_result_tuple(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) == 2
        and isinstance(value[0], list | tuple)
        and len(value[0]) == 2
        and isinstance(value[0][0], str)
    )
