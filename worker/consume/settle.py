"""The settle point: the one place a task delivery is acked or handed back, from its disposition."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.errors import Unroutable
from broker_svc.topology import dedup_gate_queue
from broker_svc.wire.dedup import GateMessage, gate_headers, release_of, shard_of
from worker.consume.disposition import ACK, HAND_BACK, LEFT_TO_BROKER, Disposition, Fate, Owed
from worker.consume.eta import EtaScheduler
from worker.consume.publish import ReplyPublisher

__all__ = ["ACK", "HAND_BACK", "LEFT_TO_BROKER", "Disposition", "Fate", "Owed", "Settler"]

log = structlog.get_logger(__name__)


class Settler:
    """Carries out dispositions: the only code that acks or nacks a task delivery.

    Every step of a delivery (decode, admission, the guards, the run's outcome) decides what becomes
    of it as a :class:`Disposition`. A copy the delivery owes (a dead letter, a retry, a park, a
    recount) is confirmed by the broker before the original is acked: a failed copy raises here
    with the original still unacked, and the consumer hands it back.

    Args:
        replies: publishes dead letters and copies that go straight back to their queue.
        eta: publishes copies that wait in a delay queue.
    """

    def __init__(self, *, replies: ReplyPublisher, eta: EtaScheduler) -> None:
        self._replies = replies
        self._eta = eta

    async def settle(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, disposition: Disposition
    ) -> None:
        """Carry out ``disposition`` for ``message`` from ``queue``.

        Raises:
            aio_pika.exceptions.AMQPError: a copy was not confirmed (``message`` is not acked).
            Unroutable: no queue took a copy (``message`` is not acked).
        """
        fate = disposition.fate
        if fate is Fate.LEFT_TO_BROKER:
            return
        if fate is Fate.HAND_BACK:
            await _tolerate_gone_channel(message.nack(requeue=True))
            return
        if fate is Fate.DEAD_LETTER:
            await self._replies.dead_letter(
                message, queue=queue, reason=disposition.reason, error=disposition.error
            )
        elif fate is Fate.REPUBLISH:
            if disposition.delay_ms is None:
                to = queue if disposition.to is None else disposition.to.name
                await self._replies.republish(
                    message, queue=to, headers=dict(disposition.headers), drop=disposition.drop,
                    body=disposition.body,
                )  # fmt: skip
            else:
                await self._eta.park(
                    message, queue=queue, bucket_ms=disposition.delay_ms, headers=disposition.headers,
                    drop=disposition.drop, body=disposition.body,
                )  # fmt: skip
        if disposition.owed is not None:
            await disposition.owed()
        await _tolerate_gone_channel(message.ack())
        if fate is not Fate.REPUBLISH and (release := release_of(message.headers or {})) is not None:
            await self._release(release)

    async def _release(self, release: GateMessage) -> None:
        # A dedup key's head ended for good: its gate may send the next one (after the ack; the
        # gate's safety timeout ends the head if this is lost).
        try:
            queue = dedup_gate_queue(shard_of(release.key))
            await self._replies.publish_to(
                b"", content_type="", encoding="", queue=queue, headers=gate_headers(release)
            )
        except (aio_pika.exceptions.AMQPError, Unroutable) as exc:
            log.warning("dedup_release_lost", key=release.key, error=str(exc))


async def _tolerate_gone_channel(action: Awaitable[Any]) -> None:
    # After a reconnect the delivery's channel is gone: acking it would be a stale tag (406).
    # The broker has already requeued it, so there is nothing left to do but note it (after a
    # confirmed copy the task then comes back twice: at-least-once).
    try:
        await action
    except (aio_pika.exceptions.ChannelInvalidStateError, aio_pika.exceptions.AMQPError) as exc:
        log.warning("settle_skipped_channel_gone", error=str(exc))
    except asyncio.CancelledError:
        # A channel that closes mid-ack cancels the ack's write instead of failing it; only a
        # cancellation of this task itself goes on up.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("settle_skipped_channel_gone", error="cancelled with its channel")
