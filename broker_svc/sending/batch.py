"""``with app.batch():`` — the tasks a thread sends inside the block go out together at its end.

Inside the block ``delay``, ``apply_async``, ``send_task`` and ``send_many`` prepare their tasks
(encoded, size-checked, each with its result) and keep them. At the end of the block they are
handed over in one piece with one wait: without a spool, for the broker's confirms of all of
them; with one, for one write (and fsync) of all of them to the spool file. An exception in the
block sends none of them. Batches are per thread; one inside another adds its tasks to the
outer one (its results and its end).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import PublishError, SpoolError
from broker_svc.results.result import AsyncResult

__all__ = ["Batch", "BatchScope"]


class Batch:
    """Tasks kept by ``with app.batch() as batch:`` until the block ends.

    Attributes:
        results: the result of each task sent in the block, in order.
    """

    def __init__(self, scope: BatchScope, submit: Callable[[Sequence[PendingPublish]], None]) -> None:
        self._scope = scope
        self._submit = submit
        self._outer: Batch | None = None
        self._pending: list[PendingPublish] = []
        self.results: list[AsyncResult] = []

    def __len__(self) -> int:
        return len(self._pending)

    def keep(self, pending: Sequence[PendingPublish], results: Sequence[AsyncResult]) -> None:
        """Keep prepared tasks until the block ends."""
        self._pending.extend(pending)
        self.results.extend(results)

    def __enter__(self) -> Batch:
        self._outer = self._scope.current
        self._scope.current = self._outer or self
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Send the batch in one piece and wait once (see the module docstring).

        Raises:
            SpoolFull, SpoolError: (spool) none of the batch was accepted.
            PublishError: (no spool) a task of the batch was not confirmed.
        """
        self._scope.current = self._outer
        if self._outer is not None:
            return  # its tasks went to the outer batch, which sends them
        pending, self._pending = self._pending, []
        if exc_type is not None:
            abandoned = PublishError(f"not sent: the batch ended with {exc_type.__name__}")
            for item in pending:
                item.settle(abandoned)  # their results raise instead of waiting forever
            return
        if not pending:
            return
        try:
            self._submit(pending)
        except SpoolError as error:  # the spool took none of them: their results say so
            for item in pending:
                item.settle(error)
            raise


class BatchScope(threading.local):
    """The batch open on this thread, if any (one per app)."""

    current: Batch | None = None
