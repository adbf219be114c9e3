"""The record of settled chords: a stream of one marker per chord the joiners settled lately.

A joiner publishes a chord's marker on its transactional channel, so the marker is committed with
the chord's body and its parts' acks, or not at all. A joiner that becomes the active one reads
the stream from its start before it takes a part: a copy of a part whose chord was settled by an
earlier joiner is then known as late (acked, never held or joined again), and a chord that was
settled never sends its body twice, whichever joiner settled it.

Reading up to a fence of its own is what makes it complete: the broker made this joiner the
active consumer only after the previous one's channel was closed, so every marker that joiner
committed is in the stream before a fence published now.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import uuid
from typing import Final

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions
from aiormq import spec

from broker_svc.topology import settled_chords_stream
from control.aio.declare import declare_queue
from worker.amqp.connection import one_time_channel

__all__ = ["SETTLED_KEPT", "SettledChords"]

# Chords remembered in memory: more than the stream holds (64 MB, about 290,000 markers), so
# memory forgets no chord the stream still records.
SETTLED_KEPT: Final = 300_000
# The AMQP ``type`` of a chord's marker, and of a reader's fence.
_MARKER: Final = "chord_settled"
_FENCE: Final = "fence"
_READ_PREFETCH: Final = 2000


class SettledChords:
    """The chords settled lately: this joiner's own, and those read from the stream.

    Args:
        namespace: the control namespace, which names the stream (beside the join queue).
    """

    def __init__(self, namespace: str) -> None:
        self.stream = settled_chords_stream(namespace)
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, group_id: str) -> None:
        """Remember a settled chord (forgetting the oldest past ``SETTLED_KEPT``)."""
        self._ids[group_id] = None
        if len(self._ids) > SETTLED_KEPT:
            self._ids.popitem(last=False)

    async def declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        """Declare the stream (a joiner that may not use it must not join).

        Raises:
            aiormq.exceptions.AMQPError: refused (permissions, a different declaration).
        """
        await declare_queue(channel, self.stream)

    async def publish(self, channel: aiormq.abc.AbstractChannel, group_id: str) -> None:
        """Publish the chord's marker on the joiner's transactional channel (written at its commit)."""
        properties = spec.Basic.Properties(
            message_id=group_id, message_type=_MARKER, delivery_mode=2, timestamp=_now()
        )
        await channel.basic_publish(b"", exchange="", routing_key=self.stream.name, properties=properties)

    async def catch_up(self, connection: aio_pika.abc.AbstractRobustConnection, *, timeout_s: float) -> int:
        """Read the stream from its start up to a fence published now; the markers read.

        Raises:
            TimeoutError: the fence was not reached within ``timeout_s``.
            aiormq.exceptions.AMQPError: the stream could not be read or the fence not published.
        """
        fence = str(uuid.uuid4())
        reached = asyncio.get_running_loop().create_future()
        read = 0

        async def on_record(record: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal read
            # Records are taken in stream order (aio-pika starts their callbacks in order).
            if record.type == _FENCE and record.message_id == fence and not reached.done():
                reached.set_result(None)
            elif record.type == _MARKER and record.message_id:
                self.add(record.message_id)
                read += 1
            # A stream hands out more only as earlier ones are acked; once the fence is reached
            # the channel closes under the records still coming, and their acks do not matter.
            with contextlib.suppress(aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError):
                await record.ack()

        channel = await one_time_channel(connection, publisher_confirms=True)  # the fence is confirmed
        try:
            async with asyncio.timeout(timeout_s):
                await channel.set_qos(prefetch_count=_READ_PREFETCH)  # a stream needs a prefetch
                queue = await declare_queue(channel, self.stream)
                await queue.consume(on_record, arguments={"x-stream-offset": "first"})
                fence_message = aio_pika.Message(b"", message_id=fence, type=_FENCE)
                await channel.default_exchange.publish(fence_message, routing_key=self.stream.name)
                await reached
        finally:
            if not channel.is_closed:  # its consumer ends with it; what it had taken is not needed
                await channel.close()
        return read


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
