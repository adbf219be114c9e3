"""Leader election on RabbitMQ alone: a single-active-consumer quorum queue and a fenced lease.

How it works (docs/guide.md, "Leaders and ordered queues", has the guarantees and figures):

- Every candidate consumes the role's election queue (``broker_svc.topology.leader_queue``: quorum,
  ``x-single-active-consumer``) and publishes a bid. The broker delivers only to the one active
  consumer; the first delivery tells a candidate it is the active one.
- The active candidate takes every message in the queue (the previous leader's unacked tokens come
  back when its channel closes), picks ``epoch + 1`` of the highest token, and publishes its own
  token to itself. When that token comes back (so it was still the active consumer after sending
  it), its lease runs until ``lease_s`` after the send. It keeps publishing tokens every
  ``lease_s / 4``: each one coming back renews the lease and lets it ack the one before.
- Fencing: a leader whose tokens stop coming back (frozen, partitioned, disconnected) loses its
  lease by its own clock. The next leader waits ``lease_s`` (and a margin) from the moment it
  became active before its term starts, unless the last token it found says the previous term was
  handed over: the previous leader's lease was renewed by a token it sent while still active, so
  before the next one became active, and has run out by then. This needs no word from the broker
  and holds for a forced disconnect, which the broker acts on at once.
- Graceful step-down: ``execute`` finishes (or is aborted, ``atomic``), ``hand_over`` runs, the
  term ends, then a token marked ``handed_over`` with the state is published and the connection
  closed: the next leader finds it and starts at once.

Threads: a keeper thread owns the connection (reads, heartbeats, tokens); the runner (the thread
calling :meth:`Election.run`) calls the hooks (``worker/leader/runner.py``). Any connection
failure or lost lease ends the term, and the keeper joins again as a new candidate.
"""

from __future__ import annotations

import os
import platform
import queue
import threading
import time
import uuid
from typing import Any, Final

from broker_svc.amqp.lease_connection import LeaseConnection, TokenDelivery
from broker_svc.errors import BrokerUnavailable, DecodeError
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import leader_queue
from worker.leader.runner import TermRunner
from worker.leader.term import LeaderHooks, Term
from worker.leader.token import CONTENT_TYPE, Token, decode_token, encode_token, last_term

__all__ = ["Election"]

log = get_logger(__name__)

_DRIFT: Final = 0.05  # the next leader waits this much longer than a lease: clock rates may differ
_TICK_S: Final = 0.05
_RETRY_S: Final = (0.2, 0.5, 1.0, 2.0)  # pauses between connection attempts


class _Restart(Exception):
    """The keeper's session ends; it joins again as a new candidate."""


