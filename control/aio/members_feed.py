"""Following the members stream from inside an asyncio process (aio-pika): who is alive, kept current.

The blocking client's ``control.blocking.members_feed`` reads the same stream; ``read_members``
(``control.aio.broadcaster``) takes one snapshot. This one keeps consuming, so a worker that acts
on the membership (the dedup gate spreads its shards by it) sees a peer join, say goodbye, or
fall silent for two heartbeats.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.errors import MessageError
from broker_svc.topology import DEFAULT_NAMESPACE, members_stream
from broker_svc.wire import codec
from control.aio.declare import declare_queue
from control.protocol.membership import Membership
from control.protocol.request import MARKER_HEADER

__all__ = ["AsyncMembersFeed"]

log = structlog.get_logger(__name__)

# A node is alive for 2 x freq after its last event; a minute back covers any sane freq.
_LOOKBACK_S: Final = 60.0
_PREFETCH: Final = 1000
_MAX_EVENT_BYTES: Final = 1024 * 1024
_ACCEPT: Final = codec.accept_set(("json", "msgpack"))


class AsyncMembersFeed:
    """Feeds the worker events of the members stream into ``membership``, from a minute back.

    Read for liveness only, as ``read_members`` is: the clocks of a minute of replayed heartbeats
    are not adjusted to (they order nothing this process sends, and would carry one peer's clock
    to every worker that starts within the minute).

    Args:
        membership: what the events are fed into.
        namespace: whose members stream.
        accept: which events count (the others are skipped), e.g. only workers of one kind.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        accept: Callable[[Mapping[str, Any]], bool] = lambda _event: True,
    ) -> None:
        self._membership = membership
        self._namespace = namespace
        self._accept = accept

    async def follow(self, channel: aio_pika.abc.AbstractChannel) -> str:
        """Consume the stream on ``channel`` (the feed's own); its consumer tag.

        Raises:
            aio_pika.exceptions.AMQPError: the broker refused the stream (this channel is closed).
        """
        await channel.set_qos(prefetch_count=_PREFETCH)  # streams need manual acks and a qos
        queue = await declare_queue(channel, members_stream(self._namespace))
        since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=_LOOKBACK_S)
        return await queue.consume(self._on_message, arguments={"x-stream-offset": since})

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if MARKER_HEADER not in (message.headers or {}):
            try:
                body = codec.decode(
                    message.body, message.content_type, accept=_ACCEPT, max_bytes=_MAX_EVENT_BYTES
                )
            except MessageError:
                self._membership.ignored += 1
            else:
                for event in body if isinstance(body, list) else [body]:
                    if isinstance(event, Mapping) and self._accept(event):
                        self._membership.feed(event)
        await message.ack()
