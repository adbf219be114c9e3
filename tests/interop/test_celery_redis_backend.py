"""Celery's Redis result backend against our workers: a Celery app on Redis results runs unchanged.

Every test runs on the session's private ``redis-server`` (tests/infra/redis_server.py), never
the machine's. Our worker loads ``tests/interop/redis_tasks.py``, whose app has that Redis as its
``result_backend``; Celery clients and a Celery worker are configured with the same URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery import exceptions as celery_exceptions

from broker_svc import App, ChordError
from broker_svc import chord as our_chord
from broker_svc.aio import AsyncApp
from tests.infra.redis_server import private_redis_server
from tests.interop.conftest import ROOT, close_celery_client, connected_sockets
from tests.interop.nested_chords import nested_chords
from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

APP = "tests.interop.redis_tasks:app"


def stored(client: Any, key: str) -> bytes:
    """The value Redis holds at ``key`` (it must hold one)."""
    value = client.get(key)
    assert isinstance(value, bytes), f"nothing stored at {key}"
    return value


@pytest.fixture(scope="module")
def notes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("redis-backend") / "notes.jsonl"


@pytest.fixture(scope="module")
def ours(test_vhost_url: str, redis_server: Any, notes_path: Path) -> Iterator[WorkerProcess]:
    queue = unique_queue("redis-backend")
    env = {"CANVAS_NOTES": str(notes_path), "CLOCKWORK_TEST_REDIS_URL": redis_server.url}
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=2, env=env) as worker:
        worker.wait_ready()
        yield worker
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def client(test_vhost_url: str, redis_url: str, redis_server: Any) -> Iterator[Celery]:
    app = Celery("interop-redis", broker=test_vhost_url, backend=redis_url)
    app.conf.update(accept_content=["json"], result_accept_content=["json"], task_serializer="json")
    yield app
    close_celery_client(app)
    # What the chords and results above opened to Redis is closed now, not when collected.
    assert connected_sockets(redis_server.port) == 0


def s(client: Celery, name: str, *args: Any, queue: str, **options: Any) -> Any:
    return client.signature(f"canvas.{name}", args=args, queue=queue, **options)


def in_another_process(code: str, timeout_s: float = 60) -> Any:
    """Run ``code`` in a fresh Python process; it prints one JSON value, returned here."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def celery_reader(broker: str, backend: str, body: str) -> str:
    """A Celery client of its own, on the same Redis, that has sent nothing."""
    head = (
        "import json\nfrom celery import Celery\n"
        f"app = Celery('elsewhere', broker={broker!r}, backend={backend!r})\n"
        "app.conf.update(accept_content=['json'], result_accept_content=['json'])\n"
    )
    return head + textwrap.dedent(body)


