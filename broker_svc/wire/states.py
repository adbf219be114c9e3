"""Task states, with Celery's names."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["READY_STATES", "State"]


class State(StrEnum):
    """The state of a task as results and events report it."""

    PENDING = "PENDING"
    RECEIVED = "RECEIVED"
    STARTED = "STARTED"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    RETRY = "RETRY"
    REVOKED = "REVOKED"
    REJECTED = "REJECTED"


READY_STATES = frozenset({State.SUCCESS, State.FAILURE, State.REVOKED})
