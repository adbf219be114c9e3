"""Revokes that hold: the worker's revoked set, its state file, and terminating running tasks.

A revoke reaches a worker three ways, and each one ends in ``Revoker``: the ``revoke`` control
command (broadcast), the revocation log on the broker (worker.remote.revocation_log), and Mingle
(peers' revoked sets at start-up). The set is saved to a state file shortly after it changes and
when the worker stops, so a restarted worker remembers even without the broker's log.

Stamps revoked by ``revoke_by_stamped_headers`` are kept beside the ids, as Celery keeps them: for
the worker's life, in memory; a worker that starts later learns them from the revocation log
(neither Celery's Mingle nor its state file carries them).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from control.protocol.request import ok
from worker.remote.revoked_set import RevokedSet
from worker.rules.revoked_stamps import RevokedStamps

__all__ = ["Revoker", "parse_signal"]

log = structlog.get_logger(__name__)

# Changes are written at most this often (and always at stop): a burst of revokes is one write.
_SAVE_DELAY_S: Final = 0.5
# Ids this worker terminated, remembered this long for the revoke that asks again: a ``ctl revoke
# --terminate`` reaches the worker twice, through the revocation log and the mailbox, and the
# first to arrive does the killing.
_TERMINATED_MEMORY_S: Final = 300.0
_TERMINATED_MAX: Final = 1000


def parse_signal(value: str | int | None) -> signal.Signals:
    """A signal from Celery's spellings: ``SIGKILL``, ``KILL``, ``9``; default SIGTERM.

    Raises:
        ValueError: not a signal this platform knows.
    """
    if value is None or value == "":
        return signal.SIGTERM
    if isinstance(value, int) and not isinstance(value, bool):
        return signal.Signals(value)
    text = str(value).strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    name = text if text.startswith("SIG") else f"SIG{text}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {value!r}") from None


class Revoker:
    """Owns the worker's revoked set.

    Args:
        revoked: the set (shared with the ``revoked`` and ``hello`` commands).
        terminate: signals the child running a task; True if it ran here.
        state_path: the state file, or None to keep the set in memory only.
        on_new: called with ids that were not revoked before (consuming children learn them).
        known: waits, bounded, until the consuming children have applied what ``on_new`` told
            them; a revoke command replies after it.
        on_new_stamps: called with stamp values not revoked before (the children learn them).
        running_stamps: each running task's id and stamps (to terminate those a revoke matches).
    """

    def __init__(
        self,
        revoked: RevokedSet,
        *,
        terminate: Callable[[str, int], Awaitable[bool]],
        state_path: Path | None,
        on_new: Callable[[list[str]], None] | None = None,
        known: Callable[[], Awaitable[object]] | None = None,
        on_new_stamps: Callable[[dict[str, list[Any]]], None] | None = None,
        running_stamps: Callable[[], Sequence[tuple[str, Mapping[str, Any]]]] | None = None,
    ) -> None:
        self._revoked = revoked
        self._stamps = RevokedStamps()
        self._on_new_stamps = on_new_stamps
        self._running_stamps = running_stamps
        self._on_new = on_new
        self._known = known
        self._terminate = terminate
        self._state_path = state_path
        self._save_handle: asyncio.TimerHandle | None = None
        self._terminated: dict[str, float] = {}  # id -> when this worker signalled its child
        self._terminated_stamps: dict[str, Mapping[str, Any]] = {}  # id -> its stamps, if stamped

    @property
    def revoked(self) -> RevokedSet:
        """The revoked set."""
        return self._revoked

    @property
    def revoked_stamps(self) -> RevokedStamps:
        """The stamp values revoked so far."""
        return self._stamps

    def load(self) -> int:
        """Read the state file (before consuming): how many unexpired ids it held."""
        if self._state_path is None:
            return 0
        loaded = self._revoked.load(self._state_path)
        if loaded:
            log.info("revoked_state_loaded", path=str(self._state_path), ids=loaded)
        return loaded

    def save(self) -> None:
        """Write the state file now (at stop); errors are logged."""
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
        if self._state_path is None:
            return
        try:
            self._revoked.save(self._state_path)
        except OSError as exc:
            log.error("revoked_state_not_saved", path=str(self._state_path), error=str(exc))

    def _changed(self) -> None:
        if self._state_path is not None and self._save_handle is None:
            self._save_handle = asyncio.get_running_loop().call_later(_SAVE_DELAY_S, self.save)

    def add(self, task_ids: Iterable[str], *, age_s: float = 0.0) -> int:
        """Revoke ids without terminating; ``age_s`` back-dates them (a log entry's age).

        Returns:
            How many ids were not revoked before.
        """
        at = time.monotonic() - max(0.0, age_s)
        new: list[str] = []
        for task_id in task_ids:
            if task_id not in self._revoked:
                new.append(task_id)
            self._revoked.add(task_id, at=at)
        if new:
            self._changed()
            if self._on_new is not None:
                self._on_new(new)
        return len(new)

    def merge_peer(self, data: Any) -> int:
        """Merge a peer's revoked set (Mingle); returns how many ids were new."""
        new = self._revoked.merge_wire(data)
        if new:
            self._changed()
            if self._on_new is not None:
                self._on_new(list(self._revoked))
        return new

    async def revoke(
        self, task_ids: list[str], *, terminate: bool, signal_name: str | int | None
    ) -> dict[str, Any]:
        """Revoke ids, and with ``terminate`` signal the children running them. Celery's replies."""
        sig = parse_signal(signal_name) if terminate else None
        self.add(task_ids)
        if self._known is not None:
            # Even when nothing was new: the same revoke may have come first through the log, and
            # its frame to the children is what this reply must wait for.
            await self._known()  # the children skip these ids before anyone learns they are revoked
        if sig is None:
            return ok(f"tasks {_set_repr(task_ids)} flagged as revoked")
        terminated = [task_id for task_id in task_ids if await self._terminated_here(task_id, sig)]
        if terminated:
            return ok(f"terminate: {', '.join(terminated)}")
        return ok("terminate: tasks unknown")

    def add_stamps(self, headers: Mapping[str, list[Any]]) -> int:
        """Revoke stamp values without terminating; how many were not revoked before."""
        new = self._stamps.add(headers)
        if new and self._on_new_stamps is not None:
            self._on_new_stamps(new)
        return sum(len(values) for values in new.values())

    async def revoke_stamps(
        self, headers: Mapping[str, list[Any]], *, terminate: bool, signal_name: str | int | None, shown: Any
    ) -> dict[str, Any]:
        """Revoke stamp values, and with ``terminate`` signal the children running tasks they match.

        Celery's replies, ``shown`` being the ``headers`` the command was given.
        """
        sig = parse_signal(signal_name) if terminate else None
        self.add_stamps(headers)
        if self._known is not None:
            await self._known()  # the children skip matching tasks before anyone learns of the revoke
        if sig is None:
            return ok(f"headers {shown!r} flagged as revoked, but not terminated")
        ended = await self.terminate_stamped(headers, sig)
        if not ended:
            return ok(f"headers {shown!r} were not terminated")
        return ok(f"headers {ended!r} revoked")

    async def terminate_stamped(
        self, headers: Mapping[str, list[Any]], sig: signal.Signals
    ) -> dict[str, set[Any]]:
        """Signal the children running tasks that ``headers`` (only) matches; the matched values.

        As Celery's: the running tasks are matched by this revoke's stamps, not by every stamp
        revoked before.
        """
        wanted = RevokedStamps.of(headers)
        matched: dict[str, set[Any]] = {}
        running = list(self._running_stamps()) if self._running_stamps is not None else []
        # A task this worker ended a moment ago for the other copy of this revoke (the broadcast
        # and the log) may be off the board already: it was terminated all the same.
        shown = {task_id for task_id, _ in running}
        now = time.monotonic()
        recent = [
            (task_id, stamps) for task_id, stamps in self._terminated_stamps.items()
            if task_id not in shown and now - self._terminated.get(task_id, 0.0) < _TERMINATED_MEMORY_S
        ]  # fmt: skip
        for task_id, stamps in [*running, *recent]:
            hits = wanted.all_matching(stamps)
            if hits and await self._terminated_here(task_id, sig, stamps):
                for name, value in hits:
                    matched.setdefault(name, set()).add(value)
        return matched

    async def _terminated_here(
        self, task_id: str, sig: signal.Signals, stamps: Mapping[str, Any] | None = None
    ) -> bool:
        # Signal the child running it; or it was already, by the other copy of the same revoke.
        # The copy that comes second must not signal again: the child may still show the task
        # while the first signal takes effect, and a second one would be logged (and sent) twice.
        now = time.monotonic()
        at = self._terminated.get(task_id)
        if at is not None and now - at < _TERMINATED_MEMORY_S:
            return True
        if await self._terminate(task_id, sig):
            log.info("tasks_terminated", task_ids=[task_id], signal=sig.name)
            self._terminated[task_id] = now
            if stamps:
                self._terminated_stamps[task_id] = stamps
            while len(self._terminated) > _TERMINATED_MAX:
                self._terminated_stamps.pop(next(iter(self._terminated)), None)
                del self._terminated[next(iter(self._terminated))]
            return True
        return False


def _set_repr(task_ids: list[str]) -> str:
    return "{" + ", ".join(repr(t) for t in task_ids) + "}"
