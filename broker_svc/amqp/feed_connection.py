"""A consuming pool child's own connection: one socket, one channel, read and written by the child itself.

Why not pika: at one delivery in flight per child, pika's layers (an I/O loop, a thread hop per
ack, frame objects) cost more CPU than the rest of the child (BENCHMARKS.md). This does what a
consumer needs on the calling thread: consume with a prefetch, ack, nack, publish with a confirm
(one at a time), declare a queue.

The protocol is the ``Channel`` core's (``broker_svc/amqp/channel.py``: declares, consumes,
publish and confirm, settle frames, the close handshakes, what the broker sends unasked), on
``FrameSocket``'s socket, handshake and heartbeat thread; this class is a consumer's API over it
and the single-threaded concurrency policy: the child's main thread does everything while no
task runs; while one does, a heartbeat thread writes heartbeats and the hard time limit's
watchdog may take the socket over, one at a time (the socket lock). Under ``--threads``, see
``SharedFeedConnection``, the shared policy.

Any failure is :class:`ConnectionLost`: the socket is dropped, what it delivered is the broker's
again (settles of an earlier ``generation`` are not sent), and the caller connects again. Each
connect declares the queues it was given before consuming them, so a queue deleted under the
consumer (the broker's basic.cancel) is there again, declared as before, when it consumes anew.
"""

from __future__ import annotations

import collections
import contextlib
import select
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from broker_svc.amqp import methods
from broker_svc.amqp.channel import Channel
from broker_svc.amqp.delivery import ConnectionLost, TaskDelivery
from broker_svc.amqp.peek import peeked_deliveries, task_delivery
from broker_svc.amqp.waits import PendingPublish
from broker_svc.errors import Unroutable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_properties
from broker_svc.wire.task.task_message import WireMessage

__all__ = ["ConnectionLost", "FeedConnection", "TaskDelivery"]

log = get_logger(__name__)

# Before a quorum queue's consumer is cancelled, what the broker has sent it is let arrive: a
# delivery that reaches the channel after the cancel is returned to the queue, and a return counts
# as a delivery (``x-delivery-count``, RabbitMQ 3.x), so a task could reach its delivery limit
# without running. An ack frees a place that the broker fills a few ms later, once the ack is
# through the queue's log: a cancel right after an ack nearly always lost one delivery so.
_IN_FLIGHT_QUIET_S: Final = 0.1  # nothing came for this long: the queue has no more to send
_IN_FLIGHT_MAX_S: Final = 1.0
# With deliveries in hand, ``check`` reads again only once the last read is this old: a drain of
# short tasks then makes one read every few tasks, not one each (a tenth of a child's CPU per task).
_LOOK_AGAIN_S: Final = 0.001


