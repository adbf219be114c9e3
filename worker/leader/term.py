"""A leader's term, its lease and guard, and the three hooks a leader implements."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from broker_svc.errors import LeadershipLost

__all__ = ["LeaderHooks", "Term"]


class Term:
    """One term of leadership: what the hooks are given, and the guard every action checks.

    A term is valid while its lease runs: the lease ends ``lease_s`` after the leader sent its
    latest token that has come back to it (the broker delivers only to the active consumer, so a
    token coming back proves the leader was still the active one when it sent it). A leader frozen,
    cut off or disconnected stops being renewed, and its term ends when the lease runs out — by its
    own monotonic clock, with no word from the broker needed. The next leader starts only once that
    lease must have run out (or the term was handed over), so **check :meth:`still_leader` or
    :meth:`guard` right before each action**, and attach :attr:`epoch` to actions whose receiver can
    reject an older epoch than one it has seen (a fencing token).

    Attributes:
        epoch: the term's number; every new term has a higher one than every term before it.
        leader: the identity of this candidate.
        previous_epoch: the epoch of the term before (0 if none).
        previous_handed_over: the term before ended by a handover (else it was lost, or none).
        handover_state: what the previous leader's ``hand_over()`` returned (None if none).
        started_at: wall-clock time (``time.time()``) the term began.
    """

    def __init__(
        self,
        *,
        epoch: int,
        leader: str,
        lease_end: float,
        previous_epoch: int = 0,
        previous_handed_over: bool = False,
        handover_state: Any = None,
    ) -> None:
        self.epoch = epoch
        self.leader = leader
        self.previous_epoch = previous_epoch
        self.previous_handed_over = previous_handed_over
        self.handover_state = handover_state
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._lease_end = lease_end  # time.monotonic() at which the lease runs out
        self._ended_mono: float | None = None
        self._changed = threading.Condition(self._lock)
        self._stepping_down = False

    # -- for the hooks -----------------------------------------------------------------------------

    def still_leader(self) -> bool:
        """Whether this term is still valid now: not ended, and its lease not run out."""
        with self._lock:
            return self._valid(time.monotonic())

    def guard(self) -> None:
        """Raise unless this term is still valid; call it right before each action.

        Raises:
            LeadershipLost: the lease ran out, or the term ended.
        """
        if not self.still_leader():
            raise LeadershipLost(f"term {self.epoch} of {self.leader} is over")

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking early when the term ends or is asked to step down.

        Returns:
            True while the leader should go on: the term is valid and no step-down was asked.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                now = time.monotonic()
                if not self._valid(now) or self._stepping_down:
                    return False
                if now >= deadline:
                    return True
                self._changed.wait(min(deadline, self._lease_end) - now)

    @property
    def stepping_down(self) -> bool:
        """A graceful step-down was asked (SIGTERM, ``Election.stop``): finish and return."""
        with self._lock:
            return self._stepping_down

    @property
    def lease_remaining_s(self) -> float:
        """Seconds until the lease runs out unless renewed (0 once the term is over)."""
        with self._lock:
            now = time.monotonic()
            return max(0.0, self._lease_end - now) if self._valid(now) else 0.0

    @property
    def ended_at(self) -> float | None:
        """Wall-clock time the term ended (its lease ran out, or it stepped down); None while valid.

        A lease that ran out unnoticed (the process was frozen) ended when it ran out, not when
        this is read.
        """
        with self._lock:
            now = time.monotonic()
            if self._ended_mono is None and now < self._lease_end:
                return None
            end = self._lease_end if self._ended_mono is None else min(self._ended_mono, self._lease_end)
            return time.time() - (now - end)

    # -- for the election --------------------------------------------------------------------------

    def _valid(self, now: float) -> bool:
        return self._ended_mono is None and now < self._lease_end

    def renew(self, lease_end: float) -> None:
        """Extend the lease to ``lease_end`` (monotonic); never shortens it, never revives a term."""
        with self._changed:
            if self._ended_mono is None and time.monotonic() < self._lease_end:
                self._lease_end = max(self._lease_end, lease_end)

    def step_down(self) -> None:
        """Ask the leader to finish (a non-atomic ``execute()`` returns at its next ``wait``)."""
        with self._changed:
            self._stepping_down = True
            self._changed.notify_all()

    def end(self) -> None:
        """End the term now (or when its lease ran out, if earlier)."""
        with self._changed:
            if self._ended_mono is None:
                self._ended_mono = min(time.monotonic(), self._lease_end)
            self._changed.notify_all()

    def __repr__(self) -> str:
        return f"Term(epoch={self.epoch}, leader={self.leader!r}, valid={self.still_leader()})"


class LeaderHooks(Protocol):
    """What a leader does; the election calls these on its runner thread, one term at a time."""

    def inaugurate(self, term: Term) -> None:
        """Became the leader. The election has already waited for the previous leader's handover
        (or for its lease to run out): ``term.previous_handed_over`` and ``term.handover_state``
        say which, and what it handed over. Prepare here; act in ``execute``."""

    def execute(self, term: Term) -> None:
        """The leader's work, for as long as it leads. Check ``term.guard()`` before each action;
        wait with ``term.wait()``, which returns False when it must stop (term over, or a step-down
        asked). Returning steps down (hand over, then stand again as a candidate)."""

    def hand_over(self, term: Term) -> Any:
        """The term ends. When ``term.still_leader()``, a graceful step-down: return JSON state for
        the next leader's ``inaugurate`` (or None). Otherwise the term was lost (nothing is handed
        over): clean up only, and act no more."""
