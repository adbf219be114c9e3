"""The runner's side of an election: serving a term through the hooks, and handing it back.

The runner is the thread calling :meth:`~worker.leader.election.Election.run`. For each term
the keeper starts it calls ``inaugurate``, ``execute`` and ``hand_over`` (``LeaderHooks``), aborts an
atomic ``execute`` when asked (``LeadershipLost`` raised into it), and passes the handover state to
the keeper, which publishes it in a token and releases the queue (``worker/leader/election.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

from broker_svc.errors import LeadershipLost
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from worker.leader.term import LeaderHooks, Term

__all__ = ["TermRunner"]

log = get_logger("worker.leader.election")


class TermRunner:
    """The current term, the hooks that serve it and the runner's handover to the keeper.

    A base of :class:`~worker.leader.election.Election`, which sets the attributes annotated
    here (its role, identity, settings, lease and stop event).
    """

    name: str
    identity: str
    _settings: Settings
    _lease_s: float
    _atomic: bool
    _stop: threading.Event

    def __init__(self, hooks: LeaderHooks) -> None:
        self._hooks = hooks
        self._lock = threading.Lock()
        self._term: Term | None = None
        self._release: tuple[Term, Any] | None = None  # the runner's handover, for the keeper
        self._released = threading.Event()
        self._runner_id: int | None = None
        self._in_hooks = False

    @property
    def term(self) -> Term | None:
        """The current term while this candidate leads (valid or ending), else None."""
        with self._lock:
            return self._term

    def is_leader(self) -> bool:
        """Whether this candidate leads now (its term valid)."""
        term = self.term
        return term is not None and term.still_leader()

    def _serve(self, term: Term) -> None:
        with self._lock:
            self._term = term
        log.info("leader_term_started", role=self.name, epoch=term.epoch, leader=self.identity)
        try:
            try:
                with self._hooks_running():
                    if self._stop.is_set():
                        term.step_down()
                    self._hooks.inaugurate(term)
                    term.guard()
                    if not term.stepping_down:
                        self._hooks.execute(term)
            except LeadershipLost:
                pass
            except Exception:
                log.exception("leader_hook_failed", role=self.name, epoch=term.epoch)
            graceful = term.still_leader()
            state = None
            try:
                state = self._hooks.hand_over(term)
            except Exception:
                log.exception("leader_hand_over_failed", role=self.name, epoch=term.epoch)
            term.end()
            if graceful:
                self._released.clear()
                with self._lock:
                    self._release = (term, state)
                # The keeper publishes the handover token and closes; bounded, as a lost
                # connection makes it give up the handover (the next leader waits out the lease).
                self._released.wait(self._lease_s * 2 + self._settings.connect_timeout_s)
            log.info("leader_term_ended", role=self.name, epoch=term.epoch, handed_over=graceful)
        finally:
            with self._lock:
                self._term = None

    @contextlib.contextmanager
    def _hooks_running(self) -> Iterator[None]:
        with self._lock:
            self._in_hooks = True
        try:
            yield
        finally:
            with self._lock:
                self._in_hooks = False

    def _interrupt(self) -> None:
        # An atomic execute is aborted at once: LeadershipLost raised in the runner thread at its
        # next bytecode (a blocking call returns first; term.wait() wakes on the end anyway).
        with self._lock:
            if self._in_hooks and self._runner_id is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._runner_id), ctypes.py_object(LeadershipLost)
                )

    def _release_asked(self, term: Term | None) -> tuple[Term, Any] | None:
        # The keeper's side of the handover: the runner's (term, state) once it has handed over.
        with self._lock:
            release, self._release = self._release, None
        if release is not None and release[0] is term:
            return release
        return None
