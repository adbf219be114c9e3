"""Mingle between our workers: a new worker learns a peer's revoked ids and clock; bad replies are skipped."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from control.protocol.revoke_log import LOGGED_HEADER
from tests.support.amqp import channel
from tests.support.pidbox import call
from tests.support.workers import WorkerProcess


def _mingle(worker: WorkerProcess) -> dict[str, Any]:
    return worker.first("mingle_done")


def test_a_new_worker_learns_a_peers_revoked_ids_and_clock(test_vhost_url: str, queue: str):
    ids = [str(uuid.uuid4()) for _ in range(3)]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as first:
        first.wait_ready()
        # Marked as logged, so the first worker does not journal it: only Mingle can carry it over.
        call(
            test_vhost_url, "revoke", arguments={"task_id": ids}, destination=[first.name],
            headers={LOGGED_HEADER: True}, expect=1,
        )  # fmt: skip
        call(test_vhost_url, "ping", destination=[first.name], clock=700_000, expect=1)
        first_clock = call(test_vhost_url, "clock", destination=[first.name], expect=1)[0][1][first.name][
            "clock"
        ]
        assert first_clock > 700_000
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as second:
            second.wait_ready()
            mingled = _mingle(second)
            assert first.name in mingled["nodes"] and mingled["new_revoked"] >= 3
            revoked = call(test_vhost_url, "revoked", destination=[second.name], expect=1)[0][1][second.name]
            assert set(ids) <= set(revoked)
            clock = call(test_vhost_url, "clock", destination=[second.name], expect=1)[0][1][second.name][
                "clock"
            ]
            assert clock > first_clock
            # Membership told it whom to wait for, so it did not wait out Celery's 1 s of silence.
            assert mingled["peers_known"] is True
            assert mingled["ms"] < 1000


@pytest.fixture
def stand_in(test_vhost_url: str) -> Iterator[list[str]]:
    """A fake peer that heartbeats and answers every hello with malformed values."""
    names = [f"liar{uuid.uuid4().hex[:6]}@test", f"liar{uuid.uuid4().hex[:6]}@test"]
    stop = threading.Event()
    ready = threading.Event()

    def serve() -> None:
        with channel(test_vhost_url) as ch:
            ch.exchange_declare("celery.pidbox", exchange_type="fanout", durable=False)
            ch.exchange_declare("celeryev", exchange_type="topic", durable=True)
            node_queue = ch.queue_declare("", exclusive=True).method.queue
            ch.queue_bind(node_queue, "celery.pidbox")
            ready.set()
            next_beat = 0.0
            while not stop.is_set():
                if time.monotonic() >= next_beat:
                    for name in names:
                        event = {"type": "worker-heartbeat", "hostname": name, "timestamp": time.time(),
                                 "freq": 2.0, "clock": 1, "pid": 1}  # fmt: skip
                        ch.basic_publish(
                            "celeryev", "worker.heartbeat", json.dumps(event).encode(),
                            pika.BasicProperties(content_type="application/json", headers={"hostname": name}),
                        )  # fmt: skip
                    next_beat = time.monotonic() + 1.0
                method, props, body = ch.basic_get(node_queue, auto_ack=True)
                if method is None:
                    ch.connection.sleep(0.02)
                    continue
                request = json.loads(body)
                if request.get("method") != "hello" or "reply_to" not in request:
                    continue
                properties = pika.BasicProperties(
                    content_type="application/json", headers={"ticket": request["ticket"]}
                )
                bad_values = ["not a map", {"revoked": "nonsense", "clock": "x"}]
                for name, value in zip(names, bad_values, strict=True):
                    ch.basic_publish(
                        request["reply_to"]["exchange"], request["reply_to"]["routing_key"],
                        json.dumps({name: value}).encode(),
                        properties,
                    )  # fmt: skip

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield names
    stop.set()
    thread.join(10)


def test_malformed_hello_replies_are_skipped_and_the_worker_starts(
    test_vhost_url: str, queue: str, stand_in: list[str], client
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        mingled = _mingle(worker)
        assert set(mingled["skipped"]) == set(stand_in)
        assert worker.count("mingle_reply_skipped") == 2
        assert (
            client.send_task("tests.integration.e2e_tasks.add", args=(1, 1), queue=queue).get(timeout=30) == 2
        )


def test_hello_replies_stay_small_with_100k_revoked_ids(test_vhost_url: str, queue: str):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        ids = [f"{i:08d}-{uuid.uuid4().hex[:8]}" for i in range(100_000)]
        for chunk in range(0, len(ids), 10_000):
            call(
                test_vhost_url, "revoke", arguments={"task_id": ids[chunk : chunk + 10_000]},
                destination=[worker.name], headers={LOGGED_HEADER: True}, expect=1, wait_s=20,
            )  # fmt: skip
        revoked = call(test_vhost_url, "revoked", destination=[worker.name], expect=1, wait_s=20)
        assert len(revoked[0][1][worker.name]) == 50_000  # the LimitedSet's maxlen
        replies = call(
            test_vhost_url, "hello", arguments={"from_node": "other@test", "revoked": {}},
            destination=[worker.name], expect=1, wait_s=20,
        )  # fmt: skip
        value = replies[0][1][worker.name]
        assert len(value["revoked"]) == 10_000 and len(json.dumps(value)) < 1_500_000
        # Celery's LimitedSet shape: id -> [float insertion time, id], newest ones kept.
        some_id, entry = next(iter(value["revoked"].items()))
        assert isinstance(entry[0], float) and entry[1] == some_id
        assert ids[-1] in value["revoked"]
