"""How the scheduler's leader fires: through its term's exchange, once per message, and what it
does when a fire fails (``Firing``, a base of ``worker/beat/scheduler.py:Beat``).

A fire goes out through an app of its own that sends each message once (``publish_attempts=1``):
after a lost confirm, the journal, read again before the next fire, says whether the fire got
through; a resend could double it. A fire the app cannot send (bad options, too large, an
exchange that does not exist) is dropped with an error logged, since retrying cannot help.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from broker_svc.app import App
from broker_svc.canvas.signature import Signature
from broker_svc.errors import BrokerSvcError, Unroutable
from broker_svc.logging import get_logger
from broker_svc.schedules import Entry, fire_id
from broker_svc.schedules.journal_record import Fire, FireMark
from broker_svc.schedules.state import BeatState
from broker_svc.sending.message import build_message

if TYPE_CHECKING:
    from broker_svc.connection.beat_journal import Journal
    from worker.beat.event_sender import EventSender
    from worker.leader import Term

__all__ = ["Firing"]

log = get_logger("broker_svc.beat")

_Prepared = tuple[Signature, str, FireMark]  # a fire ready to send: its message, task id, mark

# What of the app's conf shapes a fire once its destination is set (the routes are applied first).
_SENDING_CONF: Final = ("task_default_priority", "task_ignore_result")
_RETRY_S: Final = 1.0  # the backoff's step after failed fires (the first retry is at once)
_MAX_RETRY_S: Final = 5.0


class Firing:
    """The leader's fires. A base of ``Beat``, which sets the attributes annotated here."""

    name: str
    app: App
    journal: Journal
    state: BeatState
    events: EventSender
    _offset: int

    def __init__(self, app: App) -> None:
        sending = {key: app.conf[key] for key in _SENDING_CONF if key in app.conf}
        self._sender = App(
            f"{app.main or 'app'}-beat", settings=app.settings.with_options(publish_attempts=1),
            set_as_current=False, **sending,
        )  # fmt: skip
        self._resync = False  # a fire failed: read the journal before the next one
        self._failures = 0  # failed fires in a row (for the backoff)
        self._term_exchange = ""  # this term's exchange (broker_svc.topology.beat_term_exchange)
        self._bound: set[tuple[str, str | None]] = set()  # destinations bound to the router this term
        self._routes: dict[str, str] = {}  # entry -> its routing key on the router, this term
        self.fired = 0  # fires this instance sent (for stats and tests)

    def _backoff(self) -> float:
        # The first retry at once (the journal has been read first); then one second more each time.
        self._failures += 1
        return min(_RETRY_S * (self._failures - 1), _MAX_RETRY_S)

    def _fire(self, term: Term, fires: list[tuple[Entry, float, str | None]]) -> bool:
        """Send the fires, confirmed; apply each to the state. False: not all were sent (retry)."""
        prepared: list[_Prepared] = []
        for entry, at, run_now in fires:
            try:
                prepared.append(self._prepare(term, entry, at, run_now))
            except Unroutable as exc:  # its exchange does not exist: retrying cannot help
                self._drop(FireMark(entry=entry.name, scheduled=at, epoch=term.epoch, run_now=run_now), exc)
            except BrokerSvcError as exc:  # its destination could not be bound now
                self._failed(exc, 1)
        if not prepared:
            return not self._resync
        try:
            term.guard()
            self._sender.send_many([signature for signature, _, _ in prepared], wait=True)
        except (TypeError, ValueError) as exc:  # an entry the app cannot send (bad options, too large)
            if len(prepared) == 1:
                self._drop(prepared[0][2], exc)
                return True
            sent = [item for item in prepared if self._send_one(term, item)]
            self._sent(sent)
            return not self._resync
        except BrokerSvcError as exc:
            self._failed(exc, len(fires))
            return False
        self._sent(prepared)
        return not self._resync

    def _failed(self, exc: BrokerSvcError, count: int) -> None:
        # Sent once only (publish_attempts=1): a fire whose confirm was lost may still have been
        # routed, so the journal, not a resend, says whether it was; it is read before the next fire.
        log.warning("beat_fire_failed", scheduler=self.name, error=str(exc), fires=count)
        self._resync = True

    def _read_up_to_now(self) -> bool:
        """Bring the state up to the journal's end (after a failed fire); False: not reachable."""
        try:
            self.state, self._offset = self.journal.read_state((self.state, self._offset), timeout_s=10.0)
        except BrokerSvcError as exc:
            log.warning("beat_journal_unreadable", scheduler=self.name, error=str(exc))
            return False
        self._resync = False
        return True

    def _prepare(self, term: Term, entry: Entry, at: float, run_now: str | None) -> _Prepared:
        mark = FireMark(entry=entry.name, scheduled=at, epoch=term.epoch, run_now=run_now)
        task_id = fire_id(
            entry.name if run_now is None else f"{entry.name}/run-now/{run_now}", mark.scheduled
        )
        # A task this app registers is sent as its apply_async sends it (Celery's beat does the
        # same): its declaration's options (its queue, ...) under the entry's.
        task = self.app.tasks.get(entry.task)
        declared = task.send_options() if task is not None else {}
        options = {**declared, **entry.options, "task_id": task_id, "reply_to": self.journal.stream.name}
        # Through this term's exchange, by the router, to where the entry would go (routes and
        # all); the BCC puts the same message in the journal (RabbitMQ removes it on delivery).
        key = self._routes.get(entry.name)
        if key is None:  # an entry's destination holds for the term (its arguments are fixed)
            key = self._routes[entry.name] = self._route(
                Signature(entry.task, entry.args, dict(entry.kwargs), options)
            )
        options["headers"] = {
            **(options.get("headers") or {}),
            **mark.headers(),
            "BCC": [self.journal.stream.name],
        }
        options.update(exchange=self._term_exchange, routing_key=key)
        options.pop("queue", None)
        return Signature(entry.task, entry.args, dict(entry.kwargs), options), task_id, mark

    def _route(self, signature: Signature) -> str:
        """The routing key on the router that reaches where ``signature`` goes, bound once per term."""
        _, (key, exchange), _ = build_message(
            signature, conf=self.app.conf, settings=self.app.settings, clock=self.app.clock,
            reply_queue=self.journal.stream.name,
        )  # fmt: skip
        if (key, exchange) not in self._bound:
            if exchange:
                self.journal.route_exchange(exchange, key)
            else:
                self.journal.route_queue(self.app.settings.task_queue(key))
            self._bound.add((key, exchange))
        return key

    def _new_term_routes(self, term_exchange: str) -> None:
        """A term fires through its own exchange, and binds what it fires to again."""
        self._term_exchange = term_exchange
        self._bound.clear()
        self._routes.clear()

    def _send_one(self, term: Term, item: _Prepared) -> bool:
        try:
            term.guard()
            self._sender.send_many([item[0]], wait=True)
        except (TypeError, ValueError) as exc:
            self._drop(item[2], exc)
            return False
        except BrokerSvcError as exc:
            self._failed(exc, 1)
            return False
        return True

    def _drop(self, mark: FireMark, exc: Exception) -> None:
        # Retrying cannot help: the time counts as fired, and the error is logged each time.
        log.error("beat_fire_invalid", scheduler=self.name, entry=mark.entry, error=str(exc))
        if mark.run_now is not None:
            self.state.run_now.pop(mark.run_now, None)
        else:
            self.state.last_fired[mark.entry] = mark.scheduled

    def _sent(self, sent: list[_Prepared]) -> None:
        now = time.time()
        if sent:
            self._failures = 0
        events = []
        for signature, task_id, mark in sent:
            self.state.apply(Fire(task_id, mark), fired_at=now)
            late_s = round(now - mark.scheduled, 3)
            log.info(
                "beat_fired", scheduler=self.name, entry=mark.entry, task_id=task_id,
                scheduled=mark.scheduled, late_s=late_s,
            )  # fmt: skip
            events.append(
                {"scheduler": self.name, "entry": mark.entry, "uuid": task_id, "name": signature.task,
                 "scheduled": mark.scheduled, "late_s": late_s, "run_now": mark.run_now}
            )  # fmt: skip
        self.events.send_batch("beat-fired", events)  # one publish for a burst, as Celery batches
        self.fired += len(sent)
