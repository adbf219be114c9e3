"""The periodic scheduler: any number of instances stand for election, and only the leader fires.

``Beat(app)`` fires the entries of ``app.conf.beat_schedule`` (and those added at runtime) for as
long as it leads the role ``beat.<name>`` (``worker/leader/``). Why a fire is never doubled
nor lost across a failover:

- **One publish.** A fire goes to its task queue and to the scheduler's journal stream in one
  publish (the journal is the message's ``BCC``), so a fire the broker took is in the journal.
- **A new leader reads the journal** (``inaugurate``): the latest snapshot, then every record
  after it, up to now; it fires only scheduled times after the last one fired (``due_times``,
  with the entry's catch-up policy for times missed while no one led).
- **Fenced at the broker:** each term fires through an exchange of its own, which the next leader
  deletes before reading the journal, so a late publish from a leader that lost its term (frozen
  between its lease check and its publish) is refused; and every publish comes right after
  ``term.guard()``.
- **Sent once** (``worker/beat/firing.py``): a fire whose confirm was lost is not resent; the
  journal, read again first, says whether it got through.
- **Deterministic ids** (``fire_id``: entry and scheduled instant): a run of an entry at a time has
  one task id, whoever fired it.

Fired tasks answer to the journal (``reply_to``), which is how ``overlap="skip"`` learns that a
run finished. See docs/guide.md, "Periodic tasks".
"""

from __future__ import annotations

import heapq
import platform
import queue
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from broker_svc.errors import BrokerSvcError
from broker_svc.logging import get_logger
from broker_svc.schedules import Entry, due_times, next_due, parse_beat_schedule
from broker_svc.schedules.journal_record import Change
from broker_svc.schedules.state import BeatState
from broker_svc.topology import beat_term_exchange
from worker.beat.firing import Firing

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.connection.beat_journal import Journal, JournalFollower
    from worker.leader import Election, Term

__all__ = ["Beat"]

log = get_logger("broker_svc.beat")

_POLL_S: Final = 0.25  # how soon a change or an answer read from the journal takes effect


