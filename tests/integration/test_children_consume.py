"""Consuming children (issue 16): each pool child consumes, runs, answers and acks its own tasks.

One worker for the module (``-c 2``, a 1 s AMQP heartbeat so a task that outlives it proves the
child's connection is serviced while the task runs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from broker_svc import App, AsyncResult, Settings, TaskError
from broker_svc.canvas.signature import chain
from broker_svc.errors import TaskRevokedError, TimeLimitExceeded
from broker_svc.wire.task.states import State
from tests.support.amqp import channel, delete_queues, drain, publish_raw, queue_depth
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

TASKS = "tests.integration.semantics_tasks"


@pytest.fixture(scope="module")
def feed_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("feed")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module", params=[1, 3], ids=["one-thread", "three-threads"])
def feed_threads(request: pytest.FixtureRequest) -> int:
    # Every behaviour here holds with a child's main thread consuming, and with --threads N.
    return int(request.param)


@pytest.fixture(scope="module")
def feed_worker(test_vhost_url: str, feed_queue: str, feed_threads: int) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        test_vhost_url,
        app=f"{TASKS}:app",
        queues=[feed_queue],
        concurrency=2,
        extra_args=[
            "--threads",
            str(feed_threads),
            "--broker-heartbeat",
            "1",
            "--without-mingle",
        ],
    ) as proc:
        yield proc.wait_ready()


@pytest.fixture
def app(test_vhost_url: str) -> Iterator[App]:
    client = App("feed-client", settings=Settings(broker_url=test_vhost_url))
    yield client
    client.close(timeout=10)


def _consumers(url: str, queue: str) -> int:
    with channel(url) as ch:
        return int(ch.queue_declare(queue, passive=True).method.consumer_count)


def test_each_child_consumes_and_the_worker_itself_does_not(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App
):
    wanted = 2  # a consumer per child (its threads, if any, share it)
    wait_for(
        lambda: _consumers(test_vhost_url, feed_queue) == wanted, timeout_s=30, message="child consumers"
    )
    results = [app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue) for _ in range(200)]
    pids = {r.get(timeout=60) for r in results}
    assert feed_worker.pid not in pids
    assert len(pids) == 2  # both children ran tasks, each from its own consumers
    assert feed_worker.log_text().count('"event": "feed_child_consuming"') >= wanted


def test_results_failures_and_the_request_a_task_sees(feed_queue: str, feed_worker: WorkerProcess, app: App):
    report = app.send_task(f"{TASKS}.report_request", queue=feed_queue).get(timeout=30)
    assert report["hostname"] == feed_worker.name and report["routing_key"] == feed_queue
    assert report["retries"] == 0
    with pytest.raises(ValueError, match="hooked failure") as info:
        app.send_task(f"{TASKS}.hooked", ("/dev/null",), {"fail": True}, queue=feed_queue).get(timeout=30)
    assert isinstance(info.value, TaskError) and "Traceback" in (info.value.remote_traceback or "")


def test_a_retry_is_a_confirmed_copy_and_runs_again(
    feed_queue: str, feed_worker: WorkerProcess, app: App, tmp_path: Path
):
    path = tmp_path / "attempts.jsonl"
    assert app.send_task(f"{TASKS}.succeeds_on_third", (str(path),), queue=feed_queue).get(timeout=60) == 2
    attempts = [json.loads(line)["attempt"] for line in path.read_text().splitlines()]
    assert attempts == [0, 1, 2]


def test_exhausted_retries_fail_and_are_kept_as_dead_letters(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App, tmp_path: Path
):
    result = app.send_task(f"{TASKS}.always_retry", (str(tmp_path / "a.jsonl"), 0.05), queue=feed_queue)
    with pytest.raises(ValueError, match="attempt 3"):
        result.get(timeout=60)
    kept = wait_for(
        lambda: [m for m in drain(test_vhost_url, f"{feed_queue}.dead") if m.headers.get("id") == result.id],
        timeout_s=20, message="the dead letter",
    )  # fmt: skip
    assert kept[0].headers["x-clockwork-reason"] == "max_retries_exceeded"


def test_soft_and_hard_time_limits(feed_queue: str, feed_worker: WorkerProcess, app: App):
    assert app.send_task(f"{TASKS}.soft_limited", queue=feed_queue).get(timeout=30) == "soft limit caught"
    started = time.monotonic()
    idle_deaths = feed_worker.count("pool_child_died_idle")
    replaced = feed_worker.count("pool_child_replaced")
    with pytest.raises(TimeLimitExceeded) as info:
        app.send_task(f"{TASKS}.hard_limited", queue=feed_queue).get(timeout=30)
    assert info.value.exc_type == "TimeLimitExceeded"
    assert info.value.args == (0.5,)  # Celery's TimeLimitExceeded(0.5): the limit, on the wire too
    assert str(info.value) == "task exceeded its hard time limit of 0.5 s"
    assert time.monotonic() - started < 4  # 0.5 s limit; the body would sleep 5 s
    # The child that was ended is replaced and the worker keeps serving.
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=60) > 0
    # ... and says why it replaced it: not a child that "died idle".
    wait_for(
        lambda: feed_worker.count("pool_child_replaced") > replaced, timeout_s=20, message="no replacement"
    )
    assert feed_worker.count("pool_child_died_idle") == idle_deaths


def test_the_worker_ends_a_task_that_holds_the_gil_past_its_hard_time_limit(
    feed_queue: str, feed_worker: WorkerProcess, app: App
):
    # The child's watchdog thread cannot run while the task is inside one long call into C: the
    # worker ends the child (GRACE_S after the limit), and the copy is answered, not run again.
    started = time.monotonic()
    with pytest.raises(TaskError) as info:
        app.send_task(f"{TASKS}.hard_limited_in_c", queue=feed_queue).get(timeout=60)
    assert info.value.exc_type == "TimeLimitExceeded"
    assert time.monotonic() - started < 4.5  # 0.5 s limit, 1 s grace; the call takes 6 s or more
    ended = [e for e in feed_worker.events() if e.get("event") == "task_time_limit_exceeded"]
    assert any(e.get("ended_by") == "worker" and e.get("limit_s") == 0.5 for e in ended), ended
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=60) > 0


def test_a_task_that_holds_the_gil_past_two_heartbeats_runs_once_and_answers(
    feed_queue: str, feed_worker: WorkerProcess, app: App, tmp_path: Path
):
    # No thread of its child runs during the call, its heartbeats included: the broker closes the
    # child's connection (1 s heartbeat) and requeues the delivery. The copy must wait for the run
    # (the board shows it), and the outcome go out once the child has connected again: one run.
    notes = tmp_path / "runs"
    count = 300_000_000  # about 3.5 s here, several heartbeats
    lost_before = feed_worker.count("feed_connection_lost")
    result = app.send_task(f"{TASKS}.recorded_in_c", (str(notes), count), queue=feed_queue)
    assert result.get(timeout=90) == sum(range(count))
    assert feed_worker.count("feed_connection_lost") > lost_before, "no connection lost: proves nothing"
    settled = ("task_settled_by_redelivery", "task_redelivery_done_acked")  # the copy, acked unrun

    def copy_settled() -> bool:
        return any(e.get("event") in settled and e.get("task_id") == result.id for e in feed_worker.events())

    wait_for(copy_settled, timeout_s=30, message="the requeued copy was never settled by the run's outcome")
    runs = [json.loads(line) for line in notes.read_text().splitlines()]
    assert len(runs) == 1, runs
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=60) > 0


def test_a_task_longer_than_two_heartbeats_keeps_its_connection(
    feed_queue: str, feed_worker: WorkerProcess, app: App
):
    pid = app.send_task(f"{TASKS}.sleeper", (3.5,), queue=feed_queue).get(timeout=30)
    assert pid > 0
    assert "broker_connection_lost" not in feed_worker.log_text().split("feed_child_consuming")[-1]


def test_bad_input_is_dead_lettered_and_answered(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App
):
    unknown = app.send_task("nobody.registers.this", queue=feed_queue)
    with pytest.raises(TaskError) as info:
        unknown.get(timeout=30)
    assert info.value.exc_type == "NotRegistered"
    publish_raw(
        test_vhost_url, feed_queue, b"\xff not json", headers={"id": "bad-1", "task": f"{TASKS}.sleeper"}
    )
    packed = msgpack.packb([[], {}, {}])
    publish_raw(
        test_vhost_url, feed_queue, packed, headers={"id": "pickled-1", "task": f"{TASKS}.sleeper"},
        content_type="application/x-python-serialize",
    )  # fmt: skip
    reasons = {}

    def kept() -> bool:
        for message in drain(test_vhost_url, f"{feed_queue}.dead"):
            reasons[message.headers.get("id")] = message.headers["x-clockwork-reason"]
        return {"bad-1", "pickled-1", unknown.id} <= reasons.keys()

    wait_for(kept, timeout_s=30, message="three dead letters")
    assert reasons[unknown.id] == "NotRegistered"
    assert reasons["pickled-1"] == "ContentDisallowed"
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=30) > 0  # still serving


def test_a_rate_limit_holds_for_the_worker_not_per_child(
    feed_queue: str, feed_worker: WorkerProcess, app: App
):
    # rate_limited is "4/s": five calls take at least a second however many children run them.
    started = time.monotonic()
    results = [app.send_task(f"{TASKS}.rate_limited", queue=feed_queue) for _ in range(5)]
    assert [r.get(timeout=30) for r in results] == ["ran"] * 5
    assert time.monotonic() - started >= 0.95


def test_a_chain_runs_step_by_step(feed_queue: str, feed_worker: WorkerProcess, app: App):
    step = app.signature(f"{TASKS}.sleeper", (0,), immutable=True, queue=feed_queue)
    result = chain(step, step.clone(), step.clone()).apply_async()
    assert isinstance(result, AsyncResult)
    assert isinstance(result.get(timeout=30), int)
    assert result.parent is not None and isinstance(result.parent.get(timeout=5), int)


def test_a_revoked_task_is_answered_and_never_runs(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App, tmp_path: Path
):
    path = tmp_path / "attempts.jsonl"
    task_id = f"revoked-{time.monotonic_ns()}"
    replies = call(test_vhost_url, "revoke", arguments={"task_id": [task_id]}, expect=1)
    assert replies[0][1][feed_worker.name]["ok"].endswith("flagged as revoked")
    result = app.send_task(f"{TASKS}.succeeds_on_third", (str(path),), queue=feed_queue, task_id=task_id)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=30)
    assert result.state == State.REVOKED
    assert not path.exists()


def test_inspect_active_shows_what_each_child_runs_and_terminate_ends_it(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App
):
    result = app.send_task(f"{TASKS}.sleeper", (30,), queue=feed_queue)

    def active() -> list[dict]:
        replies = call(test_vhost_url, "active", destination=[feed_worker.name], expect=1)
        return [t for t in replies[0][1][feed_worker.name] if t["id"] == result.id] if replies else []

    running = wait_for(active, timeout_s=20, message="the task in inspect active")
    assert running[0]["type"] == f"{TASKS}.sleeper" and running[0]["args"] == [30]
    assert running[0]["worker_pid"] not in (None, feed_worker.pid) and running[0]["time_start"] > 0
    assert running[0]["delivery_info"]["routing_key"] == feed_queue
    started = time.monotonic()
    replies = call(
        test_vhost_url, "revoke", arguments={"task_id": [result.id], "terminate": True},
        destination=[feed_worker.name], expect=1,
    )  # fmt: skip
    assert result.id in replies[0][1][feed_worker.name]["ok"]
    with pytest.raises(TaskRevokedError):
        result.get(timeout=30)
    assert time.monotonic() - started < 20  # not the 30 s the body would sleep
    wait_for(lambda: not active(), timeout_s=20, message="the terminated task gone from inspect active")
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=60) > 0  # a new child serves


def test_a_task_that_kills_its_child_stops_at_the_delivery_limit(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App
):
    # A classic queue keeps no delivery count: each redelivery is copied with its count first.
    result = app.send_task(f"{TASKS}.die", queue=feed_queue)
    with pytest.raises(TaskError) as info:
        result.get(timeout=90)
    assert info.value.exc_type == "WorkerLostError"
    kept = wait_for(
        lambda: [m for m in drain(test_vhost_url, f"{feed_queue}.dead") if m.headers.get("id") == result.id],
        timeout_s=20, message="the poison task's dead letter",
    )  # fmt: skip
    assert kept[0].headers["x-clockwork-reason"] == "delivery_limit"
    assert feed_worker.count("task_redelivery_counted") >= 3  # settings' delivery_limit is 3
    assert app.send_task(f"{TASKS}.sleeper", (0,), queue=feed_queue).get(timeout=60) > 0


def test_a_warm_shutdown_finishes_the_running_task_and_hands_back_the_rest(test_vhost_url: str, app: App):
    queue = unique_queue("feed-stop")
    try:
        with WorkerProcess(
            test_vhost_url, app=f"{TASKS}:app", queues=[queue], concurrency=1,
            extra_args=["--without-mingle"],
        ) as proc:  # fmt: skip
            proc.wait_ready()
            running = app.send_task(f"{TASKS}.sleeper", (2,), queue=queue)
            waiting = app.send_task(f"{TASKS}.sleeper", (0,), queue=queue)
            app.flush(timeout=10)

            def runs() -> bool:
                replies = call(test_vhost_url, "active", destination=[proc.name], expect=1)
                return bool(replies) and [t["id"] for t in replies[0][1][proc.name]] == [running.id]

            wait_for(runs, timeout_s=20, message="the first task running")
            assert proc.terminate(timeout_s=60) == 0
        assert running.get(timeout=10) > 0  # it finished, and its result went out before the exit
        assert queue_depth(test_vhost_url, queue) == 1  # the waiting one is back in its queue, unrun
        del waiting
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_runtime_changes_reach_every_child(
    test_vhost_url: str, feed_queue: str, feed_worker: WorkerProcess, app: App
):
    name = feed_worker.name
    queues = call(test_vhost_url, "active_queues", destination=[name], expect=1)
    assert [q["name"] for q in queues[0][1][name]] == [feed_queue]  # what the children consume
    # add_consumer / cancel_consumer: every child consumes the new queue, then none does.
    extra = unique_queue("feed-extra")
    try:
        replies = call(
            test_vhost_url, "add_consumer", arguments={"queue": extra}, destination=[name], expect=1
        )
        assert replies[0][1][name] == {"ok": f"add consumer {extra}"}
        wait_for(
            lambda: _consumers(test_vhost_url, extra) == 2,
            timeout_s=20,
            message="every child on it",
        )
        assert app.send_task(f"{TASKS}.sleeper", (0,), queue=extra).get(timeout=30) > 0
        queues = call(test_vhost_url, "active_queues", destination=[name], expect=1)
        assert [q["name"] for q in queues[0][1][name]] == [feed_queue, extra]
        replies = call(
            test_vhost_url, "cancel_consumer", arguments={"queue": extra}, destination=[name], expect=1
        )
        assert replies[0][1][name] == {"ok": f"no longer consuming from {extra}"}
        wait_for(lambda: _consumers(test_vhost_url, extra) == 0, timeout_s=20, message="no child on it")
    finally:
        delete_queues(test_vhost_url, extra, f"{extra}.dead")
    # time_limit: a hard limit of 1 s for sleeper, sent to every child.
    replies = call(
        test_vhost_url, "time_limit", arguments={"task_name": f"{TASKS}.sleeper", "hard": 1, "soft": None},
        destination=[name], expect=1,
    )  # fmt: skip
    assert replies[0][1][name] == {"ok": "time limits set successfully"}
    try:
        with pytest.raises(TaskError) as info:
            app.send_task(f"{TASKS}.sleeper", (5,), queue=feed_queue).get(timeout=30)
        assert info.value.exc_type == "TimeLimitExceeded"
    finally:
        unset = {"task_name": f"{TASKS}.sleeper", "hard": None, "soft": None}
        call(test_vhost_url, "time_limit", arguments=unset, destination=[name], expect=1)
    # rate_limit: 2/s for a task without a limit of its own, in the buckets every child shares.
    replies = call(
        test_vhost_url, "rate_limit", arguments={"task_name": f"{TASKS}.now", "rate_limit": "2/s"},
        destination=[name], expect=1,
    )  # fmt: skip
    assert replies[0][1][name] == {"ok": "new rate limit set successfully"}
    try:
        started = time.monotonic()
        results = [app.send_task(f"{TASKS}.now", queue=feed_queue) for _ in range(4)]
        for result in results:
            result.get(timeout=30)
        assert time.monotonic() - started >= 1.4  # four at 2/s: the last starts 1.5 s after the first
    finally:
        call(
            test_vhost_url, "rate_limit", arguments={"task_name": f"{TASKS}.now", "rate_limit": None},
            destination=[name], expect=1,
        )  # fmt: skip


def test_a_child_past_max_tasks_per_child_retires_and_is_replaced(test_vhost_url: str, app: App):
    queue = unique_queue("feed-recycle")
    try:
        with WorkerProcess(
            test_vhost_url, app=f"{TASKS}:app", queues=[queue], concurrency=1,
            extra_args=["--without-mingle", "--max-tasks-per-child", "3"],
        ) as proc:  # fmt: skip
            proc.wait_ready()
            pids = [app.send_task(f"{TASKS}.sleeper", (0,), queue=queue).get(timeout=60) for _ in range(7)]
            assert [len(set(pids[i : i + 3])) for i in (0, 3)] == [1, 1] and len(set(pids)) == 3
            assert proc.count("pool_child_recycled") == 2
            assert "pool_child_died_idle" not in proc.log_text()
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
