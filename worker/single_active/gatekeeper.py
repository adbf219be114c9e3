"""The dedup gatekeeper: this worker's subscriptions to the gate shards, spread over the live workers.

A task sent with a dedup key waits in its key's gate shard (``topology.dedup_gate_queue``), a
queue with a single active consumer. Every worker subscribes to every shard, each subscription a
``GateShard`` (``worker/single_active/gate_shard.py``) on a transactional channel of its own, so
the broker always has a worker to hand a shard to: the first subscriber is active, the others
wait in line, and when the active one goes the next one replays what it held.

Which worker should be active on a shard is decided from the live workers (the members stream,
followed by ``AsyncMembersFeed``): ``shard_owners`` spreads the eight shards over them, the same
way on every worker. Each worker checks every second, once its view of the members has been the
same for a second:

- active on a shard it does not own, and active for at least the hold (``HandoverPacing``), it
  **hands the shard over**: it subscribes again (at the back of the line), stops deciding at the
  end of a batch, closes the old subscription's channel — the broker takes back every marker and
  tail it held, uncommitted decisions roll back, and the next in line becomes active and replays,
  exactly as when a gate dies — and publishes a sync marker to the shard, which wakes the new
  active gate if the shard was idle (it learns it is active from a first delivery);
- owning a shard it is not active on, it **pings** the shard (a sync marker, every few seconds):
  whichever worker is active learns it is, and hands the shard on if it is not the owner.

So a shard moves one worker down the line at a time until its owner is active, and never without
an active consumer. When views differ (a worker joining or dying is seen a second apart), two
workers may each think the other owns a shard; the pacing doubles the hold each time a worker
hands the same shard over again, so that ends once the views agree.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import structlog
from aiormq import spec

from broker_svc.clock import LamportClock
from broker_svc.settings import Settings
from broker_svc.topology import DEFAULT_NAMESPACE, LEGACY_NAMESPACE, QueueSpec, dedup_gate_queue
from broker_svc.wire.records.dedup import GATE_SHARDS, GateMessage, gate_headers
from broker_svc.wire.task.task_message import CLOCK_HEADER
from control.aio.declare import declare_queue
from control.aio.members_feed import AsyncMembersFeed
from control.protocol.membership import Membership
from worker.amqp.connection import one_time_channel
from worker.events import SW_IDENT, EventDispatcher
from worker.rules.shard_owners import HandoverPacing, shard_owners
from worker.single_active.gate_keys import GateCounts
from worker.single_active.gate_shard import GateShard
from worker.single_active.resubscribe import resubscribing

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["Gatekeeper"]

log = structlog.get_logger(__name__)

CHECK_S: Final = 1.0  # how often the owners are computed again
STABLE_S: Final = 1.0  # how long a view of the members must hold before shards move by it
PING_S: Final = 3.0  # how often an owner that is not active pings its shard


class Gatekeeper:
    """Keeps this worker's subscriptions to the gate shards, and its share of them active.

    Args:
        settings: the worker's settings (the declared type of the queues tasks are sent on to).
        clock: the worker's Lamport clock.
        hostname: names this worker among the members, and in the state records it writes.
        namespace: the control namespace, whose members stream tells the live workers (those of
            this worker's app namespace keep its shards).
        events: sends a ``dedup-<decision>`` event per decision while task events are on.
        metrics: counts the decisions (``clockwork_dedup_decisions``), with ``--metrics-port``.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        clock: LamportClock,
        hostname: str,
        namespace: str = DEFAULT_NAMESPACE,
        events: EventDispatcher | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._hostname = hostname
        self._namespace = namespace
        self._events, self._metrics = events, metrics
        self.counts = GateCounts()
        self._shards: dict[int, GateShard] = {}
        self._declared: set[str] = set()
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._side: aio_pika.abc.AbstractChannel | None = None  # pings
        self._group: asyncio.TaskGroup | None = None
        self._membership = Membership()
        self._view: frozenset[str] = frozenset({hostname})
        self._view_since = time.monotonic()
        self._owners: dict[int, str] = shard_owners(self._view, GATE_SHARDS)
        self._pacing = HandoverPacing()
        self._pinged: dict[int, float] = {}

    def stats(self) -> dict[str, Any]:
        """What ``inspect dedup`` shows: the shards this worker keeps and owns, its keys and counts."""
        shards = list(self._shards.values())
        return {
            "active_shards": sorted(s.shard for s in shards if s.synced),
            "owned_shards": sorted(s for s, owner in self._owners.items() if owner == self._hostname),
            "members": sorted(self._view),
            "keys": sum(len(s.keys) for s in shards),
            "waiting": sum(s.keys.waiting() for s in shards),
            **self.counts.as_dict(),
        }

    async def run(self, connect: Callable[[], Awaitable[aio_pika.abc.AbstractRobustConnection]]) -> None:
        """On a connection of the gate's own, subscribe to every shard and keep this worker's share
        of them, subscribing again whenever the subscriptions are lost; until cancelled.

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

    def _forget(self) -> None:
        self._shards = {}  # their channels closed: the broker took back what they held
        self._pinged.clear()

    def _queue(self, shard: int) -> QueueSpec:
        return dedup_gate_queue(shard, self._settings.namespace)

    def _new_shard(self, shard: int) -> GateShard:
        return GateShard(
            shard, queue=self._queue(shard), settings=self._settings, clock=self._clock,
            hostname=self._hostname, counts=self.counts, ensure=self._ensure, events=self._events,
            metrics=self._metrics,
        )  # fmt: skip

    async def _serve(self, connection: aio_pika.abc.AbstractRobustConnection) -> bool:
        self._connection = connection
        self._declared.clear()
        members: aio_pika.abc.AbstractChannel | None = None
        try:
            self._side = await one_time_channel(connection)
            for shard in range(GATE_SHARDS):
                self._shards[shard] = self._new_shard(shard)
                await self._shards[shard].subscribe(connection)
            log.debug("dedup_gate_subscribed", shards=GATE_SHARDS)
            members = await self._follow_members(connection)
            try:
                async with asyncio.TaskGroup() as group:
                    self._group = group
                    for each in self._shards.values():
                        group.create_task(self._keep(each))
                    if members is not None:
                        group.create_task(self._balance())
            except* Exception as failed:  # a shard's channel, a handover's subscribe: all subscribe again
                first = failed.exceptions[0]
                log.warning("dedup_gate_failed", error=f"{type(first).__name__}: {first}")
            return True
        finally:
            self._group = None
            for each in list(self._shards.values()):
                await each.close()
            for channel in (members, self._side):
                if channel is not None and not channel.is_closed:
                    try:
                        async with asyncio.timeout(5):
                            await channel.close()
                    except Exception as exc:  # closing a channel of a lost connection
                        log.debug("dedup_gate_channel_close_failed", error=str(exc))

    async def _follow_members(
        self, connection: aio_pika.abc.AbstractRobustConnection
    ) -> aio_pika.abc.AbstractChannel | None:
        # Without the members stream this worker sees itself alone: it keeps whatever the broker
        # gives it, as every worker did before shards were spread.
        channel = await one_time_channel(connection)
        self._membership = Membership()
        feed = AsyncMembersFeed(self._membership, namespace=self._namespace, accept=self._keeps_our_gate)
        try:
            await feed.follow(channel)
        except aio_pika.exceptions.AMQPError as exc:
            log.warning("dedup_gate_members_unavailable", error=str(exc))
            return None
        return channel

    def _keeps_our_gate(self, event: Mapping[str, Any]) -> bool:
        # Clockwork workers of our app namespace subscribe to our shards; a Celery worker, or one
        # of another app in this vhost, never does (an event without it: a release before them).
        namespace = event.get("app_namespace", LEGACY_NAMESPACE)
        return event.get("sw_ident") == SW_IDENT and namespace == self._settings.namespace

    async def _keep(self, shard: GateShard) -> None:
        # One subscription's life: decide until it leaves (handed over) or is lost (raises).
        try:
            await shard.run()
        finally:
            await shard.close()
        if self._shards.get(shard.shard) is not shard:  # handed over: wake whoever is active now
            await self._ping(shard.shard)

    # -- spreading the shards ------------------------------------------------------------------------

    async def _balance(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            now = time.monotonic()
            view = frozenset(self._membership.alive(time.time()) | {self._hostname})
            if view != self._view:
                log.info("dedup_gate_members", members=sorted(view))
                self._view, self._view_since = view, now
            if now - self._view_since < STABLE_S:
                continue
            self._owners = shard_owners(self._view, GATE_SHARDS)
            for number, shard in list(self._shards.items()):
                owner = self._owners[number]
                if owner == self._hostname:
                    if not shard.synced and now - self._pinged.get(number, 0.0) >= PING_S:
                        self._pinged[number] = now
                        await self._ping(number)
                elif shard.synced_at is not None and now - shard.synced_at >= self._pacing.hold(number, now):
                    await self._hand_over(shard, owner, now)

    async def _hand_over(self, shard: GateShard, owner: str, now: float) -> None:
        # Back of the line first, so this worker stays a subscriber throughout.
        assert self._connection is not None and self._group is not None
        log.info("dedup_gate_handover", shard=shard.shard, owner=owner, keys=len(shard.keys))
        self._pacing.handed_over(shard.shard, now)
        self._pinged.pop(shard.shard, None)
        successor = self._new_shard(shard.shard)
        await successor.subscribe(self._connection)
        self._shards[shard.shard] = successor
        self._group.create_task(self._keep(successor))
        shard.leave()  # its _keep closes its channel, then pings

    async def _ping(self, shard: int) -> None:
        # A sync marker nobody waits for: the active gate acks it, or learns from it that it is active.
        if self._side is None or self._side.is_closed:
            return
        marker = gate_headers(GateMessage("sync", token=f"ping-{self._hostname}"))
        properties = spec.Basic.Properties(
            delivery_mode=2, headers={**marker, CLOCK_HEADER: self._clock.forward()}
        )
        try:
            underlay = await self._side.get_underlay_channel()
            await underlay.basic_publish(
                b"", exchange="", routing_key=self._queue(shard).name, properties=properties
            )
        except (aio_pika.exceptions.AMQPError, aiormq.exceptions.AMQPError) as exc:
            # Best effort: the owner pings again, and a lost connection ends the subscriptions.
            log.debug("dedup_gate_ping_failed", shard=shard, error=str(exc))

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
