"""``GroupResult`` and ``ResultSet``: the results of many tasks, read as one (Celery's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.errors import ResultTimeout
from broker_svc.wire.result_view import ResultsView

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.results.result import AsyncResult

__all__ = ["GroupResult", "ResultSet"]


class ResultSet(ResultsView):
    """Several results (each an ``AsyncResult`` or a nested ``GroupResult``), waited on together."""

    def __init__(self, results: Sequence[AsyncResult | ResultSet], *, app: App | None = None) -> None:
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
        self, id: str, results: Sequence[AsyncResult | ResultSet], *, app: App | None = None
    ) -> None:
        super().__init__(results, app=app)
        self.id = id

    def __repr__(self) -> str:
        return f"<GroupResult: {self.id} [{', '.join(getattr(r, 'id', '?') for r in self.results)}]>"

    @property
    def children(self) -> list[AsyncResult | ResultSet]:
        """The member results (Celery's name)."""
        return self.results
