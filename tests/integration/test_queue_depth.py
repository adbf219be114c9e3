"""``QueueDepth``: the ready messages of the worker's queues, read by passive declare on the real broker."""

from __future__ import annotations

import aio_pika
from structlog.testing import capture_logs

from tests.support.amqp import channel, publish_raw
from tests.support.workers import unique_queue
from worker.amqp.queue_depth import QueueDepth


async def test_ready_sums_the_queues_and_a_missing_one_counts_nothing_without_stopping_the_rest(
    test_vhost_url: str, queue: str
):
    with channel(test_vhost_url) as ch:
        ch.queue_declare(queue, durable=True)
    for n in range(3):
        publish_raw(test_vhost_url, queue, b"%d" % n)
    missing = unique_queue("missing")
    listed = [queue, missing, queue]
    connection = await aio_pika.connect_robust(test_vhost_url)
    depth = QueueDepth(connection, lambda: list(listed))
    try:
        with capture_logs() as logs:
            assert await depth.ready() == 6  # the 404 closed the channel; the next queue got a new one
            assert await depth.ready() == 6
        warnings = [e for e in logs if e["event"] == "queue_depth_unknown"]
        assert len(warnings) == 1 and missing in warnings[0]["errors"]  # once per run of failures
        listed[:] = [queue]
        assert await depth.ready() == 3
        listed[:] = [missing]
        with capture_logs() as logs:
            assert await depth.ready() == 0
        assert [e["event"] for e in logs] == ["queue_depth_unknown"]  # failing again: said again
    finally:
        await depth.close()
        await connection.close()
