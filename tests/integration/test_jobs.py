"""RQ's job calls over tasks: enqueue (job_id, ttl, result_ttl, at_front), fetch, cancel, delete."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from broker_svc import App, Settings, TaskRevokedError
from broker_svc.errors import ConfigurationError
from broker_svc.wire.task.task_message import parse_iso_datetime
from tests.infra.session_broker import SessionBroker
from tests.integration import e2e_tasks
from tests.support.amqp import channel, delete_queues, drain, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

STATES_ON = {"CLOCKWORK_TASK_STATES": "1"}


@pytest.fixture
def sender(test_vhost_url: str) -> Iterator[App]:
    app = App("sender", settings=Settings(broker_url=test_vhost_url, task_states=True))
    yield app
    app.close(timeout=10)


@pytest.fixture
def other(test_vhost_url: str) -> Iterator[App]:
    app = App("other", settings=Settings(broker_url=test_vhost_url, task_states=True))
    yield app
    app.close(timeout=10)


def test_enqueue_maps_job_id_ttl_result_ttl_and_at_front_onto_the_task_message(
    test_vhost_url: str, sender: App
):
    queue = unique_queue()
    job = sender.enqueue(
        e2e_tasks.add, 1, 2, job_id="job-1", ttl=60, result_ttl=30, at_front=True, queue=queue
    )
    sender.flush(10)
    assert job.id == "job-1"
    assert job.get_status() == "QUEUED"
    [got] = drain(test_vhost_url, queue)
    delete_queues(test_vhost_url, queue)
    assert got.properties.priority == 9
    headers = got.properties.headers
    assert headers["id"] == "job-1"
    assert headers["x-clockwork-result-ttl"] == 30_000
    expires = parse_iso_datetime(headers["expires"])
    assert 50 < (expires - dt.datetime.now(dt.UTC)).total_seconds() <= 60


@pytest.mark.timeout(300)
def test_a_status_asked_right_after_a_send_is_never_unknown_and_another_process_sees_it(
    session_broker: SessionBroker,
):
    # Read-your-writes: each status waits for this process's own QUEUED record before it reads
    # the stream. Without it, 291 of 10,000 answered UNKNOWN on this machine. A vhost of its own:
    # 10,000 more records would slow every cold reader of the module's shared stream.
    with session_broker.own_vhost("clockwork-jobs-ryw") as url:
        sender = App("sender", settings=Settings(broker_url=url, task_states=True))
        other = App("other", settings=Settings(broker_url=url, task_states=True))
        try:
            sent, unknown = [], 0
            for i in range(10_000):
                result = sender.send_task("tests.nobody.runs.this", (i,), queue="ryw")
                sent.append(result.id)
                if sender.jobs.status(result.id) == "UNKNOWN":
                    unknown += 1
            assert unknown == 0
            # Once the records are confirmed, any process sees them.
            sender.flush(timeout=30)
            assert {other.jobs.status(task_id) for task_id in sent[::100]} == {"QUEUED"}
        finally:
            sender.close(timeout=10)
            other.close(timeout=10)


def test_enqueue_sends_a_task_to_its_declared_queue_as_delay_does(test_vhost_url: str, sender: App):
    declared, explicit = unique_queue("declared"), unique_queue("explicit")

    @sender.task(name="tests.jobs.declared", queue=declared, priority=3)
    def declared_task(x: int) -> int:
        return x

    sender.enqueue(declared_task, 1)  # by the function
    sender.enqueue("tests.jobs.declared", 2)  # by its name, registered here
    sender.enqueue(declared_task, 3, queue=explicit)  # the call's own option wins
    sender.flush(10)
    try:
        routed = drain(test_vhost_url, declared)
        assert sorted(m.properties.headers["argsrepr"] for m in routed) == ["[1]", "[2]"]
        assert {m.properties.priority for m in routed} == {3}
        assert [m.properties.headers["argsrepr"] for m in drain(test_vhost_url, explicit)] == ["[3]"]
    finally:
        delete_queues(test_vhost_url, declared, explicit)


def test_enqueue_needs_task_states(client: App):
    with pytest.raises(ConfigurationError, match="task_states"):
        client.enqueue(e2e_tasks.add, 1, 2)


def test_fetch_cancel_and_delete_from_another_process_with_a_worker_that_skips_them(
    test_vhost_url: str, queue: str, sender: App, other: App, tmp_path: Path
):
    ran = tmp_path / "ran.txt"
    kept = sender.enqueue(e2e_tasks.record, str(ran), "kept", queue=queue)
    deleted = sender.enqueue(e2e_tasks.record, str(ran), "deleted", queue=queue)
    cancelled = sender.enqueue("tests.integration.e2e_tasks.record", str(ran), "cancelled", queue=queue)
    sender.flush(10)
    # Another process: RQ's Job.fetch, then delete and cancel, before any worker runs.
    assert other.jobs.fetch(deleted.id).get_status() == "QUEUED"
    other.jobs.fetch(deleted.id).delete()
    other.jobs.fetch(cancelled.id).cancel()
    assert deleted.get_status() == "DELETED"
    assert cancelled.get_status() == "REVOKED"
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as worker:
        worker.wait_ready()
        assert kept.get(timeout=30) == "kept"
        with pytest.raises(TaskRevokedError):
            cancelled.get(timeout=30)
        wait_for(
            lambda: [r.hostname for r in deleted.history() if r.state == "REVOKED"] == [worker.name],
            timeout_s=30,
            message="the worker skipped the deleted job",
        )
    assert ran.read_text().split() == ["kept"]
    assert deleted.get_status() == "DELETED"  # a deleted job stays deleted once a worker skips it
    assert kept.get_status() == "SUCCESS" and kept.is_finished and kept.result == "kept"
    assert [r.state for r in kept.history()] == ["QUEUED", "STARTED", "SUCCESS"]


def test_at_front_runs_ahead_of_the_queued_tasks_in_a_priority_queue(
    test_vhost_url: str, queue: str, tmp_path: Path
):
    # queue_max_priority on both sides declares the task queue with x-max-priority (Celery's
    # task_queue_max_priority); the at_front job, sent last, runs first.
    settings = Settings(broker_url=test_vhost_url, task_states=True, queue_max_priority=10)
    ran = tmp_path / "ran.txt"
    with App("front", settings=settings) as app:
        behind = [app.enqueue(e2e_tasks.record, str(ran), f"queued-{n}", queue=queue) for n in range(5)]
        front = app.enqueue(e2e_tasks.record, str(ran), "front", queue=queue, at_front=True)
        app.flush(10)
        env = {**STATES_ON, "CLOCKWORK_QUEUE_MAX_PRIORITY": "10"}
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=env) as worker:
            worker.wait_ready()
            for job in [front, *behind]:
                job.get(timeout=30)
    assert ran.read_text().split() == ["front", *(f"queued-{n}" for n in range(5))]


def test_a_result_ttl_makes_an_unread_result_expire(test_vhost_url: str, queue: str, sender: App):
    # result_ttl is the result message's expiration: a result nobody reads in time is dropped
    # (RQ's result_ttl). The reply goes to a queue of the test's own, which nobody consumes.
    replies = unique_queue("replies")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(replies, durable=True)
    try:
        job = sender.enqueue(e2e_tasks.add, 2, 3, result_ttl=1.0, queue=queue)
        sender.flush(10)
        [message] = drain(test_vhost_url, queue)  # re-sent with the test's reply queue
        with channel(test_vhost_url) as ch:
            properties = pika.BasicProperties(**{**vars(message.properties), "reply_to": replies})
            ch.basic_publish("", queue, message.body, properties)
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as worker:
            worker.wait_ready()
            wait_for(lambda: job.get_status() == "SUCCESS", timeout_s=30, message="the job ran")
            result = wait_for(lambda: _peek(test_vhost_url, replies), timeout_s=10, message="the result")
            assert result is not None and result.expiration == "1000"
            wait_for(lambda: queue_depth(test_vhost_url, replies) == 0, timeout_s=10, message="it expired")
    finally:
        delete_queues(test_vhost_url, replies)


def _peek(url: str, queue: str) -> pika.BasicProperties | None:
    # The first message's properties, left in the queue (closing the channel puts it back).
    with channel(url) as ch:
        method, properties, _body = ch.basic_get(queue, auto_ack=False)
        return properties if method is not None else None
