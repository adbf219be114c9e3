"""The asyncio client against a real worker: sends confirmed, results pushed, errors re-raised."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import pamqp.encode
import pytest

from broker_svc import App, Settings, chain, chord, group
from broker_svc.aio import AioGroupResult, AioResult, AsyncApp
from broker_svc.errors import ResultTimeout, TaskError, TaskRevokedError, Unroutable
from control.aio.client import AsyncControl
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import delete_queues, drain
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def aio_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("aio")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module")
def aio_worker(test_vhost_url: str, aio_queue: str) -> Iterator[WorkerProcess]:
    # The worker's app routes a chain's next steps to its default queue: this one.
    with WorkerProcess(
        test_vhost_url,
        app="tests.integration.canvas_tasks:app",
        queues=[aio_queue],
        concurrency=2,
        env={"CLOCKWORK_DEFAULT_QUEUE": aio_queue},
    ) as proc:
        yield proc.wait_ready()


def make_app(url: str, queue: str) -> App:
    """A client app with the worker's task names, typed as the functions are."""
    app = App("aio", settings=Settings(broker_url=url, default_queue=queue), set_as_current=False)

    @app.task(name="canvas.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="canvas.xsum")
    def xsum(numbers: list[int]) -> int:
        return sum(numbers)

    @app.task(name="canvas.fail")
    def fail(*args: Any) -> None:
        raise ValueError(args)

    @app.task(name="canvas.slow_add")
    def slow_add(x: int, y: int, seconds: float = 0.5) -> int:
        return x + y

    return app


@pytest.fixture
async def aapp(test_vhost_url: str, aio_queue: str, aio_worker: WorkerProcess) -> AsyncIterator[AsyncApp]:
    app = make_app(test_vhost_url, aio_queue)
    async with AsyncApp(app) as client:
        yield client
    app.close()


async def test_a_task_sent_from_asyncio_is_run_and_its_result_awaited(aapp: AsyncApp):
    add = aapp.app.tasks["canvas.add"]
    result = await aapp.delay(add, 2, 3)
    assert isinstance(result, AioResult)
    assert await result.get(timeout=30) == 5
    assert result.successful() and result.state == "SUCCESS"
    by_name = await aapp.send_task("canvas.add", (10, 20))
    assert await by_name.get(timeout=30) == 30


async def test_a_failed_task_raises_its_error_as_the_blocking_get_does(aapp: AsyncApp):
    result = await aapp.send_task("canvas.fail", (1,))
    with pytest.raises(ValueError, match="failed with") as caught:
        await result.get(timeout=30)
    assert isinstance(caught.value, TaskError)
    error = await result.get(timeout=1, propagate=False)
    assert isinstance(error, ValueError) and result.failed()


async def test_get_times_out_without_cancelling_the_wait_of_another_get(aapp: AsyncApp):
    result = await aapp.send_task("canvas.slow_add", (1, 2), {"seconds": 1.5})
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        await result.get(timeout=0.2)
    assert time.monotonic() - started < 1.0
    assert await result.get(timeout=30) == 3  # the same handle still gets the pushed result


async def test_wrong_arguments_are_refused_before_anything_is_sent(aapp: AsyncApp):
    add = aapp.app.tasks["canvas.add"]
    with pytest.raises(TypeError, match="canvas.add"):
        await aapp.delay(add, 1)


async def test_an_unroutable_task_raises_unroutable(aapp: AsyncApp):
    with pytest.raises(Unroutable):
        await aapp.send_task("canvas.add", (1, 2), exchange="amq.topic", routing_key="nobody.listens")


async def test_a_thousand_concurrent_sends_and_awaits_share_one_connection(aapp: AsyncApp):
    add = aapp.app.tasks["canvas.add"]

    async def one(i: int) -> int:
        result = await aapp.delay(add, i, i)
        value: int = await result.get(timeout=90)
        return value

    values = await asyncio.gather(*(one(i) for i in range(1200)))
    assert values == [2 * i for i in range(1200)]
    assert len(aapp._waiters) <= 1200  # handles released as they go


async def test_a_chain_from_asyncio_returns_the_last_step_with_its_parents(aapp: AsyncApp):
    add = aapp.app.tasks["canvas.add"]
    result = await aapp.apply_async(chain(add.s(1, 2), add.s(3), add.s(4)))
    assert isinstance(result, AioResult)
    assert await result.get(timeout=30) == 10
    assert isinstance(result.parent, AioResult) and await result.parent.get(timeout=5) == 6


async def test_a_chain_step_that_fails_fails_the_chains_result(aapp: AsyncApp):
    add, fail = aapp.app.tasks["canvas.add"], aapp.app.tasks["canvas.fail"]
    result = await aapp.apply_async(chain(add.s(1, 2), fail.s(), add.s(4)))
    assert isinstance(result, AioResult)
    with pytest.raises(ValueError, match="failed with"):
        await result.get(timeout=30)


async def test_a_group_and_a_chord_from_asyncio(aapp: AsyncApp):
    add, xsum = aapp.app.tasks["canvas.add"], aapp.app.tasks["canvas.xsum"]
    members = await aapp.apply_async(group(add.s(i, i) for i in range(5)))
    assert isinstance(members, AioGroupResult)
    assert await members.get(timeout=30) == [0, 2, 4, 6, 8]
    body = await aapp.apply_async(chord([add.s(i, 1) for i in range(4)], xsum.s()))
    assert isinstance(body, AioResult)
    assert await body.get(timeout=30) == 10
    assert isinstance(body.parent, AioGroupResult) and await body.parent.get(timeout=5) == [1, 2, 3, 4]


async def test_asyncio_sends_the_messages_the_blocking_client_sends(test_vhost_url: str):
    queue = unique_queue("aio-wire")
    app = make_app(test_vhost_url, queue)
    add = app.tasks["canvas.add"]
    try:
        app.send_task("canvas.add", (1, 2), task_id="blocking-1", countdown=0)
        app.flush(10)
        async with AsyncApp(app) as client:
            await client.send_task("canvas.add", (1, 2), task_id="aio-1", countdown=0)
            await client.apply_async(chain(add.si(1, 1), add.s(2)), task_id="aio-chain")
        got: list[Any] = []

        def arrived() -> bool:
            got.extend(drain(test_vhost_url, queue))
            return len(got) >= 3

        wait_for(arrived, timeout_s=10, message="3 sent")
    finally:
        app.close()
        delete_queues(test_vhost_url, queue)
    blocking, aio, chained = got
    assert blocking.body == aio.body  # [args, kwargs, embed], encoded the same
    for field in ("content_type", "content_encoding", "delivery_mode", "priority", "expiration"):
        assert getattr(blocking.properties, field) == getattr(aio.properties, field), field
    assert (blocking.properties.correlation_id, aio.properties.correlation_id) == ("blocking-1", "aio-1")
    skip = {"id", "root_id", "clock", "eta", "expires"}
    assert {k: v for k, v in blocking.headers.items() if k not in skip} == {
        k: v for k, v in aio.headers.items() if k not in skip
    }
    assert chained.headers["task"] == "canvas.add"


async def test_sends_survive_a_connection_closed_by_the_broker(
    session_broker: SessionBroker, test_vhost_url: str, aapp: AsyncApp
):
    ctl = session_broker.rabbitmqctl
    if ctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from the broker side)")
    add = aapp.app.tasks["canvas.add"]
    assert await (await aapp.delay(add, 1, 1)).get(timeout=30) == 2
    vhost = unquote(urlsplit(test_vhost_url).path[1:]) or "/"

    def close_ours() -> int:
        out = ctl("list_connections", "-p", vhost, "-q", "--no-table-headers", "pid", "client_properties")
        pids = [line.split("\t", 1)[0] for line in out.splitlines() if "clockwork-aio-aio" in line]
        for pid in pids:
            ctl("close_connection", pid, "aio reconnect test")
        return len(pids)

    assert await asyncio.to_thread(close_ours) == 1
    # Sent while the connection is being restored: each waits for it and goes again.
    results = await asyncio.gather(*(aapp.delay(add, i, 1) for i in range(20)))
    assert await asyncio.gather(*(r.get(timeout=60) for r in results)) == [i + 1 for i in range(20)]


