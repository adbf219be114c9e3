"""Every kind of bad input ends in the dead-letter queue with a reason; the worker keeps consuming."""

from __future__ import annotations

import json
import pickle
import time

import msgpack
import pytest

from broker_svc import App, Settings
from broker_svc.wire import codec
from control import ControlClient
from tests.support.amqp import channel, delete_queues, drain, publish_raw, queue_exists
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

VALID_BODY = json.dumps([[1, 2], {}, {}]).encode()
ADD = "tests.integration.e2e_tasks.add"
ACCEPT = codec.accept_set(["json", "msgpack"])

BAD_INPUTS = {
    "undecodable": (b"\xff\xfe not json", {"task": ADD, "id": "bad-1"}, "application/json", "DecodeError"),
    "pickle": (
        pickle.dumps([[1], {}, {}]),
        {"task": ADD, "id": "bad-2"},
        "application/x-python-serialize",
        "ContentDisallowed",
    ),
    "unknown_content_type": (
        b"a: 1",
        {"task": ADD, "id": "bad-3"},
        "application/x-yaml",
        "ContentDisallowed",
    ),
    "unknown_task": (VALID_BODY, {"task": "nope.nope", "id": "bad-4"}, "application/json", "NotRegistered"),
    "missing_id": (VALID_BODY, {"task": ADD}, "application/json", "InvalidTaskMessage"),
    "missing_task": (VALID_BODY, {"id": "bad-6"}, "application/json", "InvalidTaskMessage"),
    "not_v2_body": (
        msgpack.packb({"args": []}),
        {"task": ADD, "id": "bad-7"},
        "application/x-msgpack",
        "InvalidTaskMessage",
    ),
    "oversized": (
        json.dumps([["x" * 300_000], {}, {}]).encode(),
        {"task": ADD, "id": "bad-8"},
        "application/json",
        "MessageTooLarge",
    ),
}


@pytest.fixture
def small_limit_worker(test_vhost_url: str, queue: str):
    env = {"CLOCKWORK_MAX_BODY_BYTES": "100000"}
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=env) as proc:
        yield proc.wait_ready()


def test_bad_inputs_are_dead_lettered_with_a_reason(
    test_vhost_url: str, queue: str, client: App, small_limit_worker: WorkerProcess
):
    reply = f"reply-{time.monotonic_ns()}"
    with channel(test_vhost_url) as ch:
        ch.queue_declare(reply)
    try:
        for body, headers, content_type, _ in BAD_INPUTS.values():
            publish_raw(
                test_vhost_url, queue, body, headers=headers, content_type=content_type, reply_to=reply
            )
        # The worker is still consuming: a good task after the garbage runs.
        assert client.send_task(ADD, (20, 22), queue=queue).get(timeout=30) == 42

        dead: list = []

        def collect_dead() -> bool:
            dead.extend(drain(test_vhost_url, f"{queue}.dead"))
            return len(dead) >= len(BAD_INPUTS)

        wait_for(
            collect_dead,
            timeout_s=30,
            message=f"dead letters: {[d.headers.get('x-clockwork-reason') for d in dead]}",
        )
        reasons = sorted(d.headers["x-clockwork-reason"] for d in dead)
        assert reasons == sorted(expected for *_, expected in BAD_INPUTS.values())
        for letter in dead:
            assert letter.headers["x-clockwork-error"]
            assert letter.headers["x-clockwork-queue"] == queue
        # The original body and properties are kept for inspection and replay.
        by_reason = {d.headers["x-clockwork-reason"]: d for d in dead}
        assert by_reason["NotRegistered"].body == VALID_BODY
        assert by_reason["ContentDisallowed"].properties.content_type in (
            "application/x-python-serialize", "application/x-yaml"
        )  # fmt: skip

        # Those with an id and a reply_to got a FAILURE result; NotRegistered as Celery names it.
        results: dict = {}

        def collect() -> bool:
            for m in drain(test_vhost_url, reply):
                body = codec.decode(m.body, m.properties.content_type, accept=ACCEPT, max_bytes=1 << 20)
                results[body["task_id"]] = body
            return len(results) >= 6

        wait_for(collect, timeout_s=20, message=f"results: {sorted(results)}")
        assert results["bad-4"]["status"] == "FAILURE"
        assert results["bad-4"]["result"] == {
            "exc_type": "NotRegistered", "exc_message": ["nope.nope"], "exc_module": "celery.exceptions"
        }  # fmt: skip
        assert small_limit_worker.proc.poll() is None
        assert small_limit_worker.count("task_refused") >= 6
        # An unknown task says what usually causes it (two apps on one queue), and stats counts them.
        unknown = small_limit_worker.first("task_unknown")
        assert unknown["task_name"] == "nope.nope" and "queue of its own" in unknown["hint"]
        # Consuming children report their counts at most once a second: wait for it.
        with ControlClient(Settings(broker_url=test_vhost_url)) as control:
            wait_for(
                lambda: (
                    control.inspect("stats", destination=[small_limit_worker.name], timeout_s=10)[
                        small_limit_worker.name
                    ]["unknown_tasks"]
                    == {"nope.nope": 1}
                ),
                timeout_s=10,
                message="unknown_tasks in stats",
            )
    finally:
        delete_queues(test_vhost_url, reply)


