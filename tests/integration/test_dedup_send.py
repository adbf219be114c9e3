"""Keyed dedup, the client's half, with no worker: what a keyed send puts in its gate shard queue,
and a DECLINED answer (published here as the gate publishes it) read by both clients."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from broker_svc import App, AsyncResult, Settings, TaskDeclined, chain
from broker_svc.aio import AsyncApp
from broker_svc.topology import LEGACY_NAMESPACE, dedup_gate_queue
from broker_svc.wire import codec
from broker_svc.wire.records.dedup import KEY_HEADER, TARGET_QUEUE_HEADER, TIMEOUT_HEADER, shard_of
from broker_svc.wire.results.message import Outcome, wire_exception
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import Got, channel, drain, publish_raw, queue_depth
from tests.support.workers import unique_queue

pytestmark = pytest.mark.timeout(60)

_DEDUP_HEADERS = {KEY_HEADER, TIMEOUT_HEADER, TARGET_QUEUE_HEADER}


@pytest.fixture(scope="module")
def url(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[str]:
    # The gate's shard queues are per vhost and durable: a vhost of this module's own.
    with session_broker.own_vhost("clockwork-dedupapi", fallback=test_vhost_url) as own:
        yield own


@pytest.fixture
def target(url: str) -> str:
    return unique_queue("dedup-target")


def _client(url: str, **settings: Any) -> App:
    app = App("dedup-send", settings=Settings(broker_url=url, **settings), set_as_current=False)

    @app.task(name="dedup_send.refresh", dedup_key="user_id")
    def refresh(user_id: int, force: bool = False) -> int:
        return user_id

    @app.task(name="dedup_send.plain")
    def plain(value: Any = None) -> Any:
        return value

    return app


@pytest.fixture
def client(url: str) -> Iterator[App]:
    app = _client(url)
    yield app
    app.close(timeout=10)


def _gate(key: str) -> str:
    return dedup_gate_queue(shard_of(key), LEGACY_NAMESPACE).name


def _take(url: str, key: str, count: int = 1, timeout_s: float = 10.0) -> list[Got]:
    """The first ``count`` messages of ``key`` in its gate shard, taken (acked), in order.

    A single-active-consumer quorum queue refuses basic.get, so this consumes, with a deadline.
    Messages of other keys met on the way are taken too (every key here is unique to its test).
    """
    got: list[Got] = []
    deadline = time.monotonic() + timeout_s
    with channel(url) as ch:
        for method, properties, body in ch.consume(_gate(key), inactivity_timeout=0.1):
            if method is not None:
                ch.basic_ack(method.delivery_tag)
                headers = dict(properties.headers or {})
                if headers.get(KEY_HEADER) == key:
                    got.append(Got(body, headers, properties, bool(method.redelivered)))
            if len(got) >= count or time.monotonic() > deadline:
                break
        ch.cancel()
    return got


def _declined(url: str, reply_queue: str, task_id: str, key: str) -> None:
    # What the gate publishes for a declined call: the rpc result body, as a worker sends results.
    error = wire_exception(
        "TaskDeclined", f"dedup key {key!r}: one running, one waiting", module="broker_svc.errors"
    )
    body, content_type, _ = codec.encode(
        Outcome(task_id=task_id, status="DECLINED", result=error).to_wire(), "json"
    )
    publish_raw(url, reply_queue, body, content_type=content_type, correlation_id=task_id)


def test_a_keyed_task_waits_in_its_gate_shard_with_its_key_timeout_and_target(
    url: str, client: App, target: str
):
    refresh = client.tasks["dedup_send.refresh"]
    user_id = uuid.uuid4().int % 10**9
    sent = [
        refresh.apply_async((user_id,), queue=target),
        refresh.apply_async(kwargs={"user_id": user_id}, queue=target),
        client.send_task("dedup_send.refresh", (user_id,), queue=target),  # by name: the task's key
    ]
    client.flush(timeout=10)
    assert queue_depth(url, target) == 0  # declared for the gate to send them on, and empty
    key = f"dedup_send.refresh:{user_id}"
    got = _take(url, key, count=3)
    assert [g.headers["id"] for g in got] == [r.id for r in sent]
    for message, result in zip(got, sent, strict=True):
        assert message.headers[KEY_HEADER] == key
        assert message.headers[TIMEOUT_HEADER] == 600
        assert message.headers[TARGET_QUEUE_HEADER] == target
        assert message.headers["task"] == "dedup_send.refresh"
        assert message.properties.reply_to == client.reply_queue
        assert message.properties.correlation_id == result.id


def test_the_body_and_headers_are_those_of_the_same_call_sent_without_a_key(
    url: str, client: App, target: str
):
    key = f"literal-{uuid.uuid4()}"
    task_id = str(uuid.uuid4())
    client.send_task("dedup_send.plain", (1, "two"), {"x": [3]}, queue=target, task_id=task_id, dedup_key=key)
    client.send_task("dedup_send.plain", (1, "two"), {"x": [3]}, queue=target, task_id=task_id)
    client.flush(timeout=10)
    [keyed] = _take(url, key)
    [ordinary] = drain(url, target)
    assert keyed.body == ordinary.body
    assert msgpack.unpackb(keyed.body)[:2] == [[1, "two"], {"x": [3]}]
    assert (keyed.headers[KEY_HEADER], keyed.headers[TARGET_QUEUE_HEADER]) == (key, target)

    def same(headers: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in headers.items() if k not in _DEDUP_HEADERS and k != "clock"}

    assert same(keyed.headers) == same(ordinary.headers)
    assert keyed.properties.content_type == ordinary.properties.content_type


def test_keys_of_different_shards_go_to_different_gate_queues(url: str, client: App, target: str):
    prefix = uuid.uuid4().hex
    first = f"{prefix}-0"
    second = next(k for k in (f"{prefix}-{n}" for n in itertools.count(1)) if shard_of(k) != shard_of(first))
    assert _gate(first) != _gate(second)
    for key in (first, second):
        client.send_task("dedup_send.plain", (key,), queue=target, dedup_key=key, dedup_timeout=30)
    client.flush(timeout=10)
    for key in (first, second):
        [got] = _take(url, key)
        assert got.headers[TIMEOUT_HEADER] == 30 and msgpack.unpackb(got.body)[0] == [key]
    assert queue_depth(url, target) == 0


def test_a_keyed_task_with_an_eta_goes_to_the_gate_not_to_a_delay_queue(url: str, client: App, target: str):
    key = f"eta-{uuid.uuid4()}"
    client.send_task("dedup_send.plain", queue=target, countdown=600, dedup_key=key)
    client.flush(timeout=10)
    [got] = _take(url, key)
    assert got.headers["eta"] is not None  # the worker holds it until then, after the gate
    assert got.properties.expiration is None


def test_the_queued_record_names_the_target_queue(url: str, target: str):
    app = _client(url, task_states=True)
    key = f"states-{uuid.uuid4()}"
    try:
        result = app.send_task("dedup_send.plain", queue=target, dedup_key=key)
        app.flush(timeout=10)
        [record] = app.jobs.history(result.id, timeout=10)
        assert (record.state, record.queue) == ("QUEUED", target)
    finally:
        app.close(timeout=10)
    assert len(_take(url, key)) == 1


def test_a_spooled_keyed_task_reaches_its_gate_shard(url: str, target: str, tmp_path: Path):
    app = _client(url, spool_dir=str(tmp_path / "spool"))
    key = f"spool-{uuid.uuid4()}"
    try:
        app.send_task("dedup_send.plain", queue=target, dedup_key=key)
        app.flush(timeout=10)
    finally:
        app.close(timeout=10)
    [got] = _take(url, key)
    assert got.headers[TARGET_QUEUE_HEADER] == target


def test_a_declined_result_raises_task_declined_and_reads_declined(url: str, client: App, target: str):
    key = f"declined-{uuid.uuid4()}"
    result = client.tasks["dedup_send.refresh"].apply_async((7,), queue=target, dedup_key=key)
    client.flush(timeout=10)
    assert result.state == "PENDING" and not result.ready()
    _declined(url, client.reply_queue, result.id, key)
    with pytest.raises(TaskDeclined, match=key):
        result.get(timeout=10)
    assert result.state == result.status == "DECLINED"
    assert result.ready() and not result.successful() and not result.failed()
    assert isinstance(result.get(timeout=1, propagate=False), TaskDeclined)
    assert isinstance(result.result, TaskDeclined)
    assert len(_take(url, key)) == 1


def test_a_chain_whose_keyed_first_step_is_declined_raises_task_declined(url: str, client: App, target: str):
    refresh, plain = client.tasks["dedup_send.refresh"], client.tasks["dedup_send.plain"]
    user_id = uuid.uuid4().int % 10**9
    key = f"dedup_send.refresh:{user_id}"
    last = chain(refresh.s(user_id).set(queue=target), plain.s().set(queue=target)).apply_async()
    assert isinstance(last, AsyncResult) and isinstance(last.parent, AsyncResult)
    first = last.parent
    client.flush(timeout=10)
    [got] = _take(url, key)
    assert got.headers["id"] == first.id  # the first step went to the gate, carrying the rest
    assert msgpack.unpackb(got.body)[2]["chain"][0]["task"] == "dedup_send.plain"
    _declined(url, client.reply_queue, first.id, key)
    with pytest.raises(TaskDeclined, match=key):
        last.get(timeout=10)  # the step after a declined one never comes: the decline answers


async def test_the_asyncio_client_sends_to_the_gate_and_raises_task_declined(
    url: str, client: App, target: str
):
    refresh = client.tasks["dedup_send.refresh"]
    user_id = uuid.uuid4().int % 10**9
    key = f"dedup_send.refresh:{user_id}"
    async with AsyncApp(client) as aapp:
        result = await aapp.delay(refresh, user_id)  # returns once the broker confirmed it
        literal = await aapp.send_task("dedup_send.plain", queue=target, dedup_key=f"aio-{user_id}")
        # (the blocking pika helpers run on a thread: the client's loop keeps consuming results)
        [got] = await asyncio.to_thread(_take, url, key)
        assert got.headers["id"] == result.id
        assert got.headers[TARGET_QUEUE_HEADER] == client.settings.default_queue
        [other] = await asyncio.to_thread(_take, url, f"aio-{user_id}")
        assert other.headers[TARGET_QUEUE_HEADER] == target and other.headers["id"] == literal.id
        await asyncio.to_thread(_declined, url, aapp.reply_queue, result.id, key)
        with pytest.raises(TaskDeclined, match=key):
            await result.get(timeout=10)
        assert result.state == "DECLINED" and result.ready()
        assert not result.successful() and not result.failed()
        assert isinstance(await result.get(timeout=1, propagate=False), TaskDeclined)
