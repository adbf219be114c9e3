"""The dedup gatekeeper: the worker that is a gate shard's active consumer decides each key's tasks.

A task sent with a dedup key waits in its key's gate shard (``topology.dedup_gate_queue``). Every
worker subscribes to every shard; each shard has a single active consumer, so one worker of the
cluster keeps a shard's keys at a time (``worker/single_active/gate_keys.py``). Its channel is transactional,
and each decision commits with the acks it implies:

- **accept**: the task goes to its queue stamped with a deadline, a head marker goes to the shard,
  and the arrival is acked, in one commit: the gate never sends a task without its marker;
- **block**: the arrival is held unacked, as the key's tail;
- **decline**: its caller gets ``DECLINED`` and the arrival is acked, in one commit;
- **release** (from the worker that ran the head, after its ack) or the deadline: the marker is
  acked and the tail, if any, sent on with its own marker, in one commit.

So what the gate knows is what the broker holds: unacked markers are the heads, unacked arrivals
the tails. A gate that dies hands them back; the next active consumer first publishes a sync
marker to itself and buffers what comes before it, then replays it as markers, releases, then
arrivals, and goes on live. Commits are batched: everything that arrived together commits once.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
    QueueSpec,
    dead_letter_queue,
    dedup_gate_queue,
)
from broker_svc.wire.dedup import (
    DEADLINE_HEADER,
    DEFAULT_DEDUP_TIMEOUT_S,
    GATE_SHARDS,
    KEY_HEADER,
    MAX_DEDUP_TIMEOUT_S,
    TARGET_QUEUE_HEADER,
    TIMEOUT_HEADER,
    GateMessage,
    deadline_header,
    eta_wait_s,
    gate_headers,
    gate_message,
    shard_of,
)
from broker_svc.wire.task_message import CLOCK_HEADER
from broker_svc.wire.task_state import StateRecord
from control.aio.declare import declare_queue
from worker.amqp.connection import one_time_channel
from worker.events import EventDispatcher
from worker.rules.deliveries import BROKER_COUNT_HEADER
from worker.single_active.declined import declined_record, declined_result, write_records
from worker.single_active.gate_keys import Ended, GateKeys, Verdict, Waiting
from worker.single_active.resubscribe import resubscribing

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["Gatekeeper"]

log = structlog.get_logger(__name__)

Message = aio_pika.abc.AbstractIncomingMessage
_BATCH: Final = 256  # deliveries decided per commit at most
_ERRORS_MODULE: Final = "broker_svc.errors"


@dataclass(slots=True)
class _Shard:
    """One shard's replay: until its sync marker comes back, deliveries wait in ``buffer``."""

    queue: str
    synced: bool = False
    token: str = ""
    buffer: list[Message] = field(default_factory=list)


