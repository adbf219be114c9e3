"""One dedup gate shard as a worker keeps it: its subscription, its keys, its transaction, its replay.

Each shard queue has a single active consumer; this worker's subscription to it is a ``GateShard``
on a transactional channel of its own (``Gatekeeper`` keeps one per shard). While the broker makes
it the shard's active consumer it decides the shard's keys, each decision committed with the acks
it implies:

- **accept**: the task goes to its queue stamped with a deadline, a head marker goes to the shard,
  and the arrival is acked, in one commit: the gate never sends a task without its marker;
- **block**: the arrival is held unacked, as the key's tail;
- **decline**: its caller gets ``DECLINED`` and the arrival is acked, in one commit;
- **release** (from the worker that ran the head, after its ack) or the deadline: the marker is
  acked and the tail, if any, sent on with its own marker, in one commit.

The ``dedup-*`` event of each decision and the ``DECLINED`` state record are published in the
same commit, so a gate killed after it committed has told everything it decided, and one killed
before it told nothing (the next gate decides again, and tells).

So what the gate knows is what the broker holds: unacked markers are the heads, unacked arrivals
the tails. A subscription that ends (the worker died, its channel closed, or it handed the shard
over) hands them back; the next active consumer first publishes a sync marker to itself and
buffers what comes before it, then replays it as markers, releases, then arrivals, and goes on
live. Commits are batched: everything that arrived together commits once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import aio_pika
import aio_pika.abc
import aiormq.abc
import structlog
from aiormq import spec

from broker_svc.clock import LamportClock
from broker_svc.settings import Settings
from broker_svc.topology import (
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DEFAULT_EXCHANGE,
    QueueSpec,
    dead_letter_queue,
    event_exchange,
    task_states_stream,
)
from broker_svc.wire.records.dedup import (
    DEADLINE_HEADER,
    DEFAULT_DEDUP_TIMEOUT_S,
    KEY_HEADER,
    MAX_DEDUP_TIMEOUT_S,
    TARGET_QUEUE_HEADER,
    TIMEOUT_HEADER,
    GateMessage,
    deadline_header,
    eta_wait_s,
    gate_headers,
    gate_message,
)
from broker_svc.wire.task.task_message import CLOCK_HEADER
from control.aio.declare import declare_queue
from worker.amqp.connection import one_time_channel
from worker.events import EventDispatcher
from worker.rules.deliveries import BROKER_COUNT_HEADER
from worker.single_active.declined import declined_record, declined_result
from worker.single_active.gate_keys import Ended, GateCounts, GateKeys, Verdict, Waiting

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["GateShard", "ShardLost"]

log = structlog.get_logger(__name__)

Message = aio_pika.abc.AbstractIncomingMessage
Ensure = Callable[[QueueSpec], Awaitable[None]]
_BATCH: Final = 256  # deliveries decided per commit at most
_PERSISTENT: Final = 2


class ShardLost(Exception):
    """A shard's subscription ended without being asked to (its channel closed or failed)."""


@dataclass(frozen=True, slots=True)
class _Told:
    """A fact about a decision (an event, a state record), published in the decision's commit."""

    exchange: str
    routing_key: str
    body: bytes
    properties: spec.Basic.Properties