@pytest.fixture
async def control(test_vhost_url: str, aio_worker: WorkerProcess) -> AsyncIterator[AsyncControl]:
    async with AsyncControl(Settings(broker_url=test_vhost_url)) as client:
        yield client


async def test_ping_and_inspect_from_asyncio_answer_once_every_live_worker_replied(
    control: AsyncControl, aio_worker: WorkerProcess
):
    started = time.monotonic()
    replies = await control.ping(timeout_s=10)
    assert {aio_worker.name: {"ok": "pong"}} in replies
    assert time.monotonic() - started < 8  # not the timeout: the members stream said who is alive
    registered = await control.registered(destination=aio_worker.name, timeout_s=10)
    assert "canvas.add" in registered[aio_worker.name]
    assert aio_worker.name in await control.stats(destination=[aio_worker.name], timeout_s=10)
    assert await control.active(destination=aio_worker.name, timeout_s=10) == {aio_worker.name: []}


async def test_revoke_from_asyncio_is_logged_and_the_revoked_task_never_runs(
    control: AsyncControl, aapp: AsyncApp, aio_worker: WorkerProcess
):
    task_id = f"revoked-{uuid.uuid4()}"
    revoked = await control.revoke(task_id, reply=True, destination=aio_worker.name, timeout_s=10)
    assert revoked.logged and aio_worker.name in revoked.answered
    result = await aapp.send_task("canvas.add", (1, 2), task_id=task_id)
    with pytest.raises(TaskRevokedError):
        await result.get(timeout=30)


async def test_async_control_sends_header_ints_as_older_celery_workers_read_them(
    test_vhost_url: str, monkeypatch: pytest.MonkeyPatch
):
    # pamqp picks 'b'/'s' for small ints, which py-amqp before 5.4.2 misreads; connecting installs
    # the worker's guard in this process. A stand-in for pamqp's own choice first (undone after).
    monkeypatch.setattr(pamqp.encode, "table_integer", lambda value: b"b" + struct.pack(">b", value))
    assert pamqp.encode.field_table({"n": 1}) == b"\x00\x00\x00\x04\x01nb\x01"
    async with AsyncControl(Settings(broker_url=test_vhost_url)):
        assert pamqp.encode.field_table({"n": 1}) == b"\x00\x00\x00\x07\x01nI\x00\x00\x00\x01"