class Beat(Firing):
    """A scheduler instance. Start as many as you like (in workers with ``-B``, or
    ``clockwork-beat``); the one elected leader fires.

    Args:
        app: sends the tasks (its routes and settings apply), and gives ``beat_schedule`` and
            ``timezone`` from ``app.conf``.
        name: the scheduler; instances of one name share a leader, a journal and a schedule.
        entries: the configured entries (default: ``app.conf.beat_schedule``).
        lease_s: the leader's lease (failover is about the broker noticing a dead leader plus this).
        grace_s: how late a fire may be and still count as on time (``catch_up="skip"``).
        overlap_timeout_s: an ``overlap="skip"`` entry's run that has not answered after this long
            counts as over (it may ignore its result, or its answer may be lost).
        snapshot_interval_s: how often the leader saves its state.

    Raises:
        ValueError: ``beat_schedule`` or an entry is invalid.
    """

    def __init__(
        self,
        app: App,
        *,
        name: str = "default",
        entries: Sequence[Entry] | None = None,
        lease_s: float = 10.0,
        grace_s: float = 1.0,
        overlap_timeout_s: float = 3600.0,
        snapshot_interval_s: float = 60.0,
    ) -> None:
        from broker_svc.connection.beat_journal import Journal
        from worker.beat.event_sender import EventSender
        from worker.leader import Election

        super().__init__(app)
        self.app = app
        self.name = name
        if entries is None:
            schedule = app.conf.get("beat_schedule") or {}
            entries = parse_beat_schedule(schedule, timezone=app.conf.get("timezone"))
        self.configured: list[Entry] = list(entries)
        self._grace_s = grace_s
        self._overlap_timeout_s = overlap_timeout_s
        self._snapshot_interval_s = snapshot_interval_s
        self.journal: Journal = Journal(app.settings, name)
        self.election: Election = Election(app.settings, name=f"beat.{name}", hooks=self, lease_s=lease_s)
        self.state = BeatState()
        self._offset = -1
        self._follower: JournalFollower | None = None
        # Celery events (``celeryev``) for Flower-style tools: beat-leading, beat-fired,
        # beat-skipped, beat-schedule-changed, beat-stepped-down.
        self.events = EventSender(app.settings, hostname=f"beat.{name}@{platform.node()}", clock=app.clock)

    # -- running -----------------------------------------------------------------------------------

    def run(self) -> None:
        """Stand for election and fire while leading, until :meth:`stop`; blocks."""
        try:
            self.election.run()
        finally:
            self._sender.close()

    def start(self) -> None:
        """:meth:`run` on a thread of its own (a worker with ``-B``)."""
        self.election.start()

    def request_stop(self) -> None:
        """Ask to hand over and leave; safe in a signal handler."""
        self.election.request_stop()

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Hand over (saving the state) and leave; waits for :meth:`start`'s thread."""
        self.election.stop(timeout_s)
        self._sender.close()

    def is_leader(self) -> bool:
        return self.election.is_leader()

    # -- the hooks ---------------------------------------------------------------------------------

    def inaugurate(self, term: Term) -> None:
        from broker_svc.connection.beat_journal import JournalFollower

        read = self.journal.read_state()
        # The fence: delete the exchanges earlier leaders fired through, then read the journal
        # again. A fire that got through before the delete is in the journal now; one after it
        # is refused by the broker. Only then is a time not in the journal a time not fired.
        fenced = (read[0].terms | {term.previous_epoch}) - {0, term.epoch}
        self.journal.fence(fenced)
        self.state, self._offset = self.journal.read_state(read)
        self.state.terms -= fenced
        self.journal.open_term(term.epoch, leader=self.election.identity)
        self._new_term_routes(beat_term_exchange(self.name, self.app.settings.namespace, term.epoch).name)
        self._follower = JournalFollower(self.app.settings, self.name, start=self._offset + 1)
        log.info(
            "beat_leading", scheduler=self.name, epoch=term.epoch, leader=self.election.identity,
            entries=len(self.configured),
            offset=self._offset, handed_over=term.previous_handed_over, fenced=sorted(fenced),
        )  # fmt: skip
        self.events.send(
            "beat-leading", scheduler=self.name, epoch=term.epoch, leader=self.election.identity,
            entries=len(self.configured),
        )  # fmt: skip

    def execute(self, term: Term) -> None:
        self.state.configured = {entry.name: entry.to_json() for entry in self.configured}
        self._save(term)  # so ``ctl schedule list`` shows this leader's entries at once
        entries = self.state.entries(self.configured)
        heap = self._plan(entries, time.time())
        next_snapshot = time.monotonic() + self._snapshot_interval_s
        wait_s = 0.0
        while term.wait(wait_s):
            if self._resync:  # a fire failed: it may have got through, so ask the journal first
                if not self._read_up_to_now():
                    wait_s = self._backoff()
                    continue
                heap = self._plan(entries, time.time())
            if self._read_journal():
                self._routes.clear()  # an entry added again may go elsewhere
                entries = self.state.entries(self.configured)
                heap = self._plan(entries, time.time())
            now = time.time()
            fires: list[tuple[Entry, float, str | None]] = []
            while heap and heap[0][0] <= now:
                _, name = heapq.heappop(heap)
                entry = entries.get(name)
                if entry is None:
                    continue
                fires.extend((entry, at, None) for at in self._due(entry, now))
                heapq.heappush(heap, (next_due(entry, now), name))
            for change_id, name in list(self.state.run_now.items()):
                if name in entries:
                    fires.append((entries[name], now, change_id))
                else:
                    log.warning("beat_run_now_unknown_entry", scheduler=self.name, entry=name)
                    self.state.run_now.pop(change_id)
            wait_s = _POLL_S
            if fires and not self._fire(term, fires):
                heap = self._plan(entries, now)  # the ones not sent are due again, after the journal says
                wait_s = self._backoff()
            elif heap:
                wait_s = max(0.0, min(wait_s, heap[0][0] - time.time()))
            if time.monotonic() >= next_snapshot:
                self._save(term)
                next_snapshot = time.monotonic() + self._snapshot_interval_s

    def hand_over(self, term: Term) -> Any:
        if term.still_leader():
            self._read_journal()
            self._save(term)
        if self._follower is not None:
            self._follower.close()
            self._follower = None
        graceful = term.still_leader()
        log.info("beat_stepped_down", scheduler=self.name, epoch=term.epoch, graceful=graceful)
        self.events.send("beat-stepped-down", scheduler=self.name, epoch=term.epoch, graceful=graceful)
        self.events.close()
        return None

    # -- the leader's work -------------------------------------------------------------------------

    def _plan(self, entries: dict[str, Entry], now: float) -> list[tuple[float, str]]:
        heap = []
        for name, entry in entries.items():
            last = self.state.last_fired.get(name)
            # Due now if a time was missed; otherwise at the entry's next time.
            due = next_due(entry, last if last is not None else now - self._grace_s)
            heap.append((due, name))
        heapq.heapify(heap)
        return heap

    def _due(self, entry: Entry, now: float) -> list[float]:
        times = due_times(
            entry, last_fired=self.state.last_fired.get(entry.name), now=now, grace_s=self._grace_s
        )
        if times and entry.overlap == "skip":
            if self.state.running(entry.name, now=now, timeout_s=self._overlap_timeout_s):
                log.info("beat_fire_skipped", scheduler=self.name, entry=entry.name, reason="still running")
                self.events.send(
                    "beat-skipped",
                    scheduler=self.name,
                    entry=entry.name,
                    scheduled=times[-1],
                    reason="still running",
                )
                self.state.last_fired[entry.name] = times[-1]
                return []
            times = times[-1:]  # one run at a time: the latest
        return times

    def _read_journal(self) -> bool:
        """Apply what the follower read; True when the entries changed."""
        follower = self._follower
        changed = False
        if follower is None:
            return False
        while True:
            try:
                offset, item = follower.records.get_nowait()
            except queue.Empty:
                return changed
            self._offset = max(self._offset, offset)
            changed = self.state.apply(item) or changed
            if isinstance(item, Change):
                log.info("beat_schedule_changed", scheduler=self.name, op=item.op, entry=item.name)
                self.events.send(
                    "beat-schedule-changed",
                    scheduler=self.name,
                    op=item.op,
                    entry=item.name,
                    change_id=item.id,
                )

    def _save(self, term: Term) -> None:
        try:
            term.guard()
            self.journal.save_snapshot(self.state, self._offset)
        except BrokerSvcError as exc:
            log.warning("beat_snapshot_failed", scheduler=self.name, error=str(exc))