def test_a_task_that_kills_its_child_is_retried_then_dead_lettered(
    test_vhost_url: str, queue: str, client: App, worker: WorkerProcess
):
    result = client.send_task("tests.integration.e2e_tasks.kill_child", queue=queue)
    # A consuming child's copy only knows its delivery count; the worker logs each death.
    lost = "killed its child|exited|WorkerLost|signal|deliveries did not finish"
    with pytest.raises(Exception, match=lost) as info:
        result.get(timeout=60)
    assert getattr(info.value, "exc_type", "") == "WorkerLostError"
    dead = wait_for(lambda: drain(test_vhost_url, f"{queue}.dead"), timeout_s=20, message="no dead letter")
    # One delivery limit for child and worker deaths (worker.rules.deliveries): 1 run + 3 more, then the DLQ.
    assert dead[0].headers["x-clockwork-reason"] == "delivery_limit"
    assert dead[0].headers["x-clockwork-deliveries"] == 3
    # Each of the 4 runs killed its child, and the worker logs each death (4: the dead letter comes
    # with the next delivery).
    assert worker.count("task_child_lost_retrying") == 4
    # The pool replaced its children: the worker still runs tasks.
    assert client.send_task("tests.integration.e2e_tasks.add", (1, 1), queue=queue).get(timeout=30) == 2


def test_a_deleted_dead_letter_queue_is_recreated_not_looped_on(
    test_vhost_url: str, queue: str, client: App, worker: WorkerProcess
):
    delete_queues(test_vhost_url, f"{queue}.dead")
    publish_raw(test_vhost_url, queue, VALID_BODY, headers={"task": "nope.nope", "id": "dlq-gone"})
    dlq = f"{queue}.dead"
    # Until the worker declares it again, the queue is not there to read (a read would be refused).
    dead = wait_for(
        lambda: drain(test_vhost_url, dlq) if queue_exists(test_vhost_url, dlq) else [],
        timeout_s=20,
        message="not dead-lettered",
    )
    assert dead[0].headers["x-clockwork-reason"] == "NotRegistered"
    assert client.send_task(ADD, (1, 2), queue=queue).get(timeout=30) == 3


def test_a_result_whose_caller_left_is_dropped_at_info_not_warning(
    test_vhost_url: str, queue: str, worker: WorkerProcess, client: App
):
    # A client that sent a task and exited: its reply queue is gone. That is normal (fire and
    # forget from a short script), so it must not raise a warning per task.
    headers = {"task": ADD, "id": "left-1"}
    publish_raw(test_vhost_url, queue, VALID_BODY, headers=headers, reply_to="gone.reply")
    line = worker.first("result_unroutable")
    assert line["level"] == "info" and line["task_id"] == "left-1"
    assert client.send_task(ADD, (1, 2), queue=queue).get(timeout=30) == 3  # still consuming
    assert [e["event"] for e in worker.events() if e.get("level") in ("warning", "error")] == []