class FeedConnection(Channel):
    """Consumes task queues and publishes with confirms, on the calling thread.

    The single-threaded policy over the ``Channel`` core: one thread reads and writes, no lock
    but the socket's (the heartbeat thread's while a task runs), nothing allocated per delivery
    beyond the delivery itself.

    Args:
        settings: broker URLs (failover order), heartbeat, timeouts, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        queues: the queues to consume.
        prefetch: unacked deliveries the broker may send at once.
        declare: queues (with their exchange and binding) declared on every connect before
            consuming, exactly as the worker declares them: a queue deleted meanwhile comes back.
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
        super().__init__(settings, name=name)
        self._queues = tuple(queues)
        self._declare_on_connect = tuple(declare)
        self._prefetch = prefetch
        self._held = 0  # parked copies on this connection, each one more unacked (``hold``)
        # What the broker's per-consumer limits leave out: a consumer a resubscribe cancelled keeps
        # its unacked deliveries, and the one made instead gets a limit of its own. So the new one
        # is sized to what is outstanding, and given the whole prefetch again (``catch_up``) once
        # the cancelled ones' deliveries are settled; else every park or prefetch change would add
        # a whole prefetch more (hundreds held after a reconnect brought many copies back).
        self._unsettled = 0  # deliveries of this connection read and not acked or nacked yet
        self._last_tag = 0  # the newest delivery tag read
        self._retired_below = 0  # deliveries up to this tag came to consumers cancelled since
        self._retired_left = 0  # how many of those are not settled yet
        self._limit = prefetch  # the limit the newest consumers were given
        # Ordered queues (x-single-active-consumer) are consumed with prefetch 1 whatever ``prefetch``.
        self._ordered = frozenset(spec.name for spec in declare if spec.single_active)
        self._quorum = frozenset(
            spec.name for spec in declare if spec.arguments.get("x-queue-type") == "quorum"
        )
        # A quorum queue's consumers: tag -> [its limit, deliveries of it not settled yet]; and
        # each such delivery's consumer (``_await_in_flight``).
        self._credit: dict[str, list[int]] = {}
        self._consumer_of: dict[int, str] = {}
        self._qos_now = prefetch
        self._deliveries: collections.deque[TaskDelivery] = collections.deque()
        # How many of ``_deliveries`` each queue has, and whose was taken last: queues take turns.
        self._waiting: collections.Counter[str] = collections.Counter()
        self._last_queue: str | None = None
        self._checked = False  # check() was the last call: nothing to read before the next delivery
        self._looked = 0.0  # when check() last read
        self.paused = False  # no consumer, by pause_running(): resume() consumes again

    # -- connecting ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the first broker that answers, in failover order, and consume.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        url = self._open_first(self._open)
        self._start_beating()
        log.debug("feed_connected", connection=self._name, url=redact_url(url))

    def _open(self, url: str) -> None:
        # A new generation before the socket: what the consumes below deliver is this connection's.
        self.generation += 1
        self._held = 0
        self._unsettled = self._last_tag = self._retired_below = self._retired_left = 0
        self._limit = self._prefetch
        self._credit.clear()
        self._consumer_of.clear()
        self.paused = False
        tls = self._handshake(url)
        self._deliveries.clear()
        self._waiting.clear()
        self._checked = False
        self._open_channel(confirms=True)
        self._qos(self._prefetch)
        for spec in self._declare_on_connect:
            self._declare(spec)
        for queue in self._queues:
            self._consume(queue)
        self._set_wake(tls)

    # -- consuming -------------------------------------------------------------------------------

    def next_delivery(self, timeout_s: float | None) -> TaskDelivery | None:
        """The next delivery, waiting up to ``timeout_s`` (None: until one comes); None if none came.

        Raises:
            ConnectionLost: the connection failed, or the broker went silent past two heartbeats.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # First whatever came while a task ran, without waiting: a channel the broker closed
        # under that task (consumer_timeout) took back what was prefetched behind it, which may
        # run elsewhere already and must not run here as well (one select() when nothing came).
        if not self._checked:
            self._read_arrived()
        self._checked = False
        while not self._deliveries:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._pump()
        return self._next_in_turn()

    def _next_in_turn(self) -> TaskDelivery:
        # The next of what arrived, queues taking turns (FIFO within each): with a deep prefetch a
        # task of a quiet queue waits for one task of a busy queue, not for all the child holds
        # of it. One dict lookup when all that waits is of one queue.
        deliveries, head = self._deliveries, self._deliveries[0]
        if head.queue == self._last_queue and self._waiting[head.queue] < len(deliveries):
            for index, other in enumerate(deliveries):
                if other.queue != head.queue:
                    del deliveries[index]
                    return self._taken(other)
        return self._taken(deliveries.popleft())

    def _taken(self, delivery: TaskDelivery) -> TaskDelivery:
        self._waiting[delivery.queue] -= 1
        self._last_queue = delivery.queue
        return delivery

    def held(self) -> list[TaskDelivery]:
        """Deliveries no consumer has taken yet: read already, or (while a task runs) in the socket."""
        with self._lock:  # a task's start and end take it: while one runs nobody reads the socket
            return self._holding(peek=self._busy)

    def _holding(self, *, peek: bool) -> list[TaskDelivery]:
        sock, unparsed = self._sock if peek else None, bytes(self._buffer)
        tags = {**self._retired, **self._tags}
        peeked = [] if sock is None else peeked_deliveries(sock, unparsed, tags, self.generation)
        return [] if peeked is None else [*self._deliveries, *peeked]  # None: the broker took them back

    def check(self, delivery: TaskDelivery | None = None) -> None:
        """Handle what arrived meanwhile, without waiting: a close the broker sent raises here.

        While deliveries wait in hand and its last read is under ``_LOOK_AGAIN_S`` old, it does
        not read: a close that came within that millisecond is seen a few short tasks later, as
        one that comes during the next task is (the broker has those deliveries back; their
        copies come marked redelivered). After any task that ran longer, it reads.

        Raises:
            ConnectionLost: the connection failed, or the broker closed the channel.
        """
        now = time.monotonic()
        if not self._deliveries or now - self._looked >= _LOOK_AGAIN_S:
            self._looked = now
            self._read_arrived()
        # The consumer checks after each settle and asks for its next delivery right after: that
        # call need not look again (a select() per task saved).
        self._checked = True

    def hold(self, delta: int, generation: int) -> None:
        """``delta`` more (or fewer) unacked deliveries (parked copies); ignored for an older generation.

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        if generation == self.generation:
            self._held += delta
            self._resubscribe()

    @property
    def prefetch(self) -> int:
        """Unacked deliveries the broker may send this connection at once (parked copies aside)."""
        return self._prefetch

    def set_prefetch(self, prefetch: int) -> None:
        """Let the broker send up to ``prefetch`` unacked deliveries from now on.

        Raises:
            ConnectionLost: the connection failed meanwhile (a reconnect uses ``prefetch``).
        """
        if prefetch != self._prefetch:
            self._prefetch = prefetch
            self._resubscribe()

    @contextlib.contextmanager
    def paused_while_running(self, still: Callable[[], bool]) -> Iterator[list[TaskDelivery] | None]:
        """From another thread while a task runs: stop consuming; yields what was delivered and not
        taken, for the caller to settle inside the block.

        Yields None (nothing done) if no task runs now or ``still()`` says the moment has passed.
        The socket lock is held for the whole block, and the running thread takes it to leave its
        task, so it cannot read or write meanwhile. An ordered queue's consumer is never paused:
        the next one would become active with this connection's task unacked.

        Raises:
            ConnectionLost: the connection failed meanwhile (the running thread finds it gone).
        """
        with self._lock:
            if not self._busy or not still():
                yield None
                return
            yield self.pause()

    def pause(self) -> list[TaskDelivery] | None:
        """Stop consuming until ``resume()``; what was delivered and not taken (the caller settles
        it), or None if nothing was done (not connected, paused already, or an ordered queue's).

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        if self._sock is None or self.ordered or self.paused:
            return None
        self._cancel_consumers(list(self._tags))
        self.paused = True
        return self._take_all()

    def resume(self) -> None:
        """Consume again after ``pause_running``, at the prefetch set meanwhile.

        Raises:
            ConnectionLost: the connection failed meanwhile (a reconnect consumes anyway).
        """
        if self.paused and self._sock is not None:
            self._qos(self._prefetch + self._held)
            for queue in self._queues:
                self._consume(queue)
            self._limit = self._prefetch + self._held
        self.paused = False

    def catch_up(self) -> None:
        """Between tasks: once what cancelled consumers delivered is settled (parked copies aside),
        consume with the whole prefetch again (a resubscribe sized the newest consumers to what was
        outstanding).

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        if self._catch_up_due():
            self._resubscribe(whole=True)

    def _catch_up_due(self) -> bool:
        # Asked before every delivery: the test nearly always false (no resubscribe shrank the
        # limit) comes first. Then what cancelled consumers delivered is settled, but for parked
        # copies (the held count makes room for those already): a copy may stay parked as long as
        # its first run goes on.
        return (
            self._limit < self._prefetch + self._held
            and self._retired_left <= self._held
            and self._sock is not None
            and not self.paused
        )

    def _resubscribe(self, *, whole: bool = False) -> None:
        # basic.qos binds only the consumers made after it (RabbitMQ keeps each consumer's own
        # limit), so each queue gets a new consumer with the new limit, then the old one is
        # cancelled: nothing is requeued, what it delivered stays with us. The new limit leaves
        # out what is outstanding (the old consumers' deliveries no longer count against any
        # limit); ``whole`` (catch_up) once they are settled. An ordered queue keeps its one
        # consumer (its prefetch is 1 whatever this says): a new one would lose its turn.
        if self._sock is None:
            return
        target = self._prefetch + self._held
        limit = target if whole else max(1, target - self._unsettled)
        self._qos(limit)
        replaced = [tag for tag, queue in self._tags.items() if queue not in self._ordered]
        for tag in replaced:
            self._subscribe(self._tags[tag])
        self._cancel_consumers(replaced)
        self._limit = limit
        self._retired_below, self._retired_left = self._last_tag, self._unsettled

    def ack(self, delivery: TaskDelivery) -> None:
        """Ack ``delivery``; not sent if its connection is gone (the broker requeued it).

        Raises:
            ConnectionLost: the write failed.
        """
        self._settle_frame(delivery, self._ack_frame(delivery.tag))

    def ack_all(self, deliveries: Sequence[TaskDelivery]) -> None:
        """Ack each of ``deliveries`` in one write; those of a connection that is gone are not sent.

        Raises:
            ConnectionLost: the write failed.
        """
        acks = b"".join(self._ack_frame(delivery.tag) for delivery in deliveries if self._settling(delivery))
        if acks:
            self._write(acks)

    def nack(self, delivery: TaskDelivery, *, requeue: bool) -> None:
        """Nack ``delivery`` (back to its queue with ``requeue``); not sent if its connection is gone.

        Raises:
            ConnectionLost: the write failed.
        """
        self._settle_frame(delivery, self._nack_frame(delivery.tag, requeue=requeue))

    def _settle_frame(self, delivery: TaskDelivery, frame: bytes) -> None:
        # Written only on the connection that delivered it: a tag means nothing on another.
        if self._settling(delivery):
            self._write(frame)

    def _settling(self, delivery: TaskDelivery) -> bool:
        """Whether ``delivery``'s settle goes out on this connection; if so it is counted settled."""
        if not self._current(delivery):
            return False
        self._count_settled(delivery)
        return True

    def _count_settled(self, delivery: TaskDelivery) -> None:
        self._unsettled -= 1
        if delivery.tag <= self._retired_below:
            self._retired_left -= 1
        if self._consumer_of and (consumer := self._consumer_of.pop(delivery.tag, None)) is not None:
            if (credit := self._credit.get(consumer)) is not None:
                credit[1] -= 1

    def _current(self, delivery: TaskDelivery) -> bool:
        if delivery.generation == self.generation and self._sock is not None:
            return True
        log.info("task_settle_dropped_channel_gone", tag=delivery.tag, queue=delivery.queue)
        return False

    @property
    def queues(self) -> tuple[str, ...]:
        """The queues consumed (and consumed again after a reconnect)."""
        return self._queues

    def set_queues(self, queues: Sequence[str]) -> None:
        """Consume ``queues`` from now on: new ones are consumed, dropped ones cancelled.

        Deliveries already taken from a dropped queue stay with the caller.

        Raises:
            ConnectionLost: the connection failed meanwhile (a reconnect consumes ``queues``).
        """
        wanted = tuple(dict.fromkeys(queues))
        self._queues, before = wanted, set(self._tags.values())
        if self._sock is None or self.paused:  # resume() consumes them
            return
        self._cancel_consumers([tag for tag, queue in self._tags.items() if queue not in wanted])
        for queue in wanted:
            if queue not in before:
                self._consume(queue)

    @property
    def ordered(self) -> bool:
        """Whether an ordered queue is consumed: a stop then closes the connection, which requeues
        and moves the queue on in one step (handed back while subscribed, its delivery would come
        after the next one, which the broker gives the next consumer first)."""
        return any(queue in self._ordered for queue in self._queues)

    def _consume(self, queue: str) -> None:
        if queue in self._ordered and self._prefetch != 1:
            # basic.qos (per consumer) binds the consumers made after it: this one alone gets 1.
            self._qos(1)
            try:
                self._subscribe(queue)
            finally:
                self._qos(self._prefetch + self._held)
            return
        self._subscribe(queue)

    def cancel(self) -> list[TaskDelivery]:
        """Stop consuming; returns what was delivered and not taken yet (the caller hands it back).

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        self._cancel_consumers(list(self._tags))
        return self._take_all()

    def _cancel_consumers(self, tags: Sequence[str]) -> None:
        self._await_in_flight(tags)
        for tag in tags:
            self._unsubscribe(tag)
            self._credit.pop(tag, None)

    def _await_in_flight(self, tags: Iterable[str]) -> None:
        # Until each quorum queue consumer in ``tags`` holds its whole limit (the broker has no
        # place to send more), or nothing came for a quiet while (its queue has no more).
        short = [credit for tag in tags if (credit := self._credit.get(tag)) is not None]
        if not short:
            return
        self._read_arrived()
        deadline = time.monotonic() + _IN_FLIGHT_MAX_S
        while any(outstanding < limit for limit, outstanding in short):
            left = deadline - time.monotonic()
            if left <= 0 or not self._readable(min(_IN_FLIGHT_QUIET_S, left)):
                return
            self._read_arrived()

    def _readable(self, timeout_s: float) -> bool:
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        return bool(select.select([sock], [], [], timeout_s)[0])

    def _qos(self, count: int) -> None:
        super()._qos(count)
        self._qos_now = count

    def _subscribe(self, queue: str) -> str:
        tag = super()._subscribe(queue)
        if queue in self._quorum:
            self._credit[tag] = [self._qos_now, 0]
        return tag

    def _take_all(self) -> list[TaskDelivery]:
        left = list(self._deliveries)
        self._deliveries.clear()
        self._waiting.clear()
        return left

    def _on_deliver(self, payload: bytes) -> None:
        deliver = methods.parse_deliver(payload)
        properties, body = self._content()
        tag = deliver.consumer_tag
        queue = self._tags.get(tag) or self._retired.get(tag) or deliver.routing_key
        self._arrived(task_delivery(deliver, properties, body, queue, self.generation), tag)

    def _arrived(self, delivery: TaskDelivery, consumer: str) -> None:
        # A delivery read, for the consumer to take; counted by queue for their turns.
        self._deliveries.append(delivery)
        self._waiting[delivery.queue] += 1
        self._unsettled += 1
        self._last_tag = delivery.tag
        if (credit := self._credit.get(consumer)) is not None:
            credit[1] += 1
            self._consumer_of[delivery.tag] = consumer

    # -- publishing ------------------------------------------------------------------------------

    def publish(
        self, message: WireMessage, routing_key: str, *, exchange: str = "", declare: Sequence[QueueSpec] = ()
    ) -> None:
        """Publish (mandatory) and wait for the broker's confirm.

        Raises:
            Unroutable: no queue took it (returned).
            PublishNacked: the broker refused it.
            ConnectionLost: the connection failed, or no confirm came within ``confirm_timeout_s``.
        """
        try:
            self._publish(message, routing_key, exchange=exchange, declare=declare)
        except Unroutable:
            # A queue declared once on this connection may have been deleted since (a dead-letter
            # queue removed by hand): declare it again and send once more.
            stale = {spec.name for spec in declare} & self._declared
            if not stale:
                raise
            log.warning("feed_queue_declared_again", queues=sorted(stale))
            self._declared -= stale
            self._publish(message, routing_key, exchange=exchange, declare=declare)

    def _publish(
        self, message: WireMessage, routing_key: str, *, exchange: str, declare: Sequence[QueueSpec]
    ) -> None:
        for spec in declare:
            if spec.name not in self._declared:
                self._declare(spec)
        data = self._publish_frames(message, routing_key, exchange=exchange, mandatory=True)
        self._publish_confirmed(data, PendingPublish(exchange, routing_key, message.body), routing_key)

    def publish_all(self, messages: Sequence[tuple[WireMessage, str]]) -> None:
        """Publish each ``(message, queue)`` (mandatory, by the default exchange) in one write, and
        wait for all their confirms: one round trip, where ``publish`` each would take one apiece.

        Raises:
            Unroutable: no queue took one (returned).
            PublishNacked: the broker refused one.
            ConnectionLost: the connection failed, or a confirm did not come within ``confirm_timeout_s``.
        """
        self._publish_all_confirmed([
            (
                self._publish_frames(message, queue, exchange="", mandatory=True),
                PendingPublish("", queue, message.body),
                queue,
            )
            for message, queue in messages
        ])  # fmt: skip

    def publish_nowait(self, message: WireMessage, routing_key: str, *, exchange: str) -> None:
        """Publish without a confirm to wait for and not mandatory (events: best-effort).

        Raises:
            ConnectionLost: the write failed.
        """
        data = self._publish_frames(message, routing_key, exchange=exchange, mandatory=False)
        self._publish_unconfirmed(data)

    def _publish_frames(
        self, message: WireMessage, routing_key: str, *, exchange: str, mandatory: bool
    ) -> bytes:
        # Mandatory (results, copies): every property; best-effort (events, releases): these four.
        properties = (
            encode_properties(
                content_type=message.content_type, content_encoding=message.content_encoding,
                headers=message.headers, delivery_mode=message.delivery_mode, priority=message.priority,
                correlation_id=message.correlation_id, reply_to=message.reply_to,
                expiration=message.expiration,
            )
            if mandatory
            else encode_properties(
                content_type=message.content_type, content_encoding=message.content_encoding,
                headers=message.headers, delivery_mode=message.delivery_mode,
            )
        )  # fmt: skip
        return self._content_frames(
            properties, message.body, routing_key, exchange=exchange, mandatory=mandatory
        )