class Gatekeeper:
    """Keeps the keys of the gate shards this worker is the active consumer of.

    Args:
        settings: the worker's settings (the declared type of the queues tasks are sent on to).
        clock: the worker's Lamport clock.
        hostname: names this worker in the state records it writes.
        events: sends a ``dedup-<decision>`` event per decision while task events are on.
        metrics: counts the decisions (``clockwork_dedup_decisions``), with ``--metrics-port``.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        clock: LamportClock,
        hostname: str,
        events: EventDispatcher | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._hostname = hostname
        self._events, self._metrics = events, metrics
        self._decisions: list[tuple[str, str, str]] = []  # told once their batch committed
        self.keys: GateKeys[Message] = GateKeys()
        self._shards = {
            s: _Shard(dedup_gate_queue(s, self._settings.namespace).name) for s in range(GATE_SHARDS)
        }
        self._inbox: asyncio.Queue[tuple[int, Message]] = asyncio.Queue()
        self._declared: set[str] = set()
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._records: list[StateRecord] = []  # DECLINED, written once their batch committed

    def stats(self) -> dict[str, Any]:
        """What ``inspect dedup`` shows: the shards this worker keeps, its keys and its counts."""
        return {
            "active_shards": sorted(s for s, shard in self._shards.items() if shard.synced),
            "keys": len(self.keys),
            "waiting": self.keys.waiting(),
            **self.keys.counts.as_dict(),
        }

    async def run(self, connect: Callable[[], Awaitable[aio_pika.abc.AbstractRobustConnection]]) -> None:
        """On a connection of the gate's own, subscribe to every shard, and again whenever the
        subscription is lost; until cancelled.

        Its own connection: workers that start together declare and consume the same new quorum
        queues at once, and RabbitMQ 3.10 may answer a consume that races a queue's start with a
        541 that closes the whole connection; the worker's control plane must not go with it.
        """
        connection = await connect()
        try:
            await resubscribing(
                lambda: self._serve(connection),
                forget=self._forget,
                log=log,
                event="dedup_gate_resubscribing",
            )
        finally:
            await connection.close()

    async def _received(self, shard: int, message: Message) -> None:
        self._inbox.put_nowait((shard, message))

    def _forget(self) -> None:
        self.keys.clear()
        self._shards = {
            s: _Shard(dedup_gate_queue(s, self._settings.namespace).name) for s in range(GATE_SHARDS)
        }
        self._inbox = asyncio.Queue()
        self._decisions.clear()  # decided in a transaction that never committed (handed back)
        self._records.clear()

    async def _serve(self, connection: aio_pika.abc.AbstractRobustConnection) -> bool:
        self._connection = connection
        # Not robust: reopened by aio-pika, it would consume beside ours, outside any transaction.
        channel = await one_time_channel(connection)
        records: aio_pika.abc.AbstractChannel | None = None
        try:
            await channel.set_qos(prefetch_count=0)  # heads and tails are held until they end
            underlay = await channel.get_underlay_channel()
            await underlay.tx_select()
            self._declared.clear()
            for shard in range(GATE_SHARDS):
                queue = await declare_queue(channel, dedup_gate_queue(shard, self._settings.namespace))
                await queue.consume(functools.partial(self._received, shard))
            log.info("dedup_gate_subscribed", shards=GATE_SHARDS)
            if self._settings.task_states:
                records = await one_time_channel(connection)
            deciding = asyncio.create_task(self._decide(underlay, records))
            try:
                await asyncio.wait(
                    [deciding, asyncio.ensure_future(underlay.closing)], return_when="FIRST_COMPLETED"
                )
            finally:
                deciding.cancel()
            if deciding.done() and not deciding.cancelled() and deciding.exception() is not None:
                log.warning("dedup_gate_failed", error=repr(deciding.exception()))
            return True
        finally:
            for each in (channel, records):
                if each is None or each.is_closed:
                    continue
                try:
                    async with asyncio.timeout(5):
                        await each.close()
                except Exception as exc:  # closing a channel of a lost connection
                    log.debug("dedup_gate_channel_close_failed", error=str(exc))

    # -- the loop: take what arrived, decide, commit -----------------------------------------------

    async def _decide(
        self, channel: aiormq.abc.AbstractChannel, records: aio_pika.abc.AbstractChannel | None
    ) -> None:
        while True:
            deadline = self.keys.next_deadline()
            wait_s = None if deadline is None else max(0.0, deadline - time.time())
            batch: list[tuple[int, Message]] = []
            try:
                batch.append(await asyncio.wait_for(self._inbox.get(), timeout=wait_s))
            except TimeoutError:
                pass
            while batch and len(batch) < _BATCH and not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            dirty = False
            for shard, message in batch:
                dirty = await self._take(channel, shard, message) or dirty
            for ended in self.keys.expired(time.time()):
                log.warning("dedup_head_evicted", key=ended.key, task_id=ended.task_id)
                self._decided("evicted", ended.task_id, ended.key)
                await self._ended(channel, ended)
                dirty = True
            if dirty:
                await channel.tx_commit()
            # Facts only now, once committed (a failed commit raised; ``_forget`` drops them).
            decisions, self._decisions = self._decisions, []
            written, self._records = self._records, []
            if written and records is not None:
                await write_records(records, written, self._settings.namespace)
            if decisions:
                await self._tell(decisions)

    async def _take(self, channel: aiormq.abc.AbstractChannel, shard: int, message: Message) -> bool:
        # One delivery; True if it published or acked anything (the batch must commit).
        state = self._shards[shard]
        own = gate_message(message.headers)
        if state.synced:
            await self._apply(channel, shard, message, own)
            return True
        if own is not None and own.kind == "sync" and own.token == state.token:
            await message.ack()
            await self._replay(channel, shard, state)
            return True
        state.buffer.append(message)
        if state.token:
            return False
        # The broker made us this shard's active consumer: what it holds for us arrives before
        # our own sync marker, which it queues behind them.
        state.token = uuid.uuid4().hex
        await self._publish(channel, state.queue, b"", gate_headers(GateMessage("sync", token=state.token)))
        return True

    async def _replay(self, channel: aiormq.abc.AbstractChannel, shard: int, state: _Shard) -> None:
        # Markers make the heads, releases end them, then arrivals meet the heads as they are.
        buffered = [(gate_message(m.headers), m) for m in state.buffer]
        state.buffer, state.synced = [], True
        log.info("dedup_gate_active", shard=shard, replayed=len(buffered))
        order = {"head": 0, "release": 1, "sync": 2}
        buffered.sort(key=lambda pair: 3 if pair[0] is None else order[pair[0].kind])
        for own, message in buffered:
            await self._apply(channel, shard, message, own)

    async def _apply(
        self, channel: aiormq.abc.AbstractChannel, shard: int, message: Message, own: GateMessage | None
    ) -> None:
        if own is None:
            await self._arrival(channel, shard, message)
        elif own.kind == "head":
            if not self.keys.marker(own.key, own.task_id, message, deadline=own.deadline):
                await message.ack()  # its head ended before it came back
        elif own.kind == "release":
            await message.ack()
            ended = self.keys.release(own.key, own.task_id, now=time.time())
            if ended is not None:
                self._decided("released", own.task_id, own.key)
                await self._ended(channel, ended)
        else:
            await message.ack()  # another gate's sync marker, from before we took over

    async def _arrival(self, channel: aiormq.abc.AbstractChannel, shard: int, message: Message) -> None:
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
            await self._dead_letter(channel, shard, message, "no id, dedup key, target queue or timeout")
            return
        # A head's safety timeout runs from its ETA (the client keeps the sum under the cap).
        timeout_s = min(float(timeout_s) + eta_wait_s(headers), MAX_DEDUP_TIMEOUT_S)
        verdict = self.keys.arrive(key, task_id, message, timeout_s=timeout_s, now=time.time())
        self._decided(verdict.value, task_id, key)
        if verdict is Verdict.ACCEPT:
            head = self.keys.head_of(key)
            assert head == task_id
            await self._send_on(channel, key, Waiting(task_id, message, timeout_s), time.time() + timeout_s)
        elif verdict is Verdict.DECLINE:
            await self._decline(channel, message, task_id, key)
            await message.ack()
            record = declined_record(
                task_id, key, headers, queue=target, clock=self._clock.forward(), hostname=self._hostname
            )
            self._records.append(record)
        elif verdict is Verdict.DUPLICATE:
            await message.ack()  # the copy the gate keeps is the first one
        # BLOCK: held unacked as the key's tail

    async def _ended(self, channel: aiormq.abc.AbstractChannel, ended: Ended[Message]) -> None:
        if ended.marker is not None:
            await ended.marker.ack()
        if ended.promoted is not None:
            self._decided("promoted", ended.promoted.task_id, ended.key)
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
            delivery_mode=2, priority=message.priority, correlation_id=message.correlation_id,
            reply_to=message.reply_to,
        )  # fmt: skip
        await channel.basic_publish(message.body, exchange="", routing_key=target, properties=properties)
        marker = GateMessage("head", key=key, task_id=task.task_id, deadline=deadline)
        await self._publish(channel, self._shards[shard_of(key)].queue, b"", gate_headers(marker))
        await message.ack()

    async def _ensure(self, queue: QueueSpec) -> None:
        # Declared on a channel of its own: a queue that exists with other arguments (a 406)
        # closes that channel, not the gate's transaction. It exists, which is all the gate needs.
        if queue.name in self._declared or self._connection is None:
            return
        try:
            async with await one_time_channel(self._connection) as side:
                await declare_queue(side, queue)
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            log.warning("dedup_queue_declared_otherwise", queue=queue.name, error=str(exc))
        self._declared.add(queue.name)

    async def _decline(
        self, channel: aiormq.abc.AbstractChannel, message: Message, task_id: str, key: str
    ) -> None:
        if not message.reply_to:
            return
        body, ctype, encoding = declined_result(task_id, key, message.headers or {}, message.content_type)
        properties = spec.Basic.Properties(
            content_type=ctype, content_encoding=encoding, correlation_id=task_id, delivery_mode=2,
            headers={CLOCK_HEADER: self._clock.forward()},
        )  # fmt: skip
        await channel.basic_publish(body, exchange="", routing_key=message.reply_to, properties=properties)

    async def _dead_letter(
        self, channel: aiormq.abc.AbstractChannel, shard: int, message: Message, why: str
    ) -> None:
        log.error("dedup_arrival_refused", why=why, size=len(message.body))
        dead = dead_letter_queue(self._shards[shard].queue)
        await self._ensure(dead)
        queue = self._shards[shard].queue
        headers = {**(message.headers or {}), DEAD_LETTER_REASON_HEADER: why, DEAD_LETTER_QUEUE_HEADER: queue}
        properties = spec.Basic.Properties(
            content_type=message.content_type, content_encoding=message.content_encoding, headers=headers,
            delivery_mode=2, correlation_id=message.correlation_id, reply_to=message.reply_to,
        )  # fmt: skip
        await channel.basic_publish(message.body, exchange="", routing_key=dead.name, properties=properties)
        await message.ack()

    async def _publish(
        self, channel: aiormq.abc.AbstractChannel, queue: str, body: bytes, headers: dict[str, Any]
    ) -> None:
        properties = spec.Basic.Properties(
            delivery_mode=2, headers={**headers, CLOCK_HEADER: self._clock.forward()}
        )
        await channel.basic_publish(body, exchange="", routing_key=queue, properties=properties)

    def _decided(self, what: str, task_id: str, key: str) -> None:
        log.debug("dedup_decided", decision=what, task_id=task_id, key=key)
        self._decisions.append((what, task_id, key))

    async def _tell(self, decisions: list[tuple[str, str, str]]) -> None:
        for what, task_id, key in decisions:
            if self._metrics is not None:
                self._metrics.dedup(what)
            if self._events is not None and self._events.task_events:
                await self._events.send(f"dedup-{what}", uuid=task_id, key=key)
