"""Revoke holds: queued, running (terminate), across a worker restart, and while no worker runs."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import aio_pika
import aio_pika.abc
import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from structlog.testing import capture_logs

from broker_svc import App, Settings, State, TaskRevokedError
from broker_svc.clock import LamportClock
from broker_svc.topology import LEGACY_NAMESPACE, revocation_log
from control.protocol.revoke_log import RevokeEntry
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import channel
from tests.support.events import EventTap
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue
from worker.pool.feeding import REVOKE_KNOWN_WAIT_S
from worker.remote.revocation_log import RevocationLog
from worker.remote.revoked_set import RevokedSet
from worker.remote.revoker import Revoker

RECORD = "tests.integration.e2e_tasks.record"
SLEEP = "tests.integration.e2e_tasks.sleep_s"
LOG = "clockwork.revoked.celery"


def _declare_log(ch: BlockingChannel) -> None:
    spec = revocation_log(LEGACY_NAMESPACE)
    ch.queue_declare(spec.name, durable=spec.durable, arguments=spec.arguments)


def _ran(path: Path) -> set[str]:
    return set(path.read_text().split()) if path.exists() else set()


def _ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def test_revoked_queued_tasks_never_run(test_vhost_url: str, queue: str, client: App, tmp_path: Path):
    ran = tmp_path / "ran.txt"
    with (
        WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=["-E"]) as worker,
        EventTap(test_vhost_url) as tap,
    ):
        worker.wait_ready()
        blocker = client.send_task(SLEEP, args=(1.5,), queue=queue)
        ids = _ids(6)
        results = [client.send_task(RECORD, args=(str(ran), i), queue=queue, task_id=i) for i in ids]
        client.flush()
        revoked = ids[::2]
        replies = call(test_vhost_url, "revoke", arguments={"task_id": revoked}, expect=1)
        assert replies[0][1][worker.name]["ok"].endswith("flagged as revoked")
        blocker.get(timeout=30)
        for task_id, result in zip(ids, results, strict=True):
            if task_id in revoked:
                with pytest.raises(TaskRevokedError):
                    result.get(timeout=30)
                assert result.state == State.REVOKED
            else:
                assert result.get(timeout=30) == task_id
        tap.wait(lambda ev: len(tap.of("task-revoked")) >= 3, message="task-revoked events")
    assert _ran(ran) == set(ids) - set(revoked)  # 0 revoked tasks executed
    assert {e["uuid"] for e in tap.of("task-revoked")} == set(revoked)
    assert all(e["terminated"] is False and e["expired"] is False for e in tap.of("task-revoked"))
    # Prefetched ones were received before the revoke came; none of them started.
    assert not any(tap.of("task-started", uuid=i) for i in revoked)


@pytest.mark.parametrize(
    ("terminate", "sig"),
    [(True, "SIGKILL"), (1, 9)],  # ours, and Flower's spelling (a 0/1 flag, a signal number)
)
def test_terminate_kills_the_running_task_and_records_revoked(
    test_vhost_url: str, queue: str, client: App, terminate: bool | int, sig: str | int
):
    with (
        WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=["-E"]) as worker,
        EventTap(test_vhost_url) as tap,
    ):
        worker.wait_ready()
        long = client.send_task(SLEEP, args=(60,), queue=queue)
        tap.wait(lambda ev: bool(tap.of("task-started", uuid=long.id)), message="the long task started")
        replies = call(
            test_vhost_url, "revoke", arguments={"task_id": long.id, "terminate": terminate, "signal": sig},
            expect=1,
        )  # fmt: skip
        assert replies[0][1] == {worker.name: {"ok": f"terminate: {long.id}"}}
        with pytest.raises(TaskRevokedError, match="terminated"):
            long.get(timeout=30)
        assert long.state == State.REVOKED
        tap.wait(lambda ev: bool(tap.of("task-revoked", uuid=long.id)), message="task-revoked")
        event = tap.of("task-revoked", uuid=long.id)[0]
        assert event["terminated"] is True and event["signum"] == "9"
        # The child was replaced; the worker goes on.
        assert (
            client.send_task("tests.integration.e2e_tasks.add", args=(1, 2), queue=queue).get(timeout=30) == 3
        )
        # Terminating a task that is not running says so.
        replies = call(test_vhost_url, "terminate", arguments={"task_id": "nope"}, expect=1)
        assert replies[0][1] == {worker.name: {"ok": "terminate: tasks unknown"}}
    assert worker.proc.returncode == 0


def test_async_result_revoke_skips_a_queued_task_and_terminates_a_running_one(
    test_vhost_url: str, queue: str, client: App, tmp_path: Path
):
    # Celery's AsyncResult.revoke(connection=None, terminate=False, signal=None, wait=False, timeout=None).
    ran = tmp_path / "ran.txt"
    with (
        WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=["-E"]) as worker,
        EventTap(test_vhost_url) as tap,
    ):
        worker.wait_ready()
        long = client.send_task(SLEEP, args=(60,), queue=queue)
        queued = client.send_task(RECORD, args=(str(ran), "queued"), queue=queue)
        tap.wait(lambda ev: bool(tap.of("task-started", uuid=long.id)), message="the long task started")
        queued.revoke()  # a cast, as Celery's
        long.revoke(terminate=True, signal="SIGKILL", wait=True, timeout=10)
        with pytest.raises(TaskRevokedError, match="terminated"):
            long.get(timeout=30)
        with pytest.raises(TaskRevokedError):
            queued.get(timeout=30)
        assert (long.state, queued.state) == (State.REVOKED, State.REVOKED)
        # Each from the process that answered it (the worker, a new child): in either order.
        tap.wait(
            lambda ev: bool(tap.of("task-revoked", uuid=queued.id) and tap.of("task-revoked", uuid=long.id)),
            message="task-revoked of both",
        )
        assert tap.of("task-revoked", uuid=long.id)[0]["terminated"] is True
        assert tap.of("task-revoked", uuid=queued.id)[0]["terminated"] is False
    assert not ran.exists()  # the queued task never ran
    assert worker.proc.returncode == 0


def test_a_restarted_worker_remembers_from_its_state_file(
    test_vhost_url: str, queue: str, client: App, tmp_path: Path
):
    ran = tmp_path / "ran.txt"
    name = f"restart{uuid.uuid4().hex[:6]}@test"
    ids = _ids(3)
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=name) as worker:
        worker.wait_ready()
        replies = call(test_vhost_url, "revoke", arguments={"task_id": ids[:2]}, expect=1)
        assert name in replies[0][1]
    assert worker.proc.returncode == 0
    # Without the broker's log, only the state file can tell the new process what was revoked.
    with channel(test_vhost_url) as ch:
        ch.queue_delete(LOG)
    results = [client.send_task(RECORD, args=(str(ran), i), queue=queue, task_id=i) for i in ids]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=name) as worker:
        worker.wait_ready()
        assert results[2].get(timeout=30) == ids[2]
        for result in results[:2]:
            with pytest.raises(TaskRevokedError):
                result.get(timeout=30)
        revoked = call(test_vhost_url, "revoked", destination=[name], expect=1)[0][1][name]
        assert set(ids[:2]) <= set(revoked)
    assert _ran(ran) == {ids[2]}


def test_a_revoke_logged_while_no_worker_runs_holds_when_one_starts(
    test_vhost_url: str, queue: str, client: App, tmp_path: Path
):
    ran = tmp_path / "ran.txt"
    ids = _ids(4)
    # The task messages wait in the queue; no worker of this queue exists yet.
    results = [client.send_task(RECORD, args=(str(ran), i), queue=queue, task_id=i) for i in ids]
    client.flush()
    with channel(test_vhost_url) as ch:
        ch.confirm_delivery()
        _declare_log(ch)
        entry = RevokeEntry.new(ids[:3], hostname="test")
        ch.basic_publish(
            "", LOG, entry.encode(),
            pika.BasicProperties(content_type="application/json", delivery_mode=2, headers={"clock": 7}),
        )  # fmt: skip
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        assert results[3].get(timeout=30) == ids[3]
        for result in results[:3]:
            with pytest.raises(TaskRevokedError):
                result.get(timeout=30)
        logged = [e for e in worker.events() if e.get("event") == "revocation_log_read"]
        assert logged and logged[0]["revoked"] >= 3
    assert _ran(ran) == {ids[3]}


def test_bad_revocation_entries_are_skipped(vhost_url: str):
    # A vhost of its own: the log is a stream, and every later worker would read the garbage.
    queue = unique_queue("revoke-garbage")
    with channel(vhost_url) as ch:
        ch.confirm_delivery()
        _declare_log(ch)
        for body in (b"\xff\x00garbage", json.dumps({"task_ids": "not-a-list"}).encode(), b"[1,2]"):
            ch.basic_publish("", LOG, body, pika.BasicProperties(headers={"clock": -5}))
    client = App("revoke-garbage", settings=Settings(broker_url=vhost_url))
    try:
        with WorkerProcess(vhost_url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready()
            wait_for(
                lambda: sum(e.get("event") == "revocation_entry_refused" for e in worker.events()) >= 3,
                timeout_s=15,
                message="three refused entries logged",
            )
            result = client.send_task("tests.integration.e2e_tasks.add", args=(2, 2), queue=queue)
            assert result.get(timeout=30) == 4
    finally:
        client.close(timeout=10)


def test_a_task_sent_after_a_revoke_with_reply_is_skipped_by_consuming_children(
    test_vhost_url: str, queue: str, client: App, tmp_path: Path
):
    # The worker replies once every child has applied the revoke: once revoke(reply=True)
    # returns, a task sent with that id reaches a child that holds the id. Without a reply nothing
    # orders the revoke (control queue, worker) before the task (task queue, child): docs/guide.md.
    ran = tmp_path / "ran.txt"
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        for _ in range(20):
            task_id = str(uuid.uuid4())
            replies = client.control.revoke(task_id, reply=True, timeout=5)
            assert replies == [{worker.name: {"ok": f"tasks {{'{task_id}'}} flagged as revoked"}}]
            with pytest.raises(TaskRevokedError):
                client.send_task(RECORD, args=(str(ran), task_id), queue=queue, task_id=task_id).get(
                    timeout=30
                )
        # The reply waits for the children: with one stopped, it comes after the bound, logged.
        stats = call(test_vhost_url, "stats", destination=[worker.name], expect=1)[0][1][worker.name]
        stopped = stats["pool"]["processes"][0]
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            replies = client.control.revoke(str(uuid.uuid4()), reply=True, timeout=5)
            waited_s = time.monotonic() - started
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert replies is not None and len(replies) == 1
        assert "flagged as revoked" in replies[0][worker.name]["ok"]
        assert waited_s >= REVOKE_KNOWN_WAIT_S
        assert len(worker.first("feed_revoke_not_confirmed")["slots"]) == 1
    assert not ran.exists()


def test_a_revocation_log_refused_at_start_is_followed_once_a_retry_gets_through(
    session_broker: SessionBroker, vhost_url: str, queue: str, tmp_path: Path
):
    # Workers that start together race to declare the new stream, and the broker may refuse the
    # first consume; a refusal the test controls (no configure permission on the log) stands in
    # for that race. The worker tries again and reads the log before it takes a task.
    ctl = session_broker.rabbitmqctl
    if ctl is None:
        pytest.fail("this test sets permissions, which needs rabbitmqctl for the broker")
    vhost, user, password = unquote(urlsplit(vhost_url).path[1:]), f"revlog-{uuid.uuid4().hex[:8]}", "pw"
    parts = urlsplit(vhost_url)
    user_url = urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port or 5672}"))
    ran, ids = tmp_path / "ran.txt", _ids(2)
    client = App("revlog-retry", settings=Settings(broker_url=vhost_url))
    ctl("add_user", user, password)
    try:
        ctl("set_permissions", "-p", vhost, user, r"^(?!clockwork\.revoked\.).*", ".*", ".*")
        results = [client.send_task(RECORD, args=(str(ran), i), queue=queue, task_id=i) for i in ids]
        client.flush()
        with channel(vhost_url) as ch:
            ch.confirm_delivery()
            _declare_log(ch)
            ch.basic_publish(
                "", LOG, RevokeEntry.new(ids[:1], hostname="test").encode(),
                pika.BasicProperties(content_type="application/json", delivery_mode=2, headers={"clock": 7}),
            )  # fmt: skip
        with WorkerProcess(user_url, queues=[queue], concurrency=1) as worker:
            retrying = worker.first("revocation_log_retrying", timeout_s=30)
            assert "ACCESS_REFUSED" in retrying["error"] or "403" in retrying["error"], retrying
            ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
            worker.wait_ready()
            read = worker.first("revocation_log_read", timeout_s=30)
            assert read["revoked"] >= 1
            assert worker.count("revocation_log_unavailable") == 0
            with pytest.raises(TaskRevokedError):
                results[0].get(timeout=30)
            assert results[1].get(timeout=30) == ids[1]
        assert _ran(ran) == {ids[1]}
    finally:
        client.close(timeout=10)
        ctl("delete_user", user)


async def test_a_follow_whose_connection_the_broker_closed_tries_again_on_a_live_one(test_vhost_url: str):
    # Workers that start together race the new stream's start, and RabbitMQ can answer the consume
    # by crashing the channel and closing the whole connection (INTERNAL_ERROR): the next channel
    # is asked of a closed connection, which aiormq refuses with a RuntimeError. That attempt is
    # retried like a refused consume, on the connection once it is back.
    async def never_terminated(_task_id: str, _sig: int) -> bool:
        return False

    revoker = Revoker(RevokedSet(), terminate=never_terminated, state_path=None)
    following = RevocationLog(revoker, clock=LamportClock(), hostname="t@h", namespace=uuid.uuid4().hex[:8])
    closed = await aio_pika.connect(test_vhost_url)
    await closed.close()
    live = await aio_pika.connect(test_vhost_url)
    asked: list[aio_pika.abc.AbstractConnection] = []

    async def channel() -> aio_pika.abc.AbstractChannel:
        asked.append(closed if not asked else live)
        return await asked[-1].channel()

    try:
        with capture_logs() as logs:
            await following.follow(channel, await live.channel(), retry_pauses_s=(0.05,))
        assert asked == [closed, live]
        assert following.available
        assert [e["event"] for e in logs if e["log_level"] != "debug"] == ["revocation_log_retrying"]
        # ... then it read the log to its end (a start-up step: at debug).
        assert [e["event"] for e in logs if e["event"] == "revocation_log_read"] == ["revocation_log_read"]
    finally:
        await live.close()