class GateShard:
    """This worker's subscription to one gate shard, and the shard's keys while it is active.

    Args:
        shard: the shard's number.
        queue: the shard's queue.
        settings: the worker's settings (the declared type of the queues tasks are sent on to).
        clock: the worker's Lamport clock.
        hostname: names this worker in the state records it writes.
        counts: the worker's decision counts, shared by its shards.
        ensure: declares a queue the gate sends to, once per subscription.
        events: sends a ``dedup-<decision>`` event per decision while task events are on.
        metrics: counts the decisions (``clockwork_dedup_decisions``), with ``--metrics-port``.
    """

    def __init__(
        self,
        shard: int,
        *,
        queue: QueueSpec,
        settings: Settings,
        clock: LamportClock,
        hostname: str,
        counts: GateCounts,
        ensure: Ensure,
        events: EventDispatcher | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.shard = shard
        self.queue = queue
        self._settings, self._clock, self._hostname = settings, clock, hostname
        self._ensure, self._events, self._metrics = ensure, events, metrics
        self.keys: GateKeys[Message] = GateKeys(counts=counts)
        self.synced_at: float | None = None  # monotonic: when our sync marker came back
        self._token = ""
        self._buffer: list[Message] = []
        self._inbox: asyncio.Queue[Message | None] = asyncio.Queue()  # None: wakes it to leave
        self._leaving = False
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._told: list[_Told] = []  # facts of the batch, published before its commit
        self._decided: list[str] = []  # counted in the metrics once their batch committed

    @property
    def synced(self) -> bool:
        """Whether this subscription is the shard's active gate and has replayed what it held."""
        return self.synced_at is not None

    async def subscribe(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        """Subscribe on a transactional channel of its own (behind any earlier subscriber).

        Raises:
            aio_pika.exceptions.AMQPError: the channel or the subscription failed.
        """
        # Not robust: reopened by aio-pika, it would consume beside ours, outside any transaction.
        self._channel = channel = await one_time_channel(connection)
        await channel.set_qos(prefetch_count=0)  # heads and tails are held until they end
        underlay = await channel.get_underlay_channel()
        await underlay.tx_select()
        if self._events is not None:
            # The events go out in our commits: an exchange that is missing would close this channel.
            exchange = event_exchange()
            await channel.declare_exchange(
                exchange.name, type=aio_pika.ExchangeType(exchange.type), durable=exchange.durable
            )
        queue = await declare_queue(channel, self.queue)
        await queue.consume(self._received)

    async def run(self) -> None:
        """Decide until asked to ``leave`` (then return at the end of a batch).

        Raises:
            ShardLost: the channel closed or failed first.
        """
        assert self._channel is not None, "subscribe first"
        underlay = await self._channel.get_underlay_channel()
        deciding = asyncio.create_task(self._decide(underlay))
        try:
            await asyncio.wait(
                [deciding, asyncio.ensure_future(underlay.closing)], return_when="FIRST_COMPLETED"
            )
        finally:
            deciding.cancel()
        if deciding.done() and not deciding.cancelled():
            if (error := deciding.exception()) is None:
                return
            raise ShardLost(f"shard {self.shard}: {type(error).__name__}: {error}") from error
        raise ShardLost(f"shard {self.shard}: its channel closed")

    def leave(self) -> None:
        """Stop deciding at the end of the batch under way; what it holds stays unacked."""
        self._leaving = True
        self._inbox.put_nowait(None)

    async def close(self) -> None:
        """Close the channel: the broker takes back what it held and moves on to the next subscriber."""
        channel, self._channel = self._channel, None
        if channel is None or channel.is_closed:
            return
        try:
            async with asyncio.timeout(5):
                await channel.close()
        except Exception as exc:  # closing a channel of a lost connection
            log.debug("dedup_gate_channel_close_failed", shard=self.shard, error=str(exc))

    async def _received(self, message: Message) -> None:
        self._inbox.put_nowait(message)

    # -- the loop: take what arrived, decide, commit -----------------------------------------------

    async def _decide(self, channel: aiormq.abc.AbstractChannel) -> None:
        while True:
            deadline = self.keys.next_deadline()
            wait_s = None if deadline is None else max(0.0, deadline - time.time())
            batch: list[Message] = []
            try:
                first = await asyncio.wait_for(self._inbox.get(), timeout=wait_s)
                batch += [first] if first is not None else []
            except TimeoutError:
                pass
            while len(batch) < _BATCH and not self._inbox.empty():
                if (more := self._inbox.get_nowait()) is not None:
                    batch.append(more)
            if self._leaving:
                return  # between commits: what it took stays unacked, handed back with the channel
            dirty = False
            for message in batch:
                dirty = await self._take(channel, message) or dirty
            for ended in self.keys.expired(time.time()):
                log.warning("dedup_head_evicted", key=ended.key, task_id=ended.task_id)
                self._decide_to("evicted", ended.task_id, ended.key)
                await self._ended(channel, ended)
                dirty = True
            if not dirty:
                continue
            told, self._told = self._told, []
            for fact in told:
                await channel.basic_publish(
                    fact.body,
                    exchange=fact.exchange,
                    routing_key=fact.routing_key,
                    properties=fact.properties,
                )
            await channel.tx_commit()
            # Counted only now, once committed (a failed commit raised; the next gate decides again).
            decided, self._decided = self._decided, []
            if self._metrics is not None:
                for what in decided:
                    self._metrics.dedup(what)

    async def _take(self, channel: aiormq.abc.AbstractChannel, message: Message) -> bool:
        # One delivery; True if it published or acked anything (the batch must commit).
        own = gate_message(message.headers)
        if self.synced:
            await self._apply(channel, message, own)
            return True
        if own is not None and own.kind == "sync" and own.token == self._token:
            await message.ack()
            await self._replay(channel)
            return True
        self._buffer.append(message)
        if self._token:
            return False
        # The broker made us this shard's active consumer: what it holds for us arrives before
        # our own sync marker, which it queues behind them.
        self._token = uuid.uuid4().hex
        await self._publish(channel, b"", gate_headers(GateMessage("sync", token=self._token)))
        return True

    async def _replay(self, channel: aiormq.abc.AbstractChannel) -> None:
        # Markers make the heads, releases end them, then arrivals meet the heads as they are.
        buffered = [(gate_message(m.headers), m) for m in self._buffer]
        self._buffer, self.synced_at = [], time.monotonic()
        log.debug("dedup_gate_active", shard=self.shard, replayed=len(buffered))
        order = {"head": 0, "release": 1, "sync": 2}
        buffered.sort(key=lambda pair: 3 if pair[0] is None else order[pair[0].kind])
        for own, message in buffered:
            await self._apply(channel, message, own)

    async def _apply(
        self, channel: aiormq.abc.AbstractChannel, message: Message, own: GateMessage | None
    ) -> None:
        if own is None:
            await self._arrival(channel, message)
        elif own.kind == "head":
            if not self.keys.marker(own.key, own.task_id, message, deadline=own.deadline):
                await message.ack()  # its head ended before it came back
        elif own.kind == "release":
            await message.ack()
            ended = self.keys.release(own.key, own.task_id, now=time.time())
            if ended is not None:
                self._decide_to("released", own.task_id, own.key)
                await self._ended(channel, ended)
        else:
            await message.ack()  # another gate's sync marker: from before we took over, or a wake-up

    async def _arrival(self, channel: aiormq.abc.AbstractChannel, message: Message) -> None:
        headers = message.headers or {}
        task_id, key = headers.get("id"), headers.get(KEY_HEADER)
        target, timeout_s = (
            headers.get(TARGET_QUEUE_HEADER),
            headers.get(TIMEOUT_HEADER, DEFAULT_DEDUP_TIMEOUT_S),
        )
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not timeout_s > 0:
            timeout_s = -1.0
        if (
            not isinstance(task_id, str)
            or not isinstance(key, str)
            or not isinstance(target, str)
            or timeout_s < 0
        ):
            await self._dead_letter(channel, message, "no id, dedup key, target queue or timeout")
            return
        # Its sender's clock: our DECLINED record must sort after the sender's QUEUED one.
        self._clock.adjust(headers.get(CLOCK_HEADER))
        # A head's safety timeout runs from its ETA (the client keeps the sum under the cap).
        timeout_s = min(float(timeout_s) + eta_wait_s(headers), MAX_DEDUP_TIMEOUT_S)
        verdict = self.keys.arrive(key, task_id, message, timeout_s=timeout_s, now=time.time())
        self._decide_to(verdict.value, task_id, key)
        if verdict is Verdict.ACCEPT:
            head = self.keys.head_of(key)
            assert head == task_id
            await self._send_on(channel, key, Waiting(task_id, message, timeout_s), time.time() + timeout_s)
        elif verdict is Verdict.DECLINE:
            await self._decline(channel, message, task_id, key)
            await message.ack()
            if self._settings.task_states:
                record = declined_record(
                    task_id, key, headers, queue=target, clock=self._clock.forward(), hostname=self._hostname
                )
                wire = record.wire()
                properties = spec.Basic.Properties(
                    content_type=wire.content_type, content_encoding=wire.content_encoding,
                    headers=dict(wire.headers), delivery_mode=wire.delivery_mode,
                )  # fmt: skip
                stream = task_states_stream(self._settings.namespace)
                self._told.append(_Told(DEFAULT_EXCHANGE, stream.name, wire.body, properties))
        elif verdict is Verdict.DUPLICATE:
            await message.ack()  # the copy the gate keeps is the first one
        # BLOCK: held unacked as the key's tail

    async def _ended(self, channel: aiormq.abc.AbstractChannel, ended: Ended[Message]) -> None:
        if ended.marker is not None:
            await ended.marker.ack()
        if ended.promoted is not None:
            self._decide_to("promoted", ended.promoted.task_id, ended.key)
            await self._send_on(channel, ended.key, ended.promoted, ended.deadline)

    async def _send_on(
        self, channel: aiormq.abc.AbstractChannel, key: str, task: Waiting[Message], deadline: float
    ) -> None:
        # The task to its queue with its deadline, its head marker to the shard, its arrival acked.
        message = task.message
        # Not the shard queue's count of gates that held it: the task's first delivery is to come.
        headers = {k: v for k, v in (message.headers or {}).items() if k != BROKER_COUNT_HEADER}
        target = str(headers[TARGET_QUEUE_HEADER])
        await self._ensure(self._settings.task_queue(target))
        headers[DEADLINE_HEADER] = deadline_header(deadline)
        headers[CLOCK_HEADER] = self._clock.forward()
        properties = spec.Basic.Properties(
            content_type=message.content_type, content_encoding=message.content_encoding, headers=headers,
            delivery_mode=_PERSISTENT, priority=message.priority, correlation_id=message.correlation_id,
            reply_to=message.reply_to,
        )  # fmt: skip
        await channel.basic_publish(message.body, exchange="", routing_key=target, properties=properties)
        marker = GateMessage("head", key=key, task_id=task.task_id, deadline=deadline)
        await self._publish(channel, b"", gate_headers(marker))
        await message.ack()

    async def _decline(
        self, channel: aiormq.abc.AbstractChannel, message: Message, task_id: str, key: str
    ) -> None:
        if not message.reply_to:
            return
        body, ctype, encoding = declined_result(task_id, key, message.headers or {}, message.content_type)
        properties = spec.Basic.Properties(
            content_type=ctype, content_encoding=encoding, correlation_id=task_id, delivery_mode=_PERSISTENT,
            headers={CLOCK_HEADER: self._clock.forward()},
        )  # fmt: skip
        await channel.basic_publish(body, exchange="", routing_key=message.reply_to, properties=properties)

    async def _dead_letter(self, channel: aiormq.abc.AbstractChannel, message: Message, why: str) -> None:
        log.error("dedup_arrival_refused", why=why, size=len(message.body))
        dead = dead_letter_queue(self.queue.name)
        await self._ensure(dead)
        headers = {**(message.headers or {}), DEAD_LETTER_REASON_HEADER: why}
        headers[DEAD_LETTER_QUEUE_HEADER] = self.queue.name
        properties = spec.Basic.Properties(
            content_type=message.content_type, content_encoding=message.content_encoding, headers=headers,
            delivery_mode=_PERSISTENT, correlation_id=message.correlation_id, reply_to=message.reply_to,
        )  # fmt: skip
        await channel.basic_publish(message.body, exchange="", routing_key=dead.name, properties=properties)
        await message.ack()

    async def _publish(
        self, channel: aiormq.abc.AbstractChannel, body: bytes, headers: dict[str, Any]
    ) -> None:
        # One of the gate's own messages, to its shard.
        properties = spec.Basic.Properties(
            delivery_mode=_PERSISTENT, headers={**headers, CLOCK_HEADER: self._clock.forward()}
        )
        await channel.basic_publish(body, exchange="", routing_key=self.queue.name, properties=properties)

    def _decide_to(self, what: str, task_id: str, key: str) -> None:
        log.debug("dedup_decided", decision=what, task_id=task_id, key=key, shard=self.shard)
        self._decided.append(what)
        if self._events is not None and self._events.task_events:
            routing_key, event = self._events.message(f"dedup-{what}", uuid=task_id, key=key)
            self._told.append(_Told(event_exchange().name, routing_key, event.body, event.properties))
