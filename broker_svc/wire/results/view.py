"""What a result handle tells from the newest state its client received: the same for both clients.

The blocking ``AsyncResult`` and the asyncio client's ``AioResult`` differ in how they wait (a
condition, a future) but read a task's state alike; ``OutcomeView`` is that reading, over the
one method each implements (``_latest``). ``ResultsView`` is a group's, over its members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from broker_svc.wire.results.message import Outcome
from broker_svc.wire.task.states import READY_STATES, State

__all__ = ["OutcomeView", "ResultsView"]


class OutcomeView:
    """``task_id``, ``state``, ``ready()``, ``successful()`` and ``failed()`` of one task's result."""

    id: str

    def _latest(self) -> Outcome | None:
        """The newest state received for the task, if any."""
        raise NotImplementedError

    @property
    def task_id(self) -> str:
        """Alias of ``id``."""
        return self.id

    @property
    def state(self) -> str:
        """PENDING until the worker reports; then STARTED, PROGRESS, SUCCESS, FAILURE, DECLINED..."""
        outcome = self._latest()
        return outcome.status if outcome is not None else State.PENDING.value

    def ready(self) -> bool:
        """True once the task succeeded, failed, was revoked or was declined (``READY_STATES``)."""
        return self.state in READY_STATES

    def successful(self) -> bool:
        """True if the task succeeded."""
        return self.state == State.SUCCESS

    def failed(self) -> bool:
        """True if the task failed (FAILURE; a revoked or declined task is not a failure)."""
        return self.state == State.FAILURE


class _Member(Protocol):
    def ready(self) -> bool: ...
    def successful(self) -> bool: ...
    def failed(self) -> bool: ...


class ResultsView:
    """``len()``, ``ready()``, ``successful()`` and ``failed()`` of several results read as one."""

    def _members(self) -> Sequence[_Member]:
        """The results read as one (a group's, in its order)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._members())

    def ready(self) -> bool:
        """Every task has finished (succeeded, failed, was revoked or declined)."""
        return all(r.ready() for r in self._members())

    def successful(self) -> bool:
        """Every task succeeded."""
        return all(r.successful() for r in self._members())

    def failed(self) -> bool:
        """At least one task failed."""
        return any(r.failed() for r in self._members())
