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
from broker_svc.topology import dead_letter_queue, task_queue
from control.broadcast import AsyncBroadcaster, declare_members_stream
from control.declare import declare_queue
from control.node import MailboxNode
from worker.amqp_compat import install_header_int_guard
from worker.autoscale import Autoscaler, PoolSizer
from worker.config import WorkerConfig
from worker.consumer import TaskConsumer
from worker.eta import EtaScheduler
from worker.events import EventDispatcher, Heart
from worker.handlers import build_registry, register_pool_commands, register_rate_limit
from worker.mingle import mingle
from worker.pool import ProcessPool
from worker.ratelimit import RateLimits
from worker.replies import ReplyPublisher
from worker.revocation import Revoker
from worker.revoked import RevokedSet

__all__ = ["WorkerService", "amqp_url"]

log = structlog.get_logger(__name__)


def amqp_url(config: WorkerConfig) -> str:
    """The broker URL with the vhost spelled so aio-pika reads it as kombu does (``//`` is ``/``)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(config.settings.broker_url)
    return urlunsplit(parts._replace(path="/" + quote(config.settings.virtual_host, safe="")))


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
        self._consume_channel: aio_pika.abc.AbstractChannel | None = None
        # Task queues consumed now: name → (queue, consumer tag).
        self._consuming: dict[str, tuple[aio_pika.abc.AbstractQueue, str]] = {}
        # Held while consumers are added, cancelled or re-subscribed (a new prefetch).
        self._consumers_lock = asyncio.Lock()
        self._sizer: PoolSizer | None = None
        self._autoscaler: Autoscaler | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._mingle: Callable[[], Coroutine[Any, Any, None]] | None = None

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
        await pool.start()
        connection = await aio_pika.connect_robust(
            amqp_url(config),
            client_properties={"connection_name": f"clockwork-worker {config.hostname}"},
            timeout=config.settings.connect_timeout_s,
        )
        try:
            async with connection:
                await self._serve(connection, pool)
        finally:
            await pool.close(timeout_s=0)
        log.info("worker_stopped", hostname=config.hostname)
        return 0

    async def _serve(self, connection: aio_pika.abc.AbstractRobustConnection, pool: ProcessPool) -> None:
        config = self._config
        consume_channel = await connection.channel(publisher_confirms=False)
        await consume_channel.set_qos(prefetch_count=config.prefetch_count)  # per consumer
        self._consume_channel = consume_channel
        publish_channel = await connection.channel(publisher_confirms=True)
        replies = ReplyPublisher(
            publish_channel, clock=self._clock, persistent=config.settings.result_persistent
        )
        events_channel = await connection.channel(publisher_confirms=False)
        events = EventDispatcher(
            events_channel, hostname=config.hostname, clock=self._clock, task_events=config.task_events
        )
        await events.start()
        try:
            # Before worker-online: a client that starts later learns of us from the stream.
            await declare_members_stream(events_channel, config.namespace)
        except aio_pika.exceptions.AMQPError as exc:
            log.error("members_stream_unavailable", error=str(exc))
            events_channel = await connection.channel(publisher_confirms=False)
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
            max_child_deaths=config.max_child_deaths,
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
        await revoker.follow_log(await connection.channel(publisher_confirms=False), publish_channel)
        heart = Heart(events, lambda: (consumer.running_count, consumer.received), freq_s=config.heartbeat_s)
        self._heart = heart
        await self._start_mailbox(connection, consumer, pool, revoker, events)
        if config.mingle:
            broadcast_channel = await connection.channel(publisher_confirms=False)
            broadcaster = AsyncBroadcaster(broadcast_channel, clock=self._clock, namespace=config.namespace)
            await broadcaster.start()

            async def run_mingle() -> None:
                members_channel = await connection.channel(publisher_confirms=False)
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
        connection.reconnect_callbacks.add(self._on_reconnect)
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
            for name in list(self._consuming):
                await self.cancel_consumer(name)
            await consumer.stop(timeout_s=config.shutdown_timeout_s)
            await pool.close(timeout_s=0)
            await heart.stop()
        finally:
            revoker.save()

    # -- what control commands change (worker.handlers.ServiceControls) ----------------------------

    async def add_consumer(self, queue: str) -> str:
        """Declare ``queue`` (as Celery does) and consume it."""
        channel, consumer = self._consume_channel, self._consumer
        assert channel is not None and consumer is not None
        if queue in self._consuming:
            return f"already consuming from {queue!r}"
        await declare_queue(channel, dead_letter_queue(queue))
        declared = await declare_queue(channel, task_queue(queue))
        async with self._consumers_lock:
            tag = await declared.consume(consumer.for_queue(queue))
            self._consuming[queue] = (declared, tag)
        log.info("consumer_added", queue=queue)
        return f"add consumer {queue}"

    async def cancel_consumer(self, queue: str) -> str:
        """Stop consuming ``queue``; deliveries already taken still run."""
        async with self._consumers_lock:
            entry = self._consuming.pop(queue, None)
            if entry is None:
                return f"not consuming from {queue}"
            declared, tag = entry
            try:
                await declared.cancel(tag)
            except aio_pika.exceptions.AMQPError as exc:
                log.warning("consumer_cancel_failed", queue=queue, error=str(exc))
        log.info("consumer_cancelled", queue=queue)
        return f"no longer consuming from {queue}"

    async def set_prefetch(self, count: int) -> None:
        """Give every task-queue consumer a per-consumer prefetch of ``count`` (never a global QoS).

        basic.qos binds only consumers created after it, so each queue is consumed anew, then its
        old consumer cancelled. Deliveries the old one took stay ours and are acked on this channel
        as usual; the broker no longer counts them against the new consumer, so until they finish
        the worker may hold them on top of the new prefetch.
        """
        channel, consumer = self._consume_channel, self._consumer
        assert channel is not None and consumer is not None
        async with self._consumers_lock:
            try:
                await channel.set_qos(prefetch_count=count)  # per consumer (global=False)
                for queue, (declared, old_tag) in list(self._consuming.items()):
                    tag = await declared.consume(consumer.for_queue(queue))
                    self._consuming[queue] = (declared, tag)
                    await declared.cancel(old_tag)
            except (aio_pika.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError) as exc:
                # The robust channel restores the new QoS, then the consumers, once it reconnects.
                log.warning("prefetch_change_failed", prefetch=count, error=str(exc))
                return
        log.info("prefetch_changed", prefetch=count, queues=list(self._consuming))

    def consuming(self) -> list[str]:
        """The task queues consumed now."""
        return list(self._consuming)

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
