"""``DeadLetters``: list, show, requeue and purge what workers keep in ``<queue>.dead`` (blocking pika).

Each call opens a connection of its own and, per dead queue, takes the queue's lock (an exclusive
queue, ``topology.dead_letter_lock_queue``), then reads the queue whole with ``basic.get`` and no
ack: every message stays the broker's until it is acked, and what a call does not take goes back
to its place when the call closes its channel (a dead queue is classic, which keeps the order).
The guarantees:

- **Nothing lost.** A requeue publishes the copy with a publisher confirm, and only then acks the
  dead letter. A call that dies (killed, a lost connection) leaves every message it held to the
  broker, which puts it back.
- **Nothing doubled.** The copy is published with ``BCC: [<queue>.dead]``, so the same publish also
  leaves a *marker* in the dead queue holding the dead letter's key; the publish either reaches both
  queues or neither. A call that finds a dead letter and a marker of it knows its copy went out
  (a requeue cut short after the confirm, before the ack) and only acks both; a marker alone is
  removed. Every call that reads a dead queue finishes such leftovers first.
- **One at a time.** Two callers on one dead queue never hold the same message: the second waits
  for the lock up to ``lock_wait_s``, then gets ``DeadQueueBusy``. A killed caller's lock goes with
  its connection. Programs that consume a dead queue by other means are outside these rules.
"""

from __future__ import annotations

import builtins
import datetime as dt
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.connection.blocking import open_blocking
from broker_svc.errors import BrokerUnavailable, DeadLetterNotFound, DeadQueueBusy, PublishNacked
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import DEFAULT_EXCHANGE, dead_letter_lock_queue, expired_queue
from broker_svc.wire.records.dead_letter import (
    DEAD_SUFFIX,
    DeadLetter,
    Requeued,
    RequeuePlan,
    RequeueResult,
    dead_queue_name,
    marker_key,
    plan_requeue,
)
from control.blocking.failures import describe_error

__all__ = ["DeadLetters", "OnConfirmed"]

log = get_logger(__name__)

# Told of each requeued copy once the broker confirmed it, before its dead letter is acked:
# (the dead letter, the queue it went to). For progress; a process killed here loses nothing.
OnConfirmed = Callable[[DeadLetter, str], None]

_PROPERTIES: Final = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id", "reply_to",
    "expiration", "message_id", "timestamp", "type", "user_id", "app_id",
)  # fmt: skip
_LOCK_RETRY_S: Final = 0.1


