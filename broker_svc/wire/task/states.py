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
    # Clockwork's own: not run, as another call with its dedup key was running and one waiting
    # (``TaskDeclined``). Only Clockwork's gate sends it, to clients that sent a dedup key.
    DECLINED = "DECLINED"


# The states after which nothing more happens to a task: its result is in.
READY_STATES = frozenset({State.SUCCESS, State.FAILURE, State.REVOKED, State.DECLINED})
