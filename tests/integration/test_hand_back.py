"""A delivery whose handling failed waits for the worker's publishing channel before it is handed back."""

from __future__ import annotations

import time
import uuid

import aio_pika
import aio_pika.exceptions
import pytest

from broker_svc.clock import LamportClock
from worker.consume.publish import ReplyPublisher


async def test_until_open_waits_for_a_channel_the_broker_closed_to_reopen(test_vhost_url: str):
    connection = await aio_pika.connect_robust(test_vhost_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        replies = ReplyPublisher(channel, clock=LamportClock(), persistent=False)
        assert await replies.until_open(timeout_s=1)
        # A channel error (404) closes the channel; the robust channel then opens it again.
        with pytest.raises(aio_pika.exceptions.ChannelClosed):
            await channel.declare_queue(f"no-such-queue-{uuid.uuid4()}", passive=True)
        assert channel.is_closed
        assert await replies.until_open(timeout_s=10)
        assert not channel.is_closed
        reply_queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=reply_queue.name)
    finally:
        await connection.close()


async def test_until_open_gives_up_at_its_deadline_on_a_channel_that_stays_closed(test_vhost_url: str):
    connection = await aio_pika.connect_robust(test_vhost_url)
    channel = await connection.channel(publisher_confirms=True)
    replies = ReplyPublisher(channel, clock=LamportClock(), persistent=False)
    await connection.close()
    started = time.monotonic()
    assert not await replies.until_open(timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 5
