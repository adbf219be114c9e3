"""The worker's presence among its peers: its event stream, control mailbox, mingle, shared-queue check."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from control.aio.broadcaster import AsyncBroadcaster, declare_members_stream
from control.aio.node import MailboxNode
from control.protocol.commands import CommandRegistry
from control.protocol.signing import ControlSecurity
from worker.config import WorkerConfig
from worker.events import EventDispatcher
from worker.remote.mingle import mingle
from worker.remote.revoker import Revoker
from worker.remote.shared_queues import check_shared_namespace, check_shared_queues

__all__ = ["mingle_step", "run_shared_queue_check", "start_events", "start_mailbox"]

log = structlog.get_logger(__name__)


async def start_events(
    publishing: aio_pika.abc.AbstractRobustConnection, *, config: WorkerConfig, clock: LamportClock
) -> EventDispatcher:
    """Start the event dispatcher, and declare the members stream it announces the worker on.

    Args:
        publishing: the worker's publishing connection.
        config: worker options.
        clock: the worker process's Lamport clock.

    Returns:
        The started dispatcher (on a fresh channel if the members stream was refused).
    """
    channel = await publishing.channel(publisher_confirms=False)
    events = EventDispatcher(channel, hostname=config.hostname, clock=clock, task_events=config.task_events)
    await events.start()
    try:
        # Before worker-online: a client that starts later learns of us from the stream.
        await declare_members_stream(channel, config.namespace)
    except aio_pika.exceptions.AMQPError as exc:
        # The refused declare closed the channel: events go on a new one.
        log.error("members_stream_unavailable", error=str(exc))
        channel = await publishing.channel(publisher_confirms=False)
        events = EventDispatcher(
            channel, hostname=config.hostname, clock=clock, task_events=config.task_events
        )
        await events.start()
    return events


async def run_shared_queue_check(
    publishing: aio_pika.abc.AbstractRobustConnection,
    *,
    config: WorkerConfig,
    app: App,
    clock: LamportClock,
) -> None:
    """Warn of a peer of another app on one of our queues or in our app namespace
    (worker/remote/shared_queues.py); never fatal.

    Args:
        publishing: the worker's publishing connection.
        config: worker options.
        app: the application whose tasks the worker registered.
        clock: the worker process's Lamport clock.
    """
    channel = await publishing.channel(publisher_confirms=False)
    try:
        broadcaster = AsyncBroadcaster(
            channel,
            clock=clock,
            namespace=config.namespace,
            security=ControlSecurity.from_settings(config.settings),
        )
        await broadcaster.start()
        await check_shared_queues(
            broadcaster, nodename=config.hostname, queues=config.queues, registered=app.tasks
        )
        await check_shared_namespace(
            broadcaster, nodename=config.hostname, namespace=config.settings.namespace, registered=app.tasks
        )
    except Exception as exc:  # a check, not a duty: the worker runs on without it
        log.info("shared_queue_check_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        await channel.close()


async def mingle_step(
    publishing: aio_pika.abc.AbstractRobustConnection,
    revoker: Revoker,
    *,
    config: WorkerConfig,
    clock: LamportClock,
) -> Callable[[], Coroutine[Any, Any, None]]:
    """Mingle, as a step run at start and again after each reconnect.

    Args:
        publishing: the worker's publishing connection.
        revoker: takes the revokes the peers report.
        config: worker options.
        clock: the worker process's Lamport clock.

    Returns:
        The step: each call asks the peers again, on a members channel of its own.
    """
    broadcaster = AsyncBroadcaster(
        await publishing.channel(publisher_confirms=False),
        clock=clock,
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
                clock=clock,
                namespace=config.namespace,
            )
        finally:
            await members_channel.close()

    return run_mingle


async def start_mailbox(
    connection: aio_pika.abc.AbstractRobustConnection,
    registry: CommandRegistry,
    *,
    config: WorkerConfig,
    clock: LamportClock,
) -> None:
    """Start the worker's control mailbox; a mailbox that cannot start is logged, not raised.

    Args:
        connection: the worker's publishing connection.
        registry: the control commands the mailbox answers.
        config: worker options.
        clock: the worker process's Lamport clock.
    """
    # The control plane is a side door: a worker whose mailbox cannot start (another node of
    # the same name holds its exclusive queue) still serves tasks, and says so.
    node = MailboxNode(
        await connection.channel(),
        nodename=config.hostname,
        registry=registry,
        clock=clock,
        accept=config.settings.accept_content,
        namespace=config.namespace,
        security=ControlSecurity.from_settings(config.settings),
    )
    try:
        await node.start()
    except aio_pika.exceptions.AMQPError as exc:
        log.error("mailbox_unavailable", hostname=config.hostname, error=str(exc))
