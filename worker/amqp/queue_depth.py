"""How many messages wait, ready, in the worker's task queues: a passive declare per queue.

The autoscaler of consuming children asks it (``worker/pool/demand.py``) when every child is
busy. One channel is kept for it, apart from the consume channel: a queue deleted meanwhile
answers 404, which closes the channel it is asked on, and must not close the worker's consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final

import aio_pika
import aio_pika.abc
import structlog

__all__ = ["QueueDepth"]

log = structlog.get_logger(__name__)

_ASK_TIMEOUT_S: Final = 2.0
_FAILURES: Final = (
    aio_pika.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError, ConnectionError, TimeoutError
)  # fmt: skip


class QueueDepth:
    """Ready messages in ``queues()``, read with ``queue.declare(passive=True)``.

    Args:
        connection: the worker's robust connection (the consuming one: it never publishes, so a
            broker alarm does not block it).
        queues: the task queues consumed now (``QueueConsumers.listed``).
    """

    def __init__(
        self, connection: aio_pika.abc.AbstractRobustConnection, queues: Callable[[], list[str]]
    ) -> None:
        self._connection = connection
        self._queues = queues
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._failing = False  # warned once per run of failures, not at every look

    async def ready(self) -> int:
        """Messages ready in the queues, summed; a queue that cannot be read counts 0 (logged)."""
        total, failed = 0, {}
        for name in self._queues():
            try:
                # Bounded: while the connection is being restored a channel waits for it, and the
                # autoscaler (and the autoscale command) must not wait as long.
                async with asyncio.timeout(_ASK_TIMEOUT_S):
                    total += await self._ready_in(name)
            except _FAILURES as exc:  # deleted (404, which closed the channel), or reconnecting
                failed[name] = str(exc)
                await self.close()
        if failed and not self._failing:
            log.warning("queue_depth_unknown", errors=failed)
        self._failing = bool(failed)
        return total

    async def _ready_in(self, name: str) -> int:
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = self._channel = await self._connection.channel(publisher_confirms=False)
        # robust=False: a robust channel would keep every queue object it declared, to redeclare.
        declared = await channel.declare_queue(name, passive=True, robust=False)
        return declared.declaration_result.message_count or 0

    async def close(self) -> None:
        """Close the channel, if one is open."""
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(*_FAILURES):
                await channel.close()