def test_a_celery_clients_result_is_stored_in_celerys_format_and_read_from_another_process(
    client: Celery, ours: WorkerProcess, store: redis.Redis, test_vhost_url: str, redis_url: str
):
    queue = ours.queues[0]
    result = s(client, "add", 2, 3, queue=queue).delay()
    assert result.get(timeout=30) == 5
    key = f"celery-task-meta-{result.id}"
    meta = json.loads(stored(store, key))
    assert meta["status"] == "SUCCESS" and meta["result"] == 5 and meta["task_id"] == result.id
    assert meta["traceback"] is None and meta["children"] == [] and meta["date_done"]
    # result_extended is on in the worker's app: Celery's extra fields.
    assert meta["name"] == "canvas.add" and meta["args"] == [2, 3] and meta["queue"] == queue
    assert meta["worker"] == ours.name and meta["retries"] == 0
    assert 86_000 < store.ttl(key) <= 86_400  # result_expires, a day by default
    # A process that sent nothing reads it, as Celery's AsyncResult(id) does.
    got = in_another_process(
        celery_reader(
            test_vhost_url, redis_url, f"print(json.dumps(app.AsyncResult({result.id!r}).get(timeout=30)))"
        )
    )
    assert got == 5
    # So does Celery's command line, which hung on an rpc:// result it could not reach.
    shown = subprocess.run(
        [sys.executable, "-m", "celery", "--broker", test_vhost_url, "--result-backend", redis_url, "result",
         result.id],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0 and shown.stdout.strip() == "5", shown.stderr[-2000:]


def test_a_failure_is_stored_with_its_exception_and_traceback(
    client: Celery, ours: WorkerProcess, store: redis.Redis
):
    result = s(client, "fail", 7, queue=ours.queues[0]).delay()
    with pytest.raises(ValueError, match=r"failed with \[7\]"):
        result.get(timeout=30)
    meta = json.loads(stored(store, f"celery-task-meta-{result.id}"))
    assert meta["status"] == "FAILURE"
    assert meta["result"] == {
        "exc_type": "ValueError",
        "exc_message": ["failed with [7]"],
        "exc_module": "builtins",
    }
    assert "Traceback" in meta["traceback"]


def test_retry_and_started_states_are_visible_from_another_process(
    client: Celery, ours: WorkerProcess, tmp_path: Path, test_vhost_url: str, redis_url: str
):
    # task_track_started in the worker's app: STARTED, with Celery's {pid, hostname}, while it runs.
    unblock = tmp_path / "unblock"
    running = client.send_task("redis.block_until", args=(str(unblock),), queue=ours.queues[0])
    started = in_another_process(
        celery_reader(
            test_vhost_url, redis_url,
            f"""
            import time
            r, deadline = app.AsyncResult({running.id!r}), time.monotonic() + 30
            while r.state != "STARTED" and time.monotonic() < deadline:
                time.sleep(0.02)
            print(json.dumps([r.state, r.info]))
            """,
        )
    )  # fmt: skip
    assert started[0] == "STARTED" and started[1]["hostname"] == ours.name and started[1]["pid"] > 0
    unblock.touch()
    assert running.get(timeout=30) == "unblocked"
    flag = tmp_path / "go"
    result = client.send_task("redis.retry_until", args=(str(flag),), queue=ours.queues[0])
    seen = in_another_process(
        celery_reader(
            test_vhost_url, redis_url,
            f"""
            import time
            r, states, deadline = app.AsyncResult({result.id!r}), [], time.monotonic() + 30
            while "RETRY" not in states and time.monotonic() < deadline:
                state = r.state
                if not states or states[-1] != state:
                    states.append(state)
                time.sleep(0.02)
            print(json.dumps({{"states": states, "info": repr(r.info)}}))
            """,
        )
    )  # fmt: skip
    assert "RETRY" in seen["states"], seen
    assert "FileNotFoundError" in seen["info"]
    flag.touch()
    assert result.get(timeout=30) >= 1
    got = in_another_process(
        celery_reader(test_vhost_url, redis_url, f"print(json.dumps(app.AsyncResult({result.id!r}).state))")
    )
    assert got == "SUCCESS"


def test_a_celery_chord_on_redis_results_runs_on_our_workers_and_cleans_up(
    client: Celery, ours: WorkerProcess, store: redis.Redis
):
    queue = ours.queues[0]
    result = chord(s(client, "add", i, i, queue=queue) for i in range(5))(s(client, "xsum", queue=queue))
    assert result.get(timeout=30) == 20
    group_id = result.parent.id
    # Celery's cleanup, once the body is confirmed (it may run first): the chord's keys are gone
    # and its claim says done, so a late copy of a header task changes nothing.
    keys = [f"celery-taskset-meta-{group_id}{suffix}" for suffix in (".j", ".s", ".d", ".t")]
    wait_for(
        lambda: store.get(f"celery-taskset-meta-{group_id}.c") == b"done", timeout_s=10, message="no cleanup"
    )
    assert store.exists(*keys) == 0
    assert ours.count("chord_body_sent") >= 1
    # A chain through a group, as Celery turns it into a chord: the steps after the body run too.
    steps = chain(
        s(client, "add", 1, 1, queue=queue),
        group(s(client, "add", 10, queue=queue), s(client, "mul", 10, queue=queue)),
        s(client, "xsum", queue=queue),
        s(client, "mul", 2, queue=queue),
    )
    assert steps.apply_async().get(timeout=30) == (12 + 20) * 2
    # A chain inside the header counts as one part (its last step's), as Celery counts it.
    header = [
        chain(s(client, "add", 1, 1, queue=queue), s(client, "add", 2, queue=queue)),
        s(client, "add", 3, 3, queue=queue),
    ]
    assert chord(header)(s(client, "xsum", queue=queue)).get(timeout=30) == 4 + 6
    # A group inside the header: Celery's client flattens it into the header, and it is joined.
    nested = chord([group(s(client, "add", 1, 1, queue=queue), s(client, "add", 2, 2, queue=queue)),
                    s(client, "add", 3, 3, queue=queue)])(s(client, "xsum", queue=queue))  # fmt: skip
    assert nested.get(timeout=30) == 2 + 4 + 6


def test_nested_headers_and_add_to_chord_give_the_same_values_on_a_celery_worker_and_on_ours(
    client: Celery, ours: WorkerProcess, start_celery_worker: Any, monkeypatch: pytest.MonkeyPatch,
    redis_url: str, test_vhost_url: str,
):  # fmt: skip
    theirs = unique_queue("redis-nested")
    monkeypatch.setenv("INTEROP_RESULT_BACKEND", redis_url)
    start_celery_worker(theirs)
    try:
        for queue in (theirs, ours.queues[0]):
            for name, (canvas, expected) in nested_chords(client, queue).items():
                assert canvas.apply_async().get(timeout=30) == expected, (name, queue)
            # add_to_chord counts the added task in Redis (<group>.t); Celery orders the values of
            # one header place by their stored bytes, so they are compared as sets.
            grown = chord(
                [s(client, "grow", 1, [100, 200], queue=queue), s(client, "add", 2, 0, queue=queue)]
            )
            assert sorted(grown(s(client, "collect", queue=queue)).get(timeout=30)) == [1, 2, 101, 201], queue
    finally:
        delete_queues(test_vhost_url, theirs)


def test_a_failed_header_task_fails_the_redis_chord_with_a_chord_error(
    client: Celery, ours: WorkerProcess, store: redis.Redis
):
    queue = ours.queues[0]
    result = chord([s(client, "add", 1, 1, queue=queue), s(client, "fail", 3, queue=queue)])(
        s(client, "xsum", queue=queue)
    )
    with pytest.raises(
        celery_exceptions.ChordError, match=r"Dependency .* raised ValueError\('failed with \[3\]'\)"
    ):
        client.AsyncResult(result.id).get(timeout=30)
    # Its size is dropped once the body's failure is stored, so a late copy fails nothing again.
    size_key = f"celery-taskset-meta-{result.parent.id}.s"
    wait_for(lambda: store.exists(size_key) == 0, timeout_s=10, message="the chord's size was kept")


def test_a_mixed_fleet_of_a_celery_worker_and_ours_joins_chords_on_one_redis(
    client: Celery, ours: WorkerProcess, start_celery_worker: Any, monkeypatch: pytest.MonkeyPatch,
    redis_url: str, notes_path: Path, test_vhost_url: str,
):  # fmt: skip
    theirs = unique_queue("redis-celery")
    monkeypatch.setenv("INTEROP_RESULT_BACKEND", redis_url)
    start_celery_worker(theirs)
    mine = ours.queues[0]
    try:
        # Whichever worker ends the last header task counts the chord complete and sends the body
        # (the Celery worker runs one task at a time: its fast task ends well before our slow one).
        slow_theirs = chord(
            [s(client, "add", 1, 0, queue=mine), s(client, "slow_add", 2, 0, 1.5, queue=theirs)]
        )(s(client, "collect", queue=mine, kwargs={"label": "celery-completes"}))
        slow_ours = chord(
            [s(client, "slow_add", 3, 0, 4.0, queue=mine), s(client, "add", 4, 0, queue=theirs)]
        )(s(client, "collect", queue=mine, kwargs={"label": "clockwork-completes"}))
        assert slow_theirs.get(timeout=60) == [1, 2]
        assert slow_ours.get(timeout=60) == [3, 4]

        def sent_by_us() -> set[str]:
            return {
                str(event.get("group_id"))
                for event in ours.events()
                if event.get("event") == "chord_body_sent"
            }

        # Logged once the body is confirmed and the chord cleaned up, which may follow its result.
        wait_for(lambda: slow_ours.parent.id in sent_by_us(), timeout_s=10, message="our worker sent no body")
        counted = {
            event.get("group_id") for event in ours.events() if event.get("event") == "chord_part_counted"
        }
        assert slow_theirs.parent.id in counted  # our worker counted its part of that chord...
        assert slow_theirs.parent.id not in sent_by_us()  # ...and the Celery worker sent the body
        noted = [json.loads(line) for line in notes_path.read_text().splitlines()]
        assert noted.count(["collect", ["celery-completes", [1, 2]]]) == 1
        assert noted.count(["collect", ["clockwork-completes", [3, 4]]]) == 1
    finally:
        delete_queues(test_vhost_url, theirs)


def test_our_client_on_redis_reads_results_from_another_process_and_from_celery_workers(
    ours: WorkerProcess, test_vhost_url: str, redis_url: str, start_celery_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    app = App("redis-client", broker=test_vhost_url, backend=redis_url, set_as_current=False)
    try:
        sent = app.send_task("canvas.add", (20, 22), queue=ours.queues[0])
        assert sent.get(timeout=30) == 42
        got = in_another_process(
            f"""
            import json
            from broker_svc import App
            app = App("elsewhere", broker={test_vhost_url!r}, backend={redis_url!r}, set_as_current=False)
            result, job = app.AsyncResult({sent.id!r}), app.jobs.fetch({sent.id!r})
            print(json.dumps([result.get(timeout=30), result.state, job.get(timeout=30)]))
            app.close()
            """
        )
        assert got == [42, "SUCCESS", 42]  # app.jobs.fetch(id) reads it too

        async def read_from_asyncio() -> Any:  # another client: the result reached the sender's queue only
            reader = App("aio-reader", broker=test_vhost_url, backend=redis_url, set_as_current=False)
            try:
                async with AsyncApp(reader) as aapp:
                    return await aapp.AsyncResult(sent.id).get(timeout=30)
            finally:
                reader.close()

        assert asyncio.run(read_from_asyncio()) == 42
        store = redis.Redis.from_url(redis_url)
        try:
            assert store.exists(f"celery-task-meta-{sent.id}") == 1
            sent.forget()  # as Celery's: the stored key goes
            assert store.exists(f"celery-task-meta-{sent.id}") == 0
        finally:
            store.close()
        # Our client's own chords are joined on RabbitMQ; their bodies' results, a ChordError
        # from the joiner included, are stored in Redis too, so another process reads them.
        q = ours.queues[0]
        joined = our_chord([app.signature("canvas.add", (1, 1), queue=q)])(
            app.signature("canvas.xsum", queue=q)
        )
        failed = our_chord(
            [app.signature("canvas.add", (1, 1), queue=q), app.signature("canvas.fail", (3,), queue=q)]
        )(app.signature("canvas.xsum", queue=q))
        assert joined.get(timeout=30) == 2
        with pytest.raises(ChordError):
            failed.get(timeout=30)
        read = in_another_process(
            f"""
            import json
            from broker_svc import App
            app = App("elsewhere", broker={test_vhost_url!r}, backend={redis_url!r}, set_as_current=False)
            error = app.AsyncResult({failed.id!r}).get(timeout=30, propagate=False)
            value = app.AsyncResult({joined.id!r}).get(timeout=30)
            print(json.dumps([value, type(error).__name__, str(error)]))
            app.close()
            """
        )
        assert read[0] == 2 and read[1] == "ChordError" and "Dependency" in read[2]
        # A Celery worker on the same Redis sends no rpc reply: the result comes through Redis.
        theirs = unique_queue("redis-celery-ours")
        monkeypatch.setenv("INTEROP_RESULT_BACKEND", redis_url)
        start_celery_worker(theirs)
        try:
            assert app.send_task("canvas.mul", (6, 7), queue=theirs).get(timeout=30) == 42
        finally:
            delete_queues(test_vhost_url, theirs)
    finally:
        app.close()


def test_a_result_redis_does_not_take_waits_for_redis_and_is_stored_not_lost(test_vhost_url: str):
    # A Redis of its own, stopped while the task runs: the worker holds the result (and the ack)
    # and retries; once Redis is back the result is stored, then the rpc reply goes out.
    with private_redis_server() as server:
        queue = unique_queue("redis-down")
        env = {"CLOCKWORK_TEST_REDIS_URL": server.url}
        with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=1, env=env) as worker:
            worker.wait_ready()
            server.stop()
            app = App("redis-down-client", broker=test_vhost_url, set_as_current=False)  # rpc:// results
            try:
                sent = app.send_task("canvas.add", (5, 6), queue=queue)
                worker.first("result_backend_retry", timeout_s=30)
                assert not sent.ready()  # nothing is answered before the result is stored
                server.start()
                assert sent.get(timeout=30) == 11
                client = redis.Redis.from_url(server.url)
                try:
                    assert json.loads(stored(client, f"celery-task-meta-{sent.id}"))["result"] == 11
                finally:
                    client.close()
                # Stored on the first run's retries (its log line may follow the result by a moment).
                wait_for(lambda: worker.count("task_succeeded") == 1, timeout_s=10, message="one run")
                assert worker.count("task_succeeded") == 1
            finally:
                app.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
