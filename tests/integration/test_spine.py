"""Publish → worker process pool → result, on a real broker."""

from __future__ import annotations

import time

import msgpack
import pytest

from broker_svc import App, PublishError, ResultTimeout, Settings, TaskError
from broker_svc.errors import MessageTooLarge
from tests.support.amqp import drain, publish_raw, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess


def test_a_thousand_tasks_round_trip_with_correct_results(client: App, queue: str, worker: WorkerProcess):
    results = [client.send_task("tests.integration.e2e_tasks.add", (i, i), queue=queue) for i in range(1000)]
    client.flush(timeout=30)
    assert [r.get(timeout=60) for r in results] == [2 * i for i in range(1000)]
    assert all(r.successful() and r.state == "SUCCESS" for r in results)


def test_delay_on_a_registered_task_and_send_task_by_name(
    test_vhost_url: str, queue: str, worker: WorkerProcess
):
    app = App("mine", settings=Settings(broker_url=test_vhost_url))

    @app.task(name="tests.integration.e2e_tasks.add", queue=queue)
    def add(x: int, y: int) -> int:
        return x + y

    try:
        assert add.delay(2, 3).get(timeout=20) == 5
        assert add.apply_async((4, 4), queue=queue, priority=5).get(timeout=20) == 8
        assert app.send_task("e2e.echo", args=({"k": [1, "x"]},), queue=queue).get(timeout=20) == {
            "k": [1, "x"]
        }
    finally:
        app.close()


def test_a_raising_task_fails_with_the_remote_type_and_message(
    client: App, queue: str, worker: WorkerProcess
):
    result = client.send_task("tests.integration.e2e_tasks.boom", ("kaput",), queue=queue)
    with pytest.raises(ValueError, match="kaput") as info:
        result.get(timeout=20)
    assert isinstance(info.value, TaskError)
    assert info.value.exc_type == "ValueError" and info.value.exc_module == "builtins"
    assert "kaput" in (info.value.remote_traceback or "")
    assert result.state == "FAILURE" and result.failed()
    assert isinstance(result.get(timeout=1, propagate=False), ValueError)


def test_json_tasks_get_json_results(test_vhost_url: str, queue: str, worker: WorkerProcess):
    app = App("json-client", settings=Settings(broker_url=test_vhost_url, serializer="json"))
    try:
        assert app.send_task("e2e.echo", ([1, "a", None],), queue=queue).get(timeout=20) == [1, "a", None]
    finally:
        app.close()


def test_get_times_out_with_a_clear_error(client: App, queue: str):
    result = client.send_task("nobody.listens", queue=queue)
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        result.get(timeout=0.5)
    assert time.monotonic() - started < 3
    assert result.state == "PENDING"


def test_oversized_tasks_are_refused_before_publishing(test_vhost_url: str, queue: str):
    app = App("small", settings=Settings(broker_url=test_vhost_url, max_body_bytes=1024))
    try:
        with pytest.raises(MessageTooLarge):
            app.send_task("t.x", ("x" * 2048,), queue=queue)
        app.flush(timeout=5)
    finally:
        app.close()


def test_a_publish_the_broker_refuses_surfaces_on_get_and_flush(test_vhost_url: str, client: App):
    # A queue declared with other arguments makes our declare fail (406): nothing may be lost silently.
    from tests.support.amqp import channel, delete_queues

    name = f"conflict-{time.monotonic_ns()}"
    with channel(test_vhost_url) as ch:
        ch.queue_declare(name, durable=True, arguments={"x-max-length": 5})
    try:
        result = client.send_task("t.x", queue=name)
        with pytest.raises(PublishError):
            result.get(timeout=60)
        with pytest.raises(PublishError):
            client.flush(timeout=10)
    finally:
        delete_queues(test_vhost_url, name)


def test_each_confirm_mode_waits_for_the_broker(test_vhost_url: str, queue: str):
    app = App("strict", settings=Settings(broker_url=test_vhost_url, confirm="each"))
    try:
        for i in range(5):
            app.send_task("t.x", (i,), queue=queue)
        assert queue_depth(test_vhost_url, queue) == 5  # confirmed means enqueued, at return
    finally:
        app.close()


def test_clock_headers_increase_on_every_message_a_client_sends(client: App, queue: str, test_vhost_url: str):
    for i in range(20):
        client.send_task("t.x", (i,), queue=queue)
    client.flush(timeout=10)
    clocks = [m.headers["clock"] for m in drain(test_vhost_url, queue)]
    assert len(clocks) == 20
    assert all(b > a for a, b in zip(clocks, clocks[1:], strict=False))


def test_the_worker_clock_moves_past_any_clock_it_receives(
    test_vhost_url: str, queue: str, worker: WorkerProcess
):
    reply = f"reply-{time.monotonic_ns()}"
    from tests.support.amqp import channel, delete_queues

    with channel(test_vhost_url) as ch:
        ch.queue_declare(reply, durable=False, exclusive=False, auto_delete=False)
    try:
        publish_raw(
            test_vhost_url, queue, msgpack.packb([[1, 2], {}, {}]),
            headers={"task": "tests.integration.e2e_tasks.add", "id": "clock-1", "clock": 1_000_000},
            content_type="application/x-msgpack", reply_to=reply, correlation_id="clock-1",
        )  # fmt: skip
        got = wait_for(lambda: drain(test_vhost_url, reply), timeout_s=20, message="no result")
        assert msgpack.unpackb(got[0].body)["result"] == 3
        assert got[0].headers["clock"] > 1_000_000
    finally:
        delete_queues(test_vhost_url, reply)
