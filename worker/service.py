"""The worker service: one asyncio loop owning the connection, consumers and the process pool."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from control.aio.broadcaster import AsyncBroadcaster, declare_members_stream
from control.aio.node import MailboxNode
from control.protocol.signing import ControlSecurity
from worker.amqp.channel_watch import ConsumeChannelWatch
from worker.amqp.connection import connect
from worker.amqp.header_ints import install_header_int_guard
from worker.amqp.subscriptions import QueueConsumers
from worker.config import WorkerConfig, time_limits_over_consumer_timeout
from worker.consume.consumer import TaskConsumer
from worker.consume.eta import EtaScheduler
from worker.consume.publish import ReplyPublisher
from worker.consume.rate_limits import RateLimits
from worker.events import EventDispatcher, Heart
from worker.pool.autoscale import Autoscaler, PoolSizer
from worker.pool.pool import ProcessPool
from worker.remote.commands import build_registry, register_pool_commands, register_rate_limit
from worker.remote.mingle import mingle
from worker.remote.revoked_set import RevokedSet
from worker.remote.revoker import Revoker

__all__ = ["WorkerService"]

log = structlog.get_logger(__name__)


class WorkerService:
    """Runs one worker until SIGTERM/SIGINT (graceful) or a second signal (immediate).

    Args:
        config: worker options.
        app: the application whose tasks the children run.
    """

    def __init__(self, config: WorkerConfig, app: App) -> None:
        self._config = config
        self._app = app
        self._clock = LamportClock()
        self._stop = asyncio.Event()
        self._signals = 0
        self._consumer: TaskConsumer | None = None
        self._revoked = RevokedSet()
        self._limits = RateLimits.for_tasks(app.tasks)
        self._heart: Heart | None = None
        # The task queues consumed, on the consume channel (worker.amqp.subscriptions).
        self._queues = QueueConsumers(settings=config.settings, consumer=lambda: self._consumer)
        self._sizer: PoolSizer | None = None
        self._autoscaler: Autoscaler | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._mingle: Callable[[], Coroutine[Any, Any, None]] | None = None
        # The consume channel's faults and the consumer watchdog (RELIABILITY.md R4-R7).
        self._channel_watch = ConsumeChannelWatch(self._queues, consumer=lambda: self._consumer)

    @property
    def clock(self) -> LamportClock:
        """The worker process's Lamport clock."""
        return self._clock

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does)."""
        self._stop.set()

    async def run(self) -> int:
        """Serve until stopped; returns the process exit status."""
        config = self._config
        install_header_int_guard()
        self._install_signal_handlers()
        pool = ProcessPool(
            app_spec=config.app_spec, concurrency=config.concurrency, on_update=self._relay_update
        )
        self._warn_time_limits()
        await pool.start()
        # Two connections: RabbitMQ blocks a connection that publishes during a memory or disk
        # alarm, and a blocked connection is not read at all, so acks would stall with it. Task
        # deliveries and their acks have a connection that never publishes; results, events,
        # control replies and re-publishes have the other.
        consuming = await self._connect("consume")
        try:
            publishing = await self._connect("publish")
            async with consuming, publishing:
                await self._serve(consuming, publishing, pool)
        finally:
            await consuming.close()
            await pool.close(timeout_s=0)
        log.info("worker_stopped", hostname=config.hostname)
        return 0

    async def _connect(self, role: str) -> aio_pika.abc.AbstractRobustConnection:
        config = self._config
        # Failover, backoff while the broker is down, TLS (worker/amqp/connection.py).
        return await connect(
            config.settings,
            connection_name=f"clockwork-worker {config.hostname} {role}",
            heartbeat_s=config.broker_heartbeat_s,
            stop=self._stop,
        )

    def _warn_time_limits(self) -> None:
        # The worker cannot read the broker's consumer_timeout: it is told it (--consumer-timeout).
        config = self._config
        limits = {
            name: task.time_limit or config.time_limit_s
            for name, task in self._app.tasks.items()
            if not name.startswith("celery.")
        }
        over = time_limits_over_consumer_timeout(limits, consumer_timeout_s=config.consumer_timeout_s)
        for name, limit in over.items():
            log.warning(
                "time_limit_over_consumer_timeout",
                task_name=name,
                time_limit_s=limit,
                consumer_timeout_s=config.consumer_timeout_s,
                hint="the broker closes the channel of a delivery held past consumer_timeout "
                "(checked every 60 s) and redelivers it: lower the limit or raise consumer_timeout",
            )

    async def _serve(
        self,
        consuming: aio_pika.abc.AbstractRobustConnection,
        publishing: aio_pika.abc.AbstractRobustConnection,
        pool: ProcessPool,
    ) -> None:
        config = self._config
        consume_channel = await consuming.channel(publisher_confirms=False)
        await consume_channel.set_qos(prefetch_count=config.prefetch_count)  # per consumer
        self._queues.attach(consume_channel)
        await self._channel_watch.attach(consume_channel)
        # Everything below publishes, or answers by publishing: the publishing connection.
        publish_channel = await publishing.channel(publisher_confirms=True)
        replies = ReplyPublisher(
            publish_channel, clock=self._clock, persistent=config.settings.result_persistent
        )
        events_channel = await publishing.channel(publisher_confirms=False)
        events = EventDispatcher(
            events_channel, hostname=config.hostname, clock=self._clock, task_events=config.task_events
        )
        await events.start()
        try:
            # Before worker-online: a client that starts later learns of us from the stream.
            await declare_members_stream(events_channel, config.namespace)
        except aio_pika.exceptions.AMQPError as exc:
            log.error("members_stream_unavailable", error=str(exc))
            events_channel = await publishing.channel(publisher_confirms=False)
            events = EventDispatcher(
                events_channel, hostname=config.hostname, clock=self._clock, task_events=config.task_events
            )
            await events.start()
        # Held ETA deliveries count against the prefetch: leave one per child for due tasks.
        eta = EtaScheduler(publish_channel, max_held=max(1, config.prefetch_count - config.concurrency))
        consumer = TaskConsumer(
            app=self._app,
            pool=pool,
            replies=replies,
            clock=self._clock,
            settings=config.settings,
            hostname=config.hostname,
            concurrency=config.concurrency,
            dedupe_window_s=config.dedupe_window_s,
            eta=eta,
            events=events,
            revoked=self._revoked,
            limits=self._limits,
            default_time_limits=(config.time_limit_s, config.soft_time_limit_s),
        )
        self._consumer = consumer
        self._sizer = PoolSizer(
            pool,
            consumer.slots,
            set_prefetch=self.set_prefetch,
            multiplier=config.prefetch_multiplier,
            autoscale_max=config.autoscale[0] if config.autoscale else None,
        )
        if config.autoscale is not None:
            self._autoscaler = Autoscaler(
                self._sizer,
                consumer.slots,
                maximum=config.autoscale[0],
                minimum=config.autoscale[1],
                keepalive_s=config.autoscale_keepalive_s,
            )
        revoker = Revoker(
            self._revoked,
            terminate=consumer.terminate,
            clock=self._clock,
            hostname=config.hostname,
            state_path=config.state_path,
            namespace=config.namespace,
        )
        # Every revoke we can know of is known before the first task is taken: the state file,
        # then the broker's log read up to now.
        revoker.load()
        await revoker.follow_log(await consuming.channel(publisher_confirms=False), publish_channel)
        heart = Heart(
            events, lambda: (consumer.running_count, consumer.received), freq_s=config.event_heartbeat_s
        )
        self._heart = heart
        await self._start_mailbox(publishing, consumer, pool, revoker, events)
        if config.mingle:
            broadcast_channel = await publishing.channel(publisher_confirms=False)
            broadcaster = AsyncBroadcaster(
                broadcast_channel,
                clock=self._clock,
                namespace=config.namespace,
                security=ControlSecurity.from_settings(config.settings),
            )
            await broadcaster.start()

            async def run_mingle() -> None:
                members_channel = await publishing.channel(publisher_confirms=False)
                try:
                    await mingle(
                        broadcaster,
                        members_channel,
                        nodename=config.hostname,
                        revoker=revoker,
                        clock=self._clock,
                        namespace=config.namespace,
                    )
                finally:
                    await members_channel.close()

            self._mingle = run_mingle
            await run_mingle()  # before the first task: peers' revokes hold for it too
        for name in config.queues:
            await self.add_consumer(name)
        await heart.start()
        if self._autoscaler is not None:
            await self._autoscaler.start()
        publishing.reconnect_callbacks.add(self._on_reconnect)
        watch = asyncio.create_task(self._channel_watch.watch_consumers(), name="consumer-watch")
        log.info(
            "worker_ready",
            hostname=config.hostname,
            queues=list(config.queues),
            concurrency=config.concurrency,
            autoscale=list(config.autoscale) if config.autoscale else None,
            prefetch=config.prefetch_count,
            revoked=len(self._revoked),
            pid=os.getpid(),
        )
        try:
            await self._stop.wait()
            log.info("worker_stopping", in_flight=consumer.in_flight, timeout_s=config.shutdown_timeout_s)
            if self._autoscaler is not None:
                await self._autoscaler.stop()
            for name in self._queues.consuming():
                await self.cancel_consumer(name)
            await consumer.stop(timeout_s=config.shutdown_timeout_s)
            await pool.close(timeout_s=0)
            await heart.stop()
        finally:
            watch.cancel()
            revoker.save()

    # -- what control commands change (worker.remote.commands.ServiceControls) ----------------------------

    async def add_consumer(self, queue: str) -> str:
        """Declare ``queue`` (as Celery does) and consume it."""
        return await self._queues.add(queue)

    async def cancel_consumer(self, queue: str) -> str:
        """Stop consuming ``queue``; deliveries already taken still run."""
        return await self._queues.cancel(queue)

    async def set_prefetch(self, count: int) -> None:
        """Give every task-queue consumer a per-consumer prefetch of ``count`` (never a global QoS)."""
        await self._queues.set_prefetch(count)

    def consuming(self) -> list[str]:
        """The task queues consumed now."""
        return self._queues.consuming()

    async def heartbeat(self) -> None:
        """Send a worker-heartbeat now."""
        if self._heart is not None:
            await self._heart.beat()

    async def _on_reconnect(self, _connection: Any) -> None:
        # The broker may have forgotten us (and we it): announce the node again.
        log.info("worker_reconnected", hostname=self._config.hostname)
        steps: list[Callable[[], Coroutine[Any, Any, None]] | None] = [
            self._heart.online if self._heart else None,
            self._mingle,
        ]
        for step in steps:
            if step is not None:
                task = asyncio.create_task(step())
                self._background.add(task)
                task.add_done_callback(_log_failure)
                task.add_done_callback(self._background.discard)

    async def _start_mailbox(
        self,
        connection: aio_pika.abc.AbstractRobustConnection,
        consumer: TaskConsumer,
        pool: ProcessPool,
        revoker: Revoker,
        events: EventDispatcher,
    ) -> None:
        # The control plane is a side door: a worker whose mailbox cannot start (another node of
        # the same name holds its exclusive queue) still serves tasks, and says so.
        config = self._config
        registry = build_registry(
            app=self._app,
            clock=self._clock,
            nodename=config.hostname,
            revoker=revoker,
            consumer=consumer,
            pool=pool,
            config=config,
            events=events,
            controls=self,
        )
        register_rate_limit(registry, app=self._app, limits=self._limits)
        assert self._sizer is not None
        register_pool_commands(registry, pool=pool, sizer=self._sizer, autoscaler=self._autoscaler)
        node = MailboxNode(
            await connection.channel(),
            nodename=config.hostname,
            registry=registry,
            clock=self._clock,
            accept=config.settings.accept_content,
            namespace=config.namespace,
            security=ControlSecurity.from_settings(config.settings),
        )
        try:
            await node.start()
        except aio_pika.exceptions.AMQPError as exc:
            log.error("mailbox_unavailable", hostname=config.hostname, error=str(exc))

    def _relay_update(self, task_id: str, payload: dict[str, Any]) -> None:
        # The pool exists before the consumer (children start first); route updates once it does.
        if self._consumer is not None:
            self._consumer.on_update(task_id, payload)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals > 1:
            # Second signal: leave now. Unacked deliveries go back to the broker with the socket.
            log.warning("worker_exit_now", signal=sig.name)
            os._exit(1)
        log.info("worker_signal", signal=sig.name)
        self._stop.set()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background_step_failed", task=task.get_name(), error=repr(task.exception()))
