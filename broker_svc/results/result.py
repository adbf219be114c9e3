"""Result handles, as Celery's: ``AsyncResult`` for one task, ``GroupResult`` and ``ResultSet`` for
many, read from the client's ``rpc://`` reply queue (``broker_svc/results/store.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Generic, Literal, Protocol, overload

from typing_extensions import TypeVar

from broker_svc.apps import open_apps
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import ConfigurationError, ResultTimeout, TaskDeclined, TaskError
from broker_svc.results.store import OnMessage, ResultStore
from broker_svc.wire.results.message import Outcome, exception_from_wire
from broker_svc.wire.results.view import OutcomeView, ResultsView
from broker_svc.wire.task.states import State

__all__ = ["AsyncResult", "GroupResult", "ResultSet", "outcome_error", "outcome_value", "result_from_tuple"]

# What the task returns (``AsyncResult[int]`` for ``def add(...) -> int``); Any when unknown.
R = TypeVar("R", default=Any)

# How often a chain's result looks at its earlier steps while it waits.
_PARENT_CHECK_S: Final = 0.2


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


class _HandleMaker(Protocol):
    """What ``AsyncResult(task_id, app=app)`` needs of an app (an ``App``)."""

    def AsyncResult(self, task_id: str) -> AsyncResult[Any]: ...


class AsyncResult(OutcomeView, Generic[R]):
    """A handle on one task's result, as in Celery.

    ``AsyncResult(task_id)`` alone, as in Celery, reads the results of the current app (``app``
    if given): the last one made, or made current (``broker_svc/apps/open_apps.py``). It is then
    ``app.AsyncResult(task_id)``: results of the tasks that app sent, or of any task with a Redis
    result backend.

    Args:
        task_id: the task id.
        store: the client's result store (None: the app's).
        publish: the pending publish of the task, when this client sent it.
        app: whose results, without ``store`` (None: the current app).

    Raises:
        ConfigurationError: neither ``store`` nor ``app``, and no app has been made.
    """

    def __init__(
        self,
        task_id: str,
        *,
        store: ResultStore | None = None,
        publish: PendingPublish | None = None,
        app: _HandleMaker | None = None,
    ) -> None:
        if store is None:
            # The app's own handle says which store (its result queue's; a capture's in AsyncApp).
            handle = (app if app is not None else _current_app("AsyncResult(task_id)")).AsyncResult(task_id)
            store, publish = handle._store, publish or handle._publish
        self.id = task_id
        # The step before this one in a chain, or a chord's header (Celery's ``result.parent``).
        self.parent: AsyncResult | GroupResult | None = None
        self._store: ResultStore = store
        self._publish: PendingPublish | None = publish
        store.register(task_id)
        self._finalizer = _Release(store, task_id)

    def __del__(self) -> None:
        finalizer = getattr(self, "_finalizer", None)  # None: __init__ raised (no app to read)
        if finalizer is not None:
            finalizer()

    def __repr__(self) -> str:
        return f"<AsyncResult: {self.id}>"

    def as_tuple(self) -> tuple[Any, None]:
        """Celery's ``((id, parent), None)``: what a saved group or ``children`` hold of it."""
        return ((self.id, self.parent.as_tuple() if self.parent is not None else None), None)

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

    def revoke(
        self,
        connection: object = None,
        terminate: bool = False,
        signal: str | int | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Revoke the task, as Celery's ``AsyncResult.revoke``: ``app.control.revoke(self.id, ...)``.

        Durable, as every revoke here: a worker that starts later skips the task too. With
        ``terminate``, a running task is ended with ``signal`` (default SIGTERM) and answered
        REVOKED ``terminated``; without, a running task runs on, and one not started never does.

        Args:
            connection: accepted for Celery's signature; the app's own connection is used.
            terminate: also end the task if it is running.
            signal: the signal for ``terminate`` (a name like ``"SIGKILL"`` or a number).
            wait: wait for the workers' replies (at most ``timeout``).
            timeout: seconds to wait for replies (default 1).

        Raises:
            ConfigurationError: this handle has no app to revoke through (a placeholder result).
            BrokerUnavailable: the broker cannot be reached.
        """
        del connection
        revoke = self._store.revoke
        if revoke is None:
            raise ConfigurationError(f"no app to revoke task {self.id} through: use app.control.revoke")
        revoke(
            self.id,
            terminate=terminate,
            signal=signal if signal is not None else "SIGTERM",
            reply=wait,
            timeout=timeout if timeout is not None else 1.0,
        )

    def forget(self) -> None:
        """Drop what this client holds of the result, and with a Redis backend its stored key (as
        Celery's ``forget``; the rpc backend keeps nothing elsewhere).

        Raises:
            ResultBackendUnavailable: the Redis backend could not be reached.
        """
        self._store.forget(self.id)


class ResultSet(ResultsView):
    """Several results (each an ``AsyncResult`` or a nested ``GroupResult``), waited on together.

    ``app`` is the app that sent them, kept as Celery's is for code that passes or reads it; results
    come to the client's reply queue, so nothing here uses it. It is an ``object`` because the app's
    Protocol (``broker_svc/tasks/task_app.py``) names ``AsyncResult``, and so sits above this module.
    """

    def __init__(self, results: Sequence[AsyncResult | ResultSet], *, app: object | None = None) -> None:
        self.results = list(results)
        self.app = app

    def __iter__(self) -> Iterator[AsyncResult | ResultSet]:
        return iter(self.results)

    def _members(self) -> Sequence[Any]:
        return self.results

    def waiting(self) -> bool:
        """At least one task has not finished."""
        return not self.ready()

    def completed_count(self) -> int:
        """How many tasks succeeded."""
        return sum(1 for r in self.results if r.successful())

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        on_message: Callable[[dict[str, Any]], None] | None = None,
        interval: float = 0.5,
    ) -> list[Any]:
        """Each task's value, in order (``join``)."""
        return self.join(timeout=timeout, propagate=propagate, on_message=on_message, interval=interval)

    def join(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        on_message: Callable[[dict[str, Any]], None] | None = None,
        interval: float = 0.5,
    ) -> list[Any]:
        """Wait for every task, in order, within one ``timeout`` for all; their values.

        Raises:
            ResultTimeout: not all finished within ``timeout``.
            TaskError: (``propagate``) the first failed task's error, in the group's order.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        values: list[Any] = []
        for result in self.results:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(f"the group did not finish within {timeout} s")
            values.append(result.get(timeout=remaining, propagate=propagate, on_message=on_message))
        return values

    def forget(self) -> None:
        """Drop what this client holds of every result."""
        for result in self.results:
            result.forget()


class GroupResult(ResultSet):
    """The results of a ``group``, with the group's id."""

    def __init__(
        self, id: str, results: Sequence[AsyncResult | ResultSet], *, app: object | None = None
    ) -> None:
        super().__init__(results, app=app)
        self.id = id

    def __repr__(self) -> str:
        return f"<GroupResult: {self.id} [{', '.join(getattr(r, 'id', '?') for r in self.results)}]>"

    def as_tuple(self) -> tuple[Any, list[Any]]:
        """Celery's ``((id, None), [member tuples])``, nested groups as groups."""
        members = [r.as_tuple() for r in self.results if isinstance(r, AsyncResult | GroupResult)]
        return ((self.id, None), members)

    def save(self, backend: Any = None) -> GroupResult:
        """Save it in the app's result backend (without an app, the current app's), so
        ``GroupResult.restore(id)`` in any process gets it back (Celery's; Redis results:
        ``celery-taskset-meta-<id>``).

        Raises:
            NotImplementedError: the app's results are ``rpc://``.
            ConfigurationError: no ``backend``, no app, and no app has been made.
        """
        saved: GroupResult = (backend or _backend_of(self.app, call="save()")).save_group(self.id, self)
        return saved

    def delete(self, backend: Any = None) -> None:
        """Delete it from the app's result backend (Celery's; without an app, the current app's).

        Raises:
            NotImplementedError: the app's results are ``rpc://``.
            ConfigurationError: no ``backend``, no app, and no app has been made.
        """
        (backend or _backend_of(self.app, call="delete()")).delete_group(self.id)

    @classmethod
    def restore(cls, id: str, backend: Any = None, app: object | None = None) -> GroupResult | None:
        """The group saved under ``id`` (by this process or any other, Celery's client included),
        or None. It reads the ``backend`` given, else ``app``'s, else, as Celery does, the current
        app's: the last one made, or made current (``broker_svc/apps/open_apps.py``).

        Raises:
            NotImplementedError: the app's results are ``rpc://``.
            ConfigurationError: neither ``backend`` nor ``app``, and no app has been made.
        """
        backend = backend or _backend_of(app, call="GroupResult.restore(id)")
        restored: GroupResult | None = backend.restore_group(id)
        return restored

    @property
    def children(self) -> list[AsyncResult | ResultSet]:
        """The member results (Celery's name)."""
        return self.results


class _Release:
    """Releases a result's registration exactly once, at garbage collection."""

    __slots__ = ("_done", "_store", "_task_id")

    def __init__(self, store: ResultStore, task_id: str) -> None:
        self._store, self._task_id, self._done = store, task_id, False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._store.release(self._task_id)


def _current_app(call: str) -> Any:
    # An ``App``: typed as one by ``task_app.current_app``, which this module cannot import (the
    # task app's Protocol names this module's ``AsyncResult``).
    app = open_apps.current()
    if app is None:
        raise ConfigurationError(
            f"{call}: no App has been created in this process to read results with; "
            "create one (app = App('proj', backend=...)) or pass app="
        )
    return app


def _backend_of(app: object | None, *, call: str) -> Any:
    # ``app.backend`` (``broker_svc/results/backend.py``, which imports this module); no app: the
    # current one, as Celery's ``self.app`` defaults to ``current_app``.
    backend = getattr(app if app is not None else _current_app(call), "backend", None)
    if backend is None:
        raise TypeError(f"{app!r} has no result backend (app.backend): pass backend= or app=")
    return backend


def result_from_tuple(value: Any, app: Any) -> AsyncResult | GroupResult:
    """A handle from Celery's ``as_tuple()`` form, its members' made by ``app.AsyncResult``.

    Raises:
        ValueError: not a result tuple.
    """
    if not _is_result_tuple(value):
        raise ValueError(f"not a result tuple: {value!r}")
    (task_id, parent), members = value
    if isinstance(members, list | tuple):
        return GroupResult(task_id, [result_from_tuple(m, app) for m in members], app=app)
    handle: AsyncResult = app.AsyncResult(task_id)
    if parent is not None and _is_result_tuple(parent):
        handle.parent = result_from_tuple(parent, app)
    return handle


def _is_result_tuple(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) == 2
        and isinstance(value[0], list | tuple)
        and len(value[0]) == 2
        and isinstance(value[0][0], str)
    )
