"""``app.backend``: Celery's result-backend calls (save, restore and delete a group; store a state).

With ``result_backend="redis://..."`` they read and write Redis in Celery's format
(``broker_svc/redis_results/``), so a group saved here is restored by a Celery client and the
other way round. On ``rpc://`` (the default) results travel to their sender's reply queue and
nothing is kept elsewhere: there is no place to save a group or another task's state, and these
calls raise ``NotImplementedError`` saying so, as Celery's rpc backend refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from broker_svc.results.result import AsyncResult, GroupResult, result_from_tuple
from broker_svc.results.store import ResultSource
from broker_svc.wire.results.message import Outcome, exception_to_wire
from broker_svc.wire.results.meta import result_meta
from broker_svc.wire.task.states import State

__all__ = ["ResultBackend"]


class _ResultHandles(Protocol):
    """What restoring a group makes its members with (an app's ``AsyncResult``)."""

    def AsyncResult(self, task_id: str) -> AsyncResult: ...  # Celery's name


class ResultBackend:
    """The result-backend calls of one app (``app.backend``), as Celery names them.

    Args:
        source: the app's Redis results, or None on ``rpc://``.
        app: the app whose ``AsyncResult`` handles a restored group holds.
    """

    def __init__(self, source: Callable[[], ResultSource | None], app: _ResultHandles) -> None:
        self._source = source
        self._app = app

    def save_group(self, group_id: str, result: GroupResult) -> GroupResult:
        """Store ``result`` (its ids, nested) under ``group_id``; ``GroupResult.restore`` reads it.

        Raises:
            NotImplementedError: on ``rpc://``.
            ResultBackendUnavailable: Redis could not be reached.
        """
        self._required("save a group").save_group(group_id, result.as_tuple())
        return result

    def restore_group(self, group_id: str) -> GroupResult | None:
        """The group saved under ``group_id``, with a handle per member; None if none was saved.

        Raises:
            NotImplementedError: on ``rpc://``.
            ResultBackendUnavailable: Redis could not be reached.
        """
        value = self._required("restore a group").restore_group(group_id)
        if value is None:
            return None
        restored = result_from_tuple(value, self._app)
        return restored if isinstance(restored, GroupResult) else None

    def delete_group(self, group_id: str) -> None:
        """Delete the group saved under ``group_id``.

        Raises:
            NotImplementedError: on ``rpc://``.
            ResultBackendUnavailable: Redis could not be reached.
        """
        self._required("delete a group").delete_group(group_id)

    def add_to_chord(self, group_id: str, result: AsyncResult) -> None:
        """Count ``result``'s task in the Redis-counted chord ``group_id`` (Celery's ``add_to_chord``;
        ``Task.add_to_chord`` calls it). A chord joined on RabbitMQ grows through its join queue.

        Raises:
            NotImplementedError: on ``rpc://``.
            ResultBackendUnavailable: Redis could not be reached.
        """
        self._required("add a task to a chord counted in Redis").add_to_chord(group_id)

    def store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: str | None = None,
        request: Any = None,
        **_: Any,
    ) -> Any:
        """Store ``state`` of any task, this process's or another's (Celery's ``store_result``); an
        exception ``result`` is stored as Celery's exception map. Returns ``result``.

        Raises:
            NotImplementedError: on ``rpc://``.
            ValueError: an unknown state.
            ResultBackendUnavailable: Redis could not be reached.
        """
        source = self._required("store another task's state")
        value = exception_to_wire(result) if isinstance(result, BaseException) else result
        outcome = Outcome(task_id=task_id, status=State(state).value, result=value, traceback=traceback)
        group_id = getattr(request, "group", None)
        parent_id = getattr(request, "parent_id", None)
        source.store(result_meta(outcome, group_id=group_id, parent_id=parent_id, extended=None))
        return result

    def _required(self, what: str) -> ResultSource:
        source = self._source()
        if source is None:
            raise NotImplementedError(
                f"cannot {what} on rpc:// results: they travel to their sender's reply queue and nothing "
                "keeps them elsewhere; set result_backend='redis://...' (docs/guide.md, 'Results')"
            )
        return source
