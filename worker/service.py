"""The worker service: one asyncio loop owning the connections, the control plane and the process pool."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from dataclasses import dataclass
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc import signals
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerUnavailable
from broker_svc.topology import dead_letter_queue, expired_queue
from broker_svc.version import version
from control.aio.declare import declare_queue
from control.aio.header_ints import install_header_int_guard
from control.protocol.commands import CommandRegistry
from worker.amqp.connection import connect
from worker.amqp.queue_depth import QueueDepth
from worker.amqp.subscriptions import Subscriptions
from worker.amqp.task_queues import TaskQueues
from worker.assembly import feed_spec, serve_metrics, warn_time_limits
from worker.background import Background
from worker.cluster import mingle_step, run_shared_queue_check, start_events, start_mailbox
from worker.config import WorkerConfig
from worker.events import Heart
from worker.pool.autoscale import Autoscaler, PoolSizer
from worker.pool.demand import BacklogDemand
from worker.pool.pool import ProcessPool
from worker.pool.state import WorkerState
from worker.remote.commands import WorkerCommands
from worker.remote.revocation_log import RevocationLog
from worker.remote.revoked_set import RevokedSet
from worker.remote.revoker import Revoker
from worker.remote.scheduled import ScheduledLog
from worker.single_active.chord_join import ChordJoiner
from worker.single_active.dependents import DependentsJoiner
from worker.single_active.gatekeeper import Gatekeeper

__all__ = ["WorkerService"]

log = structlog.get_logger(__name__)

# How often the metrics sample the depth of the consumed queues.
_QUEUE_SAMPLE_S: Final = 15.0


@dataclass(frozen=True, slots=True)
class Running:
    """What ``start()`` built and ``shutdown()`` takes down."""

    pool: ProcessPool
    heart: Heart
    revoker: Revoker
    background: Background


class WorkerService:
    """Runs one worker until SIGTERM/SIGINT (graceful) or a second signal (immediate).

    ``run()`` is ``start()``, ``serve()`` and ``shutdown()`` in turn, inside the pool, the two
    connections and the owner of the background work.

    Args:
        config: worker options.
        app: the application whose tasks the children run.
    """

    def __init__(self, config: WorkerConfig, app: App) -> None:
        if config.settings.app_namespace is None:  # settings made apart from the app: the app's namespace
            config = dataclasses.replace(
                config, settings=config.settings.with_options(app_namespace=app.settings.namespace)
            )
        self._config = config
        self._app = app
        self._clock = LamportClock()
        self._stop = asyncio.Event()
        self._signals = 0
        self._revoked = RevokedSet()

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
            app_spec=config.app_spec,
            concurrency=config.concurrency,
            feed=feed_spec(config, self._app),
            # A child stops on its own once told: it finishes the task it runs first.
            exit_grace_s=config.shutdown_timeout_s,
        )
        warn_time_limits(config, self._app)
        await pool.start()
        # Two connections: RabbitMQ blocks a connection that publishes during a memory or disk
        # alarm, and a blocked connection is not read at all. What only reads (declares, queue
        # depths) has a connection that never publishes; events and control replies have the
        # other. Consumers of the queues every worker declares have one each (Subscriptions).
        try:
            try:
                consuming = await self._connect("consume")
            except BrokerUnavailable:
                if not self._stop.is_set():
                    raise  # refused for good (a login, TLS): the entry point says why, in one line
                log.info("worker_stopped", hostname=config.hostname, connected=False)
                return 0  # asked to stop while the broker was down: nothing to hand back
            try:
                publishing = await self._connect("publish")
                subscriptions = Subscriptions(self._connect)
                async with consuming, publishing, subscriptions, Background() as background:
                    running = await self.start(consuming, publishing, pool, background, subscriptions)
                    try:
                        await self.serve()
                        await self.shutdown(running)
                    finally:
                        running.revoker.save()
            finally:
                await consuming.close()
        finally:
            await pool.close()  # also when connecting failed
        log.info("worker_stopped", hostname=config.hostname)
        return 0

    async def start(
        self,
        consuming: aio_pika.abc.AbstractRobustConnection,
        publishing: aio_pika.abc.AbstractRobustConnection,
        pool: ProcessPool,
        background: Background,
        subscriptions: Subscriptions,
    ) -> Running:
        """Build the collaborators in dependency order, learn every revoke, then consume and beat."""
        config = self._config
        # Everything that publishes, or answers by publishing, is on the publishing connection.
        publish_channel = await publishing.channel(publisher_confirms=True)
        events = await start_events(publishing, config=config, clock=self._clock)
        metrics = serve_metrics(config, pool)
        feeding = pool.feeding
        # The task queues the children consume, declared here first (worker.amqp.task_queues).
        queues = TaskQueues(await consuming.channel(publisher_confirms=False), settings=config.settings)
        sizer = PoolSizer(pool, multiplier=config.prefetch_multiplier, threads=config.threads)
        autoscaler = None
        if config.autoscale is not None:
            maximum, minimum = config.autoscale
            # No delivery waits in the worker: the queues' backlog does (worker/pool/demand.py).
            depth = QueueDepth(consuming, queues.listed)
            demand = BacklogDemand(running=lambda: pool.busy_count, ready=depth.ready, threads=config.threads)
            autoscaler = Autoscaler(
                sizer,
                demand,
                maximum=maximum,
                minimum=minimum,
                keepalive_s=config.autoscale_keepalive_s,
            )
        revoker = Revoker(
            self._revoked,
            terminate=pool.terminate,
            state_path=config.state_path,
            on_new=feeding.send_revoked,
            known=feeding.revokes_known,
            on_new_stamps=feeding.send_revoked_stamps,
            running_stamps=feeding.running_stamps,
        )
        revocation_log = RevocationLog(
            revoker, clock=self._clock, hostname=config.hostname, namespace=config.settings.namespace
        )
        # Every revoke we can know of is known before the first task is taken: the state file,
        # then the broker's log read up to now.
        revoker.load()
        revocations = await subscriptions.open("revocations")
        await revocation_log.follow(lambda: revocations.channel(publisher_confirms=False), publish_channel)
        heart = Heart(
            events, lambda: (len(feeding.running()), feeding.processed), freq_s=config.event_heartbeat_s,
            app_namespace=config.settings.namespace, task_queues=queues.consumed,
        )  # fmt: skip
        # Keyed dedup: the gate shards spread over the live workers (worker/single_active/gatekeeper.py).
        gate = Gatekeeper(
            settings=config.settings, clock=self._clock, hostname=config.hostname,
            namespace=config.namespace, events=events, metrics=metrics,
        )  # fmt: skip
        # inspect scheduled: the ETA tasks this worker parked, and its share of those clients parked,
        # from their records (remote/scheduled.py).
        parked = ScheduledLog(
            hostname=config.hostname, namespace=config.settings.namespace,
            control_namespace=config.namespace, task_queues=queues.consumed,
        )  # fmt: skip
        background.spawn(
            subscriptions.serve(
                "scheduled", lambda conn: parked.follow(lambda: conn.channel(publisher_confirms=False))
            ),
            name="scheduled-log",
        )
        commands = WorkerCommands(
            app=self._app,
            config=config,
            clock=self._clock,
            state=WorkerState(config.hostname, feeding, parked),
            queues=queues,
            pool=pool,
            sizer=sizer,
            autoscaler=autoscaler,
            revoker=revoker,
            revocation_log=revocation_log,
            events=events,
            heart=heart,
            request_stop=self.request_stop,
            gate=gate,
        )
        await start_mailbox(
            publishing, commands.register(CommandRegistry()), config=config, clock=self._clock
        )
        run_mingle = (
            await mingle_step(
                publishing, revoker, members=subscriptions.session, config=config, clock=self._clock
            )
            if config.mingle
            else None
        )
        if run_mingle is not None:
            await run_mingle()  # before the first task: peers' revokes hold for it too
        for name in config.queues:
            await queues.declare(name)
        # Tasks a Celery client's broker TTL expired in their queue, given the operator's policy.
        expired = expired_queue(config.settings.namespace)
        if await self._may_consume(consuming, expired):
            await queues.declare(expired, listed=False)
            feeding.set_queues(queues.consumed())
        feeding.start(
            lambda: list(self._revoked), revoker.revoked_stamps.to_wire
        )  # each child consumes for itself
        background.spawn(
            run_shared_queue_check(publishing, config=config, app=self._app, clock=self._clock),
            name="shared-queues",
        )
        if metrics is not None:
            background.spawn(
                metrics.sample_queues(consuming, queues.listed, every_s=_QUEUE_SAMPLE_S), name="queue-depths"
            )
        await heart.online()
        background.spawn(heart.run(), name="heartbeat")
        if autoscaler is not None:
            background.spawn(autoscaler.run(), name="autoscaler")

        async def on_reconnect(_connection: Any) -> None:
            # The broker may have forgotten us (and we it): announce the node again.
            log.info("worker_reconnected", hostname=config.hostname)
            background.spawn(heart.online(), name="worker-online")
            if run_mingle is not None:
                background.spawn(run_mingle(), name="mingle")

        publishing.reconnect_callbacks.add(on_reconnect)
        # Chords: one worker of the cluster joins at a time (worker/single_active/chord_join.py).
        joiner = ChordJoiner(
            app=self._app,
            clock=self._clock,
            namespace=config.settings.namespace,
            max_body_bytes=config.settings.max_body_bytes,
        )
        background.spawn(subscriptions.serve("chords", joiner.run), name="chord-joiner")
        background.spawn(joiner.watch(), name="chord-watch")
        if config.settings.task_states:
            # depends_on: one worker of the cluster releases waiting tasks (single_active/dependents.py).
            dependents = DependentsJoiner(
                settings=config.settings, clock=self._clock, hostname=config.hostname
            )
            background.spawn(subscriptions.serve("dependents", dependents.run), name="dependents")
        background.spawn(gate.run(lambda: subscriptions.open("gate")), name="dedup-gate")
        log.info(
            "worker_ready",
            hostname=config.hostname,
            # The start-up banner: what runs, against which broker (no password), with which tasks.
            version=version(),
            app=config.app_spec,
            app_namespace=config.settings.namespace,
            broker=config.settings.safe_broker_url,
            tasks=sorted(name for name in self._app.tasks if not name.startswith("celery.")),
            queues=list(config.queues),
            concurrency=config.concurrency,
            autoscale=list(config.autoscale) if config.autoscale else None,
            prefetch=sizer.prefetch_count,
            revoked=len(self._revoked),
            pid=os.getpid(),
        )
        signals.worker_ready.send(sender=self)
        return Running(pool, heart, revoker, background)

    async def serve(self) -> None:
        """Serve until asked to stop (SIGTERM, SIGINT, the ``shutdown`` command)."""
        await self._stop.wait()

    async def shutdown(self, running: Running) -> None:
        """Stop the children (each finishes its task within the deadline, hands back the rest), go offline."""
        config = self._config
        in_flight = len(running.pool.feeding.running())  # what the children run now (the board)
        # As Celery's warm shutdown says: a second Ctrl-C does not wait for the running tasks.
        hint = "press Ctrl-C again (or send another SIGTERM) to stop now; unfinished tasks are redelivered"
        log.info(
            "worker_stopping",
            in_flight=in_flight,
            timeout_s=config.shutdown_timeout_s,
            **({"hint": hint} if in_flight else {}),
        )
        signals.worker_shutdown.send(sender=self)
        await running.background.stop("autoscaler")
        await running.pool.close()
        await running.background.stop("heartbeat")
        await running.heart.offline()

    async def _may_consume(self, connection: aio_pika.abc.AbstractRobustConnection, queue: str) -> bool:
        # Tried on a channel of its own: a refusal closes the channel it happens on, and a
        # deployment whose permissions predate this queue must still start (without it).
        try:
            async with connection.channel(publisher_confirms=False) as channel:
                await declare_queue(channel, self._config.settings.task_queue(queue))  # as it is consumed
                await declare_queue(channel, dead_letter_queue(queue))
        except Exception as exc:  # refused (ACCESS_REFUSED, PRECONDITION_FAILED), or closing after it
            log.warning(
                "queue_not_consumed", queue=queue, error=str(exc),
                hint="grant the worker's user configure, write and read on this queue "
                "(docs/deployment.md, 'Least-privilege users')",
            )  # fmt: skip
            return False
        return True

    async def _connect(self, role: str) -> aio_pika.abc.AbstractRobustConnection:
        config = self._config
        # Failover, backoff while the broker is down, TLS (worker/amqp/connection.py).
        return await connect(
            config.settings,
            connection_name=f"clockwork-worker {config.hostname} {role}",
            heartbeat_s=config.broker_heartbeat_s,
            stop=self._stop,
        )

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
