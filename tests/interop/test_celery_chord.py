"""A real Celery client's chords, joined by our workers on RabbitMQ alone (``ChordBackend``).

Celery refuses chords on ``rpc://``; with ``backend='broker_svc.celery_backend:ChordBackend'`` its
client sends them, our worker joins their parts in the broker, and the body's result comes back
as any rpc result. A Celery worker configured with that backend may run header tasks too: its
parts reach our joiner the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery, chain, chord, group
from celery import exceptions as celery_exceptions

from tests.interop.conftest import close_celery_client
from tests.interop.nested_chords import nested_chords
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

APP = "tests.integration.canvas_tasks:app"
BACKEND = "broker_svc.celery_backend:ChordBackend"


@pytest.fixture(scope="module")
def notes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("celery-chords") / "notes.jsonl"


@pytest.fixture(scope="module")
def ours(test_vhost_url: str, notes_path: Path) -> Iterator[str]:
    queue = unique_queue("celery-chord")
    env = {"CANVAS_NOTES": str(notes_path)}
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=2, env=env) as worker:
        worker.wait_ready()
        yield queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.fixture
def client(test_vhost_url: str) -> Iterator[Celery]:
    app = Celery("interop-chords", broker=test_vhost_url, backend=BACKEND)
    app.conf.update(accept_content=["json"], result_accept_content=["json"], task_serializer="json")
    yield app
    close_celery_client(app)


def s(client: Celery, name: str, *args, queue: str, **options):
    return client.signature(f"canvas.{name}", args=args, queue=queue, **options)


def test_a_celery_chord_runs_on_our_worker(client: Celery, ours: str):
    result = chord(s(client, "add", i, i, queue=ours) for i in range(5))(s(client, "xsum", queue=ours))
    assert result.get(timeout=30) == 20
    assert (
        group(s(client, "add", i, 1, queue=ours) for i in range(3)) | s(client, "xsum", queue=ours)
    ).apply_async().get(timeout=30) == 6


def test_a_celery_chain_through_a_group_runs_the_steps_after_the_chord(client: Celery, ours: str):
    c = chain(
        s(client, "add", 1, 1, queue=ours),
        group(s(client, "add", 10, queue=ours), s(client, "mul", 10, queue=ours)),
        s(client, "xsum", queue=ours),
        s(client, "mul", 2, queue=ours),
    )
    assert c.apply_async().get(timeout=30) == (12 + 20) * 2


def test_a_failed_header_task_fails_the_celery_body_with_a_chord_error(client: Celery, ours: str):
    result = chord([s(client, "add", 1, 1, queue=ours), s(client, "fail", 3, queue=ours)])(
        s(client, "xsum", queue=ours)
    )
    # Celery's get() raises the header's own error first (it follows the result's parent)...
    with pytest.raises(ValueError, match=r"failed with \[3\]"):
        result.get(timeout=30)
    # ...and the body's own result is the ChordError the joiner sent, as Celery's backends store.
    with pytest.raises(celery_exceptions.ChordError, match="Dependency"):
        client.AsyncResult(result.id).get(timeout=30)


def test_celery_chords_with_nested_headers_give_our_worker_what_celerys_workers_give(
    client: Celery, ours: str
):
    for name, (canvas, expected) in nested_chords(client, ours).items():
        assert canvas.apply_async().get(timeout=30) == expected, name


def test_add_to_chord_on_our_worker_and_on_a_celery_worker_grows_the_chord(
    client: Celery, ours: str, start_celery_worker, test_vhost_url: str, monkeypatch: pytest.MonkeyPatch
):
    header = [s(client, "grow", 1, [100, 200], queue=ours), s(client, "add", 2, 0, queue=ours)]
    assert chord(header)(s(client, "collect", queue=ours)).get(timeout=30) == [1, 101, 201, 2]
    # A Celery worker's header task adds through ChordBackend, and our joiner waits for it too.
    queue = unique_queue("celery-grow")
    monkeypatch.setenv("INTEROP_RESULT_BACKEND", BACKEND)
    start_celery_worker(queue)
    try:
        header = [s(client, "grow", 3, [30], queue=queue), s(client, "add", 4, 0, queue=ours)]
        assert chord(header)(s(client, "collect", queue=ours)).get(timeout=30) == [3, 33, 4]
    finally:
        delete_queues(test_vhost_url, queue)


def test_a_celery_worker_in_the_header_leaves_its_parts_for_our_joiner(
    client: Celery, ours: str, start_celery_worker, test_vhost_url: str, notes_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    queue = unique_queue("celery-header")
    monkeypatch.setenv("INTEROP_RESULT_BACKEND", BACKEND)
    monkeypatch.setenv("CANVAS_NOTES", str(notes_path))
    start_celery_worker(queue)
    try:
        # The header runs on the Celery worker, the body on ours; our worker joins.
        header = [s(client, "add", i, 100, queue=queue) for i in range(3)]
        result = chord(header)(s(client, "collect", queue=ours, kwargs={"label": "mixed"}))
        assert result.get(timeout=30) == [100, 101, 102]
        noted = [json.loads(line) for line in notes_path.read_text().splitlines()]
        assert noted.count(["collect", ["mixed", [100, 101, 102]]]) == 1
    finally:
        delete_queues(test_vhost_url, queue)


def test_waiting_on_a_large_chord_polls_nothing_while_the_replies_are_consumed(
    test_vhost_url: str, ours: str
):
    # Celery's rpc backend polled the reply queue for every header task not yet ended at each
    # event it drained: 20,100 declare + basic.get round trips for a 200-task header (minutes for
    # 1,000). Its consumer takes every reply anyway. bench.chord_header times the 1,000 case.
    from tests.interop.polling_backend import PollCountingBackend

    client = Celery(
        "interop-big-chord",
        broker=test_vhost_url,
        backend="tests.interop.polling_backend:PollCountingBackend",
    )
    client.conf.update(accept_content=["json"], result_accept_content=["json"], task_serializer="json")
    PollCountingBackend.polls = 0
    try:
        result = chord(s(client, "add", i, i, queue=ours) for i in range(200))(s(client, "xsum", queue=ours))
        assert result.get(timeout=60) == sum(2 * i for i in range(200))
        assert result.parent.get(timeout=10) == [2 * i for i in range(200)]
    finally:
        close_celery_client(client)
    assert PollCountingBackend.polls <= 2, PollCountingBackend.polls


@pytest.mark.parametrize(
    ("kind", "expected"), [("sig", 15), ("chain", 18), ("group", [5, 6, 7]), ("twice", 2)]
)
def test_self_replace_on_our_worker_answers_a_celery_client_as_a_celery_worker_would(
    client: Celery, ours: str, kind: str, expected: object
):
    assert s(client, "replace_with", 5, kind, queue=ours).delay().get(timeout=30) == expected


def test_a_celery_chain_goes_on_after_a_step_that_replaced_itself(client: Celery, ours: str):
    step = client.signature("canvas.replace_with", kwargs={"kind": "chain"}, queue=ours)
    result = chain(s(client, "add", 1, 1, queue=ours), step, s(client, "mul", 2, queue=ours)).delay()
    assert result.get(timeout=30) == 18
