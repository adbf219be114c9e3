"""A consuming child's one connection, shared by its task threads (``--threads N``): whoever waits reads.

The shared concurrency policy over the same protocol core as ``FeedConnection``
(``broker_svc/amqp/channel.py``): this module only says who reads, who waits and which lock
guards what; every frame is the core's.

One channel, one consumer per queue, prefetch N × ``--prefetch-multiplier`` (at 1, every delivery
held has an idle thread to take it: docs/architecture.md). Leader/follower, no reader thread: a
thread waiting for the broker (a delivery, a confirm, a method's answer) reads the socket when no
other does and dispatches all it reads; the others wait on a condition. Acks that queue behind a
write go out together in the next one.

Locks, always taken in this order: the *role* (who reads, held across a read and its dispatch, and
by a method and its answer), the socket lock (writes; connect holds it while the socket changes,
so no settle of an old connection reaches a new one), ``_state`` (deliveries, publishes awaiting
confirms, who waits), held briefly. A lost connection fails every waiting thread with
``ConnectionLost``; each consumer calls :meth:`SharedFeedConnection.connect`, which only the first
of them carries out.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Final

from broker_svc.amqp import frames
from broker_svc.amqp.delivery import ConnectionLost, TaskDelivery
from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.amqp.waits import PendingPublish, SettleQueue
from broker_svc.errors import BrokerUnavailable
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec

__all__ = ["SharedFeedConnection"]

_WAIT_S: Final = 0.5  # the longest a waiting thread sleeps before it looks again


class SharedFeedConnection(FeedConnection):
    """``FeedConnection`` for the threads of one child: every method may be called from any thread.

    Overrides only the policy points: the role around a method and its answer (``_expect``),
    the leader/follower waits (``next_delivery``, ``_await_confirm``), coalesced settles
    (``_settle_frame``), ``_state`` around what threads share, and one report per loss.

    Args:
        settings: broker URLs (failover order), heartbeat, timeouts, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        queues: the queues to consume.
        prefetch: unacked deliveries the broker may send at once: the child's threads.
        declare: queues declared on every connect before consuming (``FeedConnection``).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        queues: Sequence[str],
        prefetch: int,
        declare: Sequence[QueueSpec] = (),
    ) -> None:
        super().__init__(settings, name=name, queues=queues, prefetch=prefetch, declare=declare)
        self._state = threading.Lock()
        self._delivered = threading.Condition(self._state)  # idle threads, for a delivery
        self._answered = threading.Condition(self._state)  # publishers, for their confirm
        self._free = threading.Condition(self._state)  # threads that must have the role
        self._reader: int | None = None  # the thread holding the role
        self._depth = 0
        self._wanting = self._idle = self._confirming = 0  # threads waiting, by what for
        self._taking = False  # the reader waits for a delivery: the first one read is its own
        self._connecting = threading.Lock()
        self._settles = SettleQueue(self._lock, self._write, self._settling)
        self._told = -1  # the connection (generation) whose loss a thread has logged
        self._loss: tuple[int, ConnectionLost] | None = None  # the last loss, as first seen
        # Any thread may be in a task at any time: the heartbeat thread sends whenever one is due.
        self._busy = True

    # -- the role: who reads ---------------------------------------------------------------------

    def _take_role(self, *, wait: bool) -> bool:
        # Under ``_state``. A thread that must have it (``wait``) goes before those that may read.
        me = threading.get_ident()
        if self._reader == me:
            self._depth += 1
            return True
        if self._reader is None and (wait or not self._wanting):
            self._reader, self._depth = me, 1
            return True
        if not wait:
            return False
        self._wanting += 1
        try:
            while self._reader is not None:
                self._free.wait()
        finally:
            self._wanting -= 1
        self._reader, self._depth = me, 1
        return True

    def _leave_role(self) -> None:
        with self._state:
            self._depth -= 1
            if not self._depth:
                self._reader = None
                self._hand_on()

    def _hand_on(self) -> None:
        # Under ``_state``, the role free: wake one thread that will read, if any waits.
        if self._wanting:
            self._free.notify()
        elif self._idle:
            self._delivered.notify()
        elif self._confirming:
            self._answered.notify()

    @contextlib.contextmanager
    def _role(self) -> Iterator[None]:
        with self._state:
            self._take_role(wait=True)
        try:
            yield
        finally:
            self._leave_role()

    def _read_until(self, ready: Callable[[], bool], deadline: float | None) -> None:
        # With the role: read and dispatch until ``ready``, the deadline, or a thread needs the role.
        while True:
            self._pump()
            while (frame := frames.next_frame(self._buffer)) is not None:  # the rest of that read
                self._dispatch(frame)
            if ready() or self._wanting or (deadline is not None and time.monotonic() >= deadline):
                return

    # -- connecting ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect and consume, unless another thread has connected again already.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        with self._connecting:
            if self._sock is not None:
                return
            with self._role(), self._lock:
                super().connect()

    def drop(self) -> None:
        """Drop the socket; every thread waiting on it fails with ``ConnectionLost``."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):  # a thread in recv() on it returns at once
                sock.shutdown(socket.SHUT_RDWR)
        super().drop()
        with self._state:
            self._delivered.notify_all()
            self._answered.notify_all()
            self._free.notify_all()

    def _expect(
        self, wanted: tuple[int, int], *, send: bytes | None = None, timeout_s: float | None = None
    ) -> bytes:
        with self._role():  # the answer is read by the thread that waits for it
            return super()._expect(wanted, send=send, timeout_s=timeout_s)

    def _peek_close(self, sock: socket.socket) -> None:
        if self._reader is None:  # a reader sees a close itself
            super()._peek_close(sock)

    def running(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # the heartbeat thread sends whenever one is due

    @contextlib.contextmanager
    def taken_over(self) -> Iterator[None]:
        yield  # every method is safe from any thread already

    # -- consuming -------------------------------------------------------------------------------

    def next_delivery(self, timeout_s: float | None) -> TaskDelivery | None:
        """The next delivery for the calling thread, waiting up to ``timeout_s``; None if none came.

        Raises:
            ConnectionLost: the connection failed, or the broker went silent past two heartbeats.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._state:
                if self._sock is None:
                    raise self._gone("not connected")
                if self._deliveries:
                    delivery = self._next_in_turn()
                    if self._reader is None:
                        self._hand_on()
                    return delivery
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not self._take_role(wait=False):
                    self._idle += 1
                    try:
                        self._delivered.wait(_WAIT_S if left is None else min(left, _WAIT_S))
                    finally:
                        self._idle -= 1
                    continue
            self._taking = True
            try:
                self._read_until(lambda: bool(self._deliveries), deadline)
                with self._state:
                    if self._deliveries:
                        return self._next_in_turn()
            finally:
                self._taking = False
                self._leave_role()

    def held(self) -> list[TaskDelivery]:
        """``FeedConnection.held``: the socket is peeked while no thread reads it."""
        with self._state:  # no thread takes the role to read meanwhile
            return self._holding(peek=self._reader is None)

    def check(self, delivery: TaskDelivery | None = None) -> None:
        """Raise if ``delivery``'s connection is gone: its settle did not reach the broker.

        Raises:
            ConnectionLost: the connection that delivered it failed (or was replaced).
        """
        # No read here (the threads that wait read), so no system call per task.
        if delivery is not None and (delivery.generation != self.generation or self._sock is None):
            raise self._gone("lost before a settle went out")

    def loss_to_tell(self, exc: BrokerUnavailable) -> BrokerUnavailable | None:
        """One line per lost connection: the loss as first seen, for the first to ask; else None."""
        if not isinstance(exc, ConnectionLost) or exc.reported:
            return exc  # a failed connect (only the thread that tried sees it), or told already
        with self._state:
            # The connection it ended, not the one up now (another thread may have connected again).
            lost = self.generation if exc.generation is None else exc.generation
            if self._told >= lost:
                return None
            self._told, loss = lost, self._loss
        return loss[1] if loss is not None and loss[0] == lost else exc

    def _first_to_tell(self) -> bool:
        # The heartbeat thread's peek and a thread's read may see one close at once: told once.
        with self._state:
            told, self._told = self._told, max(self._told, self.generation)
            return told < self.generation

    def _gone(self, what: str) -> ConnectionLost:
        # Found gone, not seen failing: the thread that saw it fail tells it (loss_to_tell).
        return ConnectionLost(f"connection {self._name}: {what}", reported=True)

    def _losing(self, lost: ConnectionLost) -> None:
        # Before the drop wakes the other threads: what the first thread that saw it knows (a
        # consumer_timeout, say); a read that fails after that drop tells less.
        with self._state:
            lost.generation = self.generation  # the failing thread holds the role or the socket lock
            if self._loss is None or self._loss[0] != self.generation:
                self._loss = (self.generation, lost)

    def _settle_frame(self, delivery: TaskDelivery, frame: bytes) -> None:
        self._settles.settle(delivery, frame)  # acks that meet at the socket lock go out together

    def hold(self, delta: int, generation: int) -> None:
        """``FeedConnection.hold`` (each thread counts its own parked copies), with the role held."""
        with self._role():
            super().hold(delta, generation)

    def catch_up(self) -> None:
        """``FeedConnection.catch_up``, with the role held, by the first thread to find it due."""
        if self._catch_up_due():  # looked at without the role: most calls find nothing to do
            with self._role():
                super().catch_up()

    def _count_settled(self, delivery: TaskDelivery) -> None:
        with self._state:  # threads settle under the socket lock, deliveries arrive under this one
            super()._count_settled(delivery)

    def set_prefetch(self, prefetch: int) -> None:
        """``FeedConnection.set_prefetch``, with the role held (a thread that sees no change waits not)."""
        if prefetch != self._prefetch:
            with self._role():
                super().set_prefetch(prefetch)

    def set_queues(self, queues: Sequence[str]) -> None:
        """``FeedConnection.set_queues``, made once by the first thread to see the change."""
        with self._role():
            if tuple(dict.fromkeys(queues)) != self._queues:
                super().set_queues(queues)

    def cancel(self) -> list[TaskDelivery]:
        """``FeedConnection.cancel``, once, whichever thread comes first."""
        with self._role():
            return super().cancel()

    def _take_all(self) -> list[TaskDelivery]:
        with self._state:
            return super()._take_all()

    # -- publishing: where publishes and their confirms meet ---------------------------------------

    def _track(self, sequence: int, waiting: PendingPublish) -> None:
        with self._state:  # the reader walks the publishes awaiting confirms as it dispatches
            super()._track(sequence, waiting)

    def _forget(self, sequence: int, waiting: PendingPublish) -> None:
        with self._state:
            super()._forget(sequence, waiting)

    def _await_confirm(self, waiting: PendingPublish, generation: int) -> None:
        deadline = time.monotonic() + self._settings.confirm_timeout_s
        while True:
            with self._state:
                if self.generation != generation or self._sock is None:
                    raise self._gone("lost before a publish was confirmed")
                if waiting.done:
                    if self._reader is None:
                        self._hand_on()
                    return
                left = deadline - time.monotonic()
                if left > 0 and not self._take_role(wait=False):
                    self._confirming += 1
                    try:
                        self._answered.wait(min(left, _WAIT_S))
                    finally:
                        self._confirming -= 1
                    continue
            if left <= 0:
                raise self._lost(f"no confirm within {self._settings.confirm_timeout_s} s")
            try:
                self._read_until(lambda: waiting.done, deadline)
            finally:
                self._leave_role()

    # -- frames ----------------------------------------------------------------------------------

    def _on_confirm(self, tag: int, *, multiple: bool, nacked: bool) -> None:
        with self._state:
            super()._on_confirm(tag, multiple=multiple, nacked=nacked)
            if self._confirming:
                self._answered.notify_all()

    def _on_returned(self, exchange: str, routing_key: str, body: bytes, *, why: str) -> None:
        with self._state:
            super()._on_returned(exchange, routing_key, body, why=why)

    def _arrived(self, delivery: TaskDelivery, consumer: str) -> None:
        # Under the state lock: the threads that take deliveries count them down under it too.
        with self._state:
            super()._arrived(delivery, consumer)
            if self._idle and len(self._deliveries) > self._taking:  # an idle thread for each
                self._delivered.notify()  # delivery the reader does not take itself