class Election(TermRunner):
    """One candidate for the leader role ``name``; any number of processes and hosts may stand.

    Args:
        settings: the broker (URL, failover list), ``heartbeat_s`` (how soon the broker notices a
            dead or frozen leader), ``connect_timeout_s``.
        name: the role; candidates of the same role elect one leader among them.
        hooks: ``inaugurate``, ``execute``, ``hand_over`` (:class:`~worker.leader.term.LeaderHooks`).
        atomic: ``execute`` may be aborted at once when the term ends or a step-down is asked
            (``LeadershipLost`` is raised into it at its next bytecode); else it is asked to finish
            (``term.wait`` returns False, ``term.stepping_down``) and handing over waits for it.
        lease_s: the lease. Failover after a leader dies takes about the broker's detection (a
            closed socket: at once; a frozen or cut-off process: about ``2 * heartbeat_s``) plus
            ``lease_s``. It must be well above a token's round trip; tokens go every ``lease_s/4``.
        identity: this candidate's name in tokens and logs (default: host, pid, a random suffix).

    Raises:
        ValueError: ``lease_s`` is not positive.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        hooks: LeaderHooks,
        atomic: bool = False,
        lease_s: float = 10.0,
        identity: str | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s} (try a few heartbeats, e.g. 10)")
        super().__init__(hooks)
        self._settings = settings
        self.name = name
        self._atomic = atomic
        self._lease_s = lease_s
        self.identity = identity or f"{platform.node()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        self._queue = leader_queue(name, settings.namespace)
        self._stop = threading.Event()
        self._stop_asked = False
        self._terms: queue.Queue[Term] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._keeper: threading.Thread | None = None

    # -- public ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Stand for election until :meth:`request_stop`: lead when elected, hand over, stand again.

        Blocks; the hooks run on this thread.

        Raises:
            RuntimeError: already running.
        """
        with self._lock:
            if self._runner_id is not None:
                raise RuntimeError("this election is already running")
            self._runner_id = threading.get_ident()
        self._keeper = threading.Thread(target=self._keep, name=f"clockwork-leader-{self.name}", daemon=True)
        self._keeper.start()
        try:
            while not self._stop.is_set():
                self._check_stop()
                try:
                    term = self._terms.get(timeout=_TICK_S * 2)
                except queue.Empty:
                    continue
                self._serve(term)
        finally:
            self._stop.set()
            # A term the keeper starts meanwhile is served too (it steps down at once): the keeper
            # leaves only after handing it over.
            while self._keeper.is_alive():
                try:
                    self._serve(self._terms.get(timeout=_TICK_S))
                except queue.Empty:
                    pass
            with self._lock:
                self._runner_id = None

    def start(self) -> None:
        """Run :meth:`run` on a thread of its own (a worker embedding an election)."""
        self._thread = threading.Thread(target=self.run, name=f"clockwork-elect-{self.name}", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask to step down and leave; safe in a signal handler (one assignment, no lock).

        Seen within a tick by the keeper: a leader finishes ``execute`` (or aborts it, ``atomic``),
        hands over and releases; a candidate leaves the queue.
        """
        self._stop_asked = True

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask to step down and leave now; wait for the thread :meth:`start` made (up to ``timeout_s``)."""
        self._stop_now()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _stop_now(self) -> None:
        self._stop_asked = True
        self._stop.set()
        term = self.term
        if term is not None:
            term.step_down()
            if self._atomic:
                self._interrupt()

    def _check_stop(self) -> None:
        # The keeper's tick: a stop asked from a signal handler takes effect here.
        if self._stop_asked and not self._stop.is_set():
            self._stop_now()

    # -- the keeper ------------------------------------------------------------------------------

    def _keep(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            self._check_stop()
            connection = LeaseConnection(
                self._settings, name=f"clockwork.leader.{self.name}.{self.identity}", queue=self._queue
            )
            try:
                connection.connect()
                attempt = 0
                self._session(connection)
            except Exception as exc:  # a lost connection or lease (or a bug): stand again
                if isinstance(exc, BrokerUnavailable | _Restart):
                    log.warning("leader_candidate_restarts", role=self.name, reason=str(exc))
                else:
                    log.exception("leader_keeper_failed", role=self.name)
                pause = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                attempt += 1
                self._stop.wait(pause)
            finally:
                self._lose()
                connection.close()

    def _lose(self) -> None:
        # The session is over: a term still running ends (its lease would run out anyway).
        term = self.term
        if term is not None and term.still_leader():
            log.warning("leader_lease_lost", role=self.name, epoch=term.epoch)
        if term is not None:
            term.end()
            if self._atomic:
                self._interrupt()

    def _session(self, connection: LeaseConnection) -> None:
        connection.publish(encode_token(Token("bid", self.identity)), CONTENT_TYPE)
        held: list[tuple[TokenDelivery, Token]] = []
        while not held:  # a candidate: the first delivery says the broker made us the active one
            self._check_stop()
            if self._stop.is_set():
                return
            delivery = connection.next_delivery(_TICK_S)
            if delivery is not None:
                held += self._decoded(connection, delivery)
        active_at = time.monotonic()
        deadline = active_at + self._settings.connect_timeout_s
        while connection.ready_count() > 0:  # take every message the queue holds
            if time.monotonic() > deadline:
                raise _Restart("the election queue did not drain in time")
            delivery = connection.next_delivery(_TICK_S)
            if delivery is not None:
                held += self._decoded(connection, delivery)
        while (delivery := connection.next_delivery(0)) is not None:
            held += self._decoded(connection, delivery)
        for delivery, token in held:
            if token.kind == "bid":
                connection.ack(delivery.tag)
        held = [(d, t) for d, t in held if t.kind == "token"]
        previous = last_term(t for _, t in held)
        _Leading(self, connection, active_at, previous, held).run()

    def _decoded(
        self, connection: LeaseConnection, delivery: TokenDelivery
    ) -> list[tuple[TokenDelivery, Token]]:
        try:
            return [(delivery, decode_token(delivery.body))]
        except DecodeError as exc:
            log.warning("leader_queue_bad_message", role=self.name, error=str(exc), size=len(delivery.body))
            connection.ack(delivery.tag)
            return []


class _Leading:
    """The keeper's part of one term: claim it, renew the lease, start it, hand it over."""

    def __init__(
        self,
        election: Election,
        connection: LeaseConnection,
        active_at: float,
        previous: Token | None,
        held: list[tuple[TokenDelivery, Token]],
    ) -> None:
        self.e = election
        self.connection = connection
        self.previous = previous
        self.epoch = (previous.epoch if previous else 0) + 1
        self.older = [d for d, _ in held]  # the previous term's tokens: acked once ours is back
        self.sent: dict[int, float] = {}  # our tokens' seq -> when sent (monotonic)
        self.own: list[tuple[int, TokenDelivery]] = []  # our tokens back and not acked yet
        self.seq = 0
        self.lease_end = 0.0
        self.next_token = 0.0
        # Fencing: unless the last term was handed over, its leader may hold a lease until
        # lease_s after it last sent a token, which was before we became active.
        handed_over = previous is None or previous.handed_over
        self.start_at = active_at if handed_over else active_at + election._lease_s * (1 + _DRIFT) + _TICK_S
        self.term: Term | None = None

    def run(self) -> None:
        e = self.e
        while True:
            e._check_stop()
            now = time.monotonic()
            if self.lease_end and now >= self.lease_end and self.term is None:
                raise _Restart("lease ran out before the term started")
            if self.term is not None and not self.term.still_leader():
                release = e._release_asked(self.term)
                if release is not None:
                    self._hand_over(*release)
                    return
                if now >= self.lease_end:
                    raise _Restart("lease ran out")
            if now >= self.next_token:
                self._send_token(Token("token", e.identity, self.epoch, self.seq))
            if e._stop.is_set() and self.term is None:
                self._leave_before_start()
                return
            if self.term is None and self.lease_end > now >= self.start_at:
                self._start(now)
            delivery = self.connection.next_delivery(_TICK_S)
            if delivery is not None:
                for d, token in e._decoded(self.connection, delivery):
                    self._on_token(d, token)

    def _send_token(self, token: Token) -> None:
        self.sent[token.seq] = time.monotonic()
        self.connection.publish(encode_token(token), CONTENT_TYPE)
        self.seq = token.seq + 1
        self.next_token = self.sent[token.seq] + self.e._lease_s / 4

    def _on_token(self, delivery: TokenDelivery, token: Token) -> None:
        e = self.e
        if token.holder == e.identity and token.epoch == self.epoch and token.seq in self.sent:
            sent_at = self.sent.pop(token.seq)
            for seq in [s for s in self.sent if s < token.seq]:
                del self.sent[seq]  # overtaken: never renews
            self.lease_end = max(self.lease_end, sent_at + e._lease_s)
            if self.term is not None:
                self.term.renew(self.lease_end)
            for _, older in self.own:
                self.connection.ack(older.tag)
            for older in self.older:
                self.connection.ack(older.tag)
            self.own, self.older = [(token.seq, delivery)], []
        elif token.kind == "bid" or token.epoch < self.epoch:
            self.connection.ack(delivery.tag)  # a new candidate's bid, or a stale leader's token
        else:
            # A token of our epoch or later from someone else: two claimed this term. Never act on it.
            if self.term is not None:
                self.term.end()
            raise _Restart(f"another leader's token (epoch {token.epoch}, {token.holder})")

    def _start(self, now: float) -> None:
        previous = self.previous
        self.term = Term(
            epoch=self.epoch,
            leader=self.e.identity,
            lease_end=self.lease_end,
            previous_epoch=previous.epoch if previous else 0,
            previous_handed_over=previous is not None and previous.handed_over,
            handover_state=previous.state if previous and previous.handed_over else None,
        )
        log.info("leader_elected", role=self.e.name, epoch=self.epoch, waited_s=round(now - self.start_at, 3))
        self.e._terms.put(self.term)

    def _hand_over(self, term: Term, state: Any) -> None:
        # The term is over (the runner ended it after hand_over returned): say so in a token the
        # next leader finds, wait for it to be in the queue (it comes back), then leave.
        try:
            self._handover_token(state)
        finally:
            self.e._released.set()

    def _handover_token(self, state: Any) -> None:
        e = self.e
        try:
            last = Token("token", e.identity, self.epoch, self.seq, handed_over=True, state=state)
            body = encode_token(last)
        except TypeError as exc:
            log.error("leader_hand_over_state_not_json", role=e.name, error=str(exc))
            body = encode_token(Token("token", e.identity, self.epoch, self.seq, handed_over=True))
        marker = self.seq
        self.connection.publish(body, CONTENT_TYPE)
        deadline = time.monotonic() + e._lease_s
        while time.monotonic() < deadline:
            delivery = self.connection.next_delivery(_TICK_S)
            if delivery is None:
                continue
            for d, token in e._decoded(self.connection, delivery):
                if token.holder == e.identity and token.epoch == self.epoch and token.seq == marker:
                    for older in [o for _, o in self.own] + self.older:
                        self.connection.ack(older.tag)
                    self.connection.close()  # the marker goes back to the queue, to the next one
                    log.info("leader_handed_over", role=e.name, epoch=self.epoch)
                    return
                if token.holder != e.identity or token.kind == "bid":
                    self.connection.ack(d.tag)
        log.warning("leader_handover_unconfirmed", role=e.name, epoch=self.epoch)

    def _leave_before_start(self) -> None:
        # Stopped while waiting out the previous lease: we never acted. If the previous term was
        # handed over, pass its handover on; else just leave (the next one waits out the lease).
        previous = self.previous
        if previous is not None and not previous.handed_over:
            return
        self._handover_token(previous.state if previous is not None else None)