class DeadLetters:
    """The dead letters of a vhost's task queues (``app.control.dead_letters``, ``ctl dead``).

    ``queue`` arguments name a task queue (``orders``) or its dead queue (``orders.dead``). Without
    one, a call covers the dead queues of :meth:`dead_queues`. Each call has a connection of its own,
    so one object may serve several threads.

    Args:
        settings: the broker URL (and vhost), the app's default, quorum and ordered queues.
        discover: more task queues whose dead queues to look at (``app.control`` passes the
            queues the live workers consume).
        clock: the process's Lamport clock, forwarded on each requeued copy.
        hostname: who requeues, written into ``x-clockwork-requeued``.
        lock_wait_s: how long a call waits for a dead queue another caller holds.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        discover: Callable[[], Iterable[str]] | None = None,
        clock: LamportClock | None = None,
        hostname: str | None = None,
        lock_wait_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.clock = clock or LamportClock()
        self.hostname = hostname or f"ctl{os.getpid()}@{socket.gethostname()}"
        self.lock_wait_s = lock_wait_s
        self._discover = discover

    # -- which dead queues ------------------------------------------------------------------------

    def dead_queues(self) -> builtins.list[str]:
        """The dead queues that exist, of: the queues ``discover`` names, the default queue, the
        quorum and ordered queues of the settings and the expired queue (``<queue>.dead`` each).

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        settings = self.settings
        names = [
            *(self._discover() if self._discover is not None else ()),
            settings.default_queue, *settings.quorum_queues, *settings.ordered_queues,
            expired_queue(settings.namespace),
        ]  # fmt: skip
        candidates = list(dict.fromkeys(dead_queue_name(name) for name in names if name))
        with self._connection() as conn:
            return [name for name in candidates if _exists(conn, name)]

    # -- reading -----------------------------------------------------------------------------------

    def list(self, queue: str | None = None, *, limit: int | None = None) -> builtins.list[DeadLetter]:
        """The dead letters of ``queue`` (else of every dead queue found), oldest first.

        Args:
            queue: a task queue or its dead queue; None: :meth:`dead_queues`.
            limit: at most this many (per call); None: all.

        Raises:
            DeadQueueBusy: another caller holds a dead queue past ``lock_wait_s``.
            BrokerUnavailable: the broker cannot be reached.
        """
        letters: builtins.list[DeadLetter] = []
        with self._connection() as conn:
            for name in self._targets(conn, queue):
                with self._held(conn, name) as held:
                    letters.extend(letter for _, letter in held.letters)
        return letters[:limit] if limit is not None else letters

    def show(self, task_id: str, *, queue: str | None = None) -> builtins.list[DeadLetter]:
        """Every dead letter of task ``task_id`` (usually one), with headers, properties and body.

        Raises:
            DeadLetterNotFound: no dead letter has that id.
            DeadQueueBusy: another caller holds a dead queue past ``lock_wait_s``.
            BrokerUnavailable: the broker cannot be reached.
        """
        found: builtins.list[DeadLetter] = []
        with self._connection() as conn:
            names = self._targets(conn, queue)
            for name in names:
                with self._held(conn, name) as held:
                    found.extend(letter for _, letter in held.letters if letter.task_id == task_id)
        if not found:
            raise DeadLetterNotFound([task_id], names)
        return found

    # -- changing ----------------------------------------------------------------------------------

    def requeue(
        self,
        *task_ids: str,
        queue: str | None = None,
        to: str | None = None,
        on_confirmed: OnConfirmed | None = None,
    ) -> RequeueResult:
        """Send the dead letters of these tasks back to their queues (or to ``to``), each once.

        All or nothing for the ids: if one is not found, nothing is requeued. A task with several
        dead letters (it was sent twice) has each requeued.

        Raises:
            ValueError: no ids, or ``to`` is a dead queue or does not exist.
            DeadLetterNotFound: an id has no dead letter; nothing was requeued.
            DeadQueueBusy: another caller holds a dead queue past ``lock_wait_s``.
            PublishNacked: the broker refused a copy (its dead letter stays).
            BrokerUnavailable: the broker cannot be reached.
        """
        if not task_ids:
            raise ValueError("name the task ids to requeue (or requeue them all)")
        return self._requeue(queue, frozenset(task_ids), to, on_confirmed)

    def requeue_all(
        self, queue: str | None = None, *, to: str | None = None, on_confirmed: OnConfirmed | None = None
    ) -> RequeueResult:
        """Send every dead letter of ``queue`` (else of every dead queue found) back, each once.

        Raises:
            ValueError: ``to`` is a dead queue or does not exist.
            DeadQueueBusy: another caller holds a dead queue past ``lock_wait_s``.
            PublishNacked: the broker refused a copy (its dead letter stays).
            BrokerUnavailable: the broker cannot be reached.
        """
        return self._requeue(queue, None, to, on_confirmed)

    def purge(self, queue: str | None = None) -> dict[str, int]:
        """Delete the dead letters of ``queue`` (else of every dead queue found) for good.

        Returns:
            How many messages each dead queue lost (markers of cut-short requeues included).

        Raises:
            DeadQueueBusy: another caller holds a dead queue past ``lock_wait_s``.
            BrokerUnavailable: the broker cannot be reached.
        """
        purged: dict[str, int] = {}
        with self._connection() as conn:
            for name in self._targets(conn, queue):
                self._lock(conn, name)
                try:
                    frame = conn.channel().queue_purge(name)
                except (pika.exceptions.AMQPError, OSError) as exc:
                    raise self._unavailable(exc) from exc
                assert isinstance(frame.method, pika.spec.Queue.PurgeOk)
                purged[name] = frame.method.message_count or 0
        return purged

    # -- the requeue -------------------------------------------------------------------------------

    def _requeue(
        self,
        queue: str | None,
        wanted: frozenset[str] | None,
        to: str | None,
        on_confirmed: OnConfirmed | None,
    ) -> RequeueResult:
        done: builtins.list[Requeued] = []
        with self._connection() as conn, ExitStack() as stack:
            names = self._targets(conn, queue)
            holds = [stack.enter_context(self._held(conn, name)) for name in names]
            # Those a run cut short had sent: their copy is out, their dead letter acked by now.
            done.extend(
                Requeued(letter, letter.queue, earlier=True)
                for held in holds
                for letter in held.earlier
                if wanted is None or letter.task_id in wanted
            )
            if wanted is not None:
                found = {letter.task_id for held in holds for _, letter in held.letters}
                found.update(item.letter.task_id for item in done)
                missing = sorted(wanted - found)
                if missing:
                    raise DeadLetterNotFound(missing, names)
            plans = {
                letter.key: self._plan(letter, to)
                for held in holds
                for _, letter in held.letters
                if wanted is None or letter.task_id in wanted
            }
            _check_destinations(conn, {plan.routing_key for plan in plans.values()})
            publisher = conn.channel()
            publisher.confirm_delivery()
            for held in holds:
                ours: set[str] = set()
                for tag, letter in held.letters:
                    plan = plans.get(letter.key)
                    if plan is None:
                        continue
                    try:
                        self._publish(publisher, letter, plan)
                    except PublishNacked:
                        # Refused by the task queue (a length limit): its marker must not stay, or
                        # the next call would take the dead letter for sent. It stays; we stop.
                        held.collect_markers({letter.key}, missing_ok=True)
                        raise
                    ours.add(letter.key)
                    if on_confirmed is not None:
                        on_confirmed(letter, plan.queue)
                    held.ack(tag)
                    done.append(Requeued(letter, plan.queue))
                held.collect_markers(ours)
        cleared = sum(held.cleared for held in holds)
        return RequeueResult(tuple(done), markers_cleared=cleared)

    def _plan(self, letter: DeadLetter, to: str | None) -> RequeuePlan:
        return plan_requeue(
            letter, to=to, namespace=self.settings.namespace, by=self.hostname, clock=self.clock.forward(),
            now=dt.datetime.now(dt.UTC),
        )  # fmt: skip

    def _publish(self, channel: Channel, letter: DeadLetter, plan: RequeuePlan) -> None:
        # One publish, two queues: the task's copy and, by BCC (RabbitMQ strips it), its marker.
        props = letter.properties
        properties = pika.BasicProperties(
            content_type=props.get("content_type"), content_encoding=props.get("content_encoding"),
            headers={**plan.headers, "BCC": [letter.dead_queue]}, delivery_mode=2,
            priority=props.get("priority"), correlation_id=props.get("correlation_id"),
            reply_to=props.get("reply_to"), message_id=props.get("message_id"),
            timestamp=props.get("timestamp"), type=props.get("type"), app_id=props.get("app_id"),
        )  # fmt: skip
        try:
            # With confirms on, this returns once the broker has both copies.
            channel.basic_publish(DEFAULT_EXCHANGE, plan.routing_key, letter.body, properties, mandatory=True)
        except pika.exceptions.NackError as exc:
            raise PublishNacked(f"the broker refused the copy of {letter.task_id} to {plan.queue}") from exc
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc

    # -- connection, lock, reading -------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[pika.BlockingConnection]:
        conn = open_blocking(self.settings, connection_name=f"clockwork-ctl-dead {self.hostname}")
        try:
            yield conn
        finally:
            # Closing hands back whatever is still held, and the locks.
            if conn.is_open:
                try:
                    conn.close()
                except (pika.exceptions.AMQPError, OSError) as exc:
                    log.debug("dead_letters_close_failed", error=str(exc))

    def _targets(self, conn: pika.BlockingConnection, queue: str | None) -> builtins.list[str]:
        if queue is None:
            return self.dead_queues()
        name = dead_queue_name(queue)
        return [name] if _exists(conn, name) else []

    def _lock(self, conn: pika.BlockingConnection, dead_queue: str) -> None:
        spec = dead_letter_lock_queue(dead_queue.removesuffix(DEAD_SUFFIX))
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                channel = conn.channel()
                channel.queue_declare(spec.name, **spec.declare_options())
                channel.close()
                return
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 405 or time.monotonic() >= deadline:
                    if exc.reply_code == 405:
                        raise DeadQueueBusy(
                            f"{dead_queue} is being read or requeued by another caller (its lock "
                            f"{spec.name} is held); try again when it is done"
                        ) from exc
                    raise self._unavailable(exc) from exc
            except (pika.exceptions.AMQPError, OSError) as exc:
                raise self._unavailable(exc) from exc
            conn.sleep(_LOCK_RETRY_S)

    @contextmanager
    def _held(self, conn: pika.BlockingConnection, dead_queue: str) -> Iterator[_Held]:
        """``dead_queue`` locked and read whole; what is not acked goes back to its place on exit."""
        self._lock(conn, dead_queue)
        try:
            held = _Held(conn.channel(), dead_queue)
            held.read()
            held.finish_earlier()
            yield held
            held.release()
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        return BrokerUnavailable(f"broker {self.settings.safe_broker_url}: {describe_error(exc)}")


class _Held:
    """One dead queue's messages, read and held unacked on a channel of their own.

    Attributes:
        letters: ``(delivery tag, dead letter)`` in queue order; markers are not letters.
        markers: the markers found, by the key of the dead letter each stands for.
        earlier: dead letters whose copy a requeue cut short had sent (acked by ``finish_earlier``).
        cleared: markers ``finish_earlier`` found alone (their dead letter was acked already).
    """

    def __init__(self, channel: Channel, dead_queue: str) -> None:
        self.channel = channel
        self.dead_queue = dead_queue
        self.letters: list[tuple[int, DeadLetter]] = []
        self.markers: dict[str, list[int]] = {}
        self.earlier: list[DeadLetter] = []
        self.cleared = 0

    def read(self) -> None:
        """Take what the queue holds now (what arrives meanwhile stays for the next call)."""
        frame = self.channel.queue_declare(self.dead_queue, passive=True)
        assert isinstance(frame.method, pika.spec.Queue.DeclareOk)
        for _ in range(frame.method.message_count):
            got = self._get()
            if got is None:
                break
            tag, headers, properties, body = got
            key = marker_key(headers)
            if key is not None:
                self.markers.setdefault(key, []).append(tag)
                continue
            self.letters.append((tag, DeadLetter.read(self.dead_queue, headers, properties, body)))

    def finish_earlier(self) -> None:
        """Finish what requeues cut short left: a dead letter with a marker (its copy went out)
        is acked, then every marker; a call killed between the two leaves a marker alone."""
        kept = []
        for tag, letter in self.letters:
            if letter.key in self.markers:
                self.ack(tag)
                self.earlier.append(letter)
            else:
                kept.append((tag, letter))
        self.letters = kept
        finished = {letter.key for letter in self.earlier}
        for key, tags in self.markers.items():
            if key not in finished:
                self.cleared += len(tags)
            for tag in tags:
                self.ack(tag)
        self.markers = {}

    def collect_markers(self, keys: set[str], *, missing_ok: bool = False) -> None:
        """Ack the markers this call's requeues left at the queue's tail (they follow what was read)."""
        pending = set(keys)
        while pending:
            got = self._get()
            if got is None:
                if not missing_ok:  # confirmed, so each is there: one missed is removed next time
                    log.warning("dead_letter_markers_left", queue=self.dead_queue, count=len(pending))
                return
            tag, headers, _, _ = got
            key = marker_key(headers)
            if key in pending:
                pending.discard(key)
                self.ack(tag)

    def ack(self, tag: int) -> None:
        self.channel.basic_ack(tag)

    def release(self) -> None:
        """Put back everything not acked, in its place: by closing the channel, which the broker
        answers once the queue has them back (a nack's requeue is not done by its reply: the next
        call could miss what is still on its way back)."""
        if self.channel.is_open:
            self.channel.close()

    def _get(self) -> tuple[int, dict[str, Any], dict[str, Any], bytes] | None:
        method, props, body = self.channel.basic_get(self.dead_queue, auto_ack=False)
        if method is None:
            return None
        assert isinstance(method, pika.spec.Basic.GetOk) and props is not None
        properties = {name: getattr(props, name, None) for name in _PROPERTIES}
        return method.delivery_tag, dict(props.headers or {}), properties, body or b""


def _exists(conn: pika.BlockingConnection, queue: str) -> bool:
    # A passive declare on a channel of its own: a 404 closes the channel it is asked on.
    channel = conn.channel()
    try:
        channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return False
        raise
    channel.close()
    return True


def _check_destinations(conn: pika.BlockingConnection, queues: Iterable[str]) -> None:
    # Before anything is published: a copy to a missing queue would reach only its marker.
    missing = sorted(queue for queue in queues if not _exists(conn, queue))
    if missing:
        raise ValueError(
            f"cannot requeue to {', '.join(missing)}: no such queue (start a worker on it, or name "
            "another with --to)"
        )
