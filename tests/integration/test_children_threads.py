"""``--threads N``: N task threads per child, on one shared connection.

The behaviours every consuming child has (results, retries, limits, revokes, runtime changes) are
run with threads too by ``test_children_consume.py`` and ``test_task_semantics.py``; this module
covers what threads change: the child's threads share one connection and one consumer with
prefetch N, they run at once, a connection closed under them loses nothing, the soft time limit
reaches a thread, and a hard time limit ends the child with its other threads' tasks redelivered,
not lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import App, Settings, TaskError
from tests.support.amqp import delete_queues
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

TASKS = "tests.integration.thread_tasks"
THREADS = 4


@pytest.fixture(scope="module")
def threads_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("threads")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module")
def threads_worker(test_vhost_url: str, threads_queue: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        test_vhost_url,
        app=f"{TASKS}:app",
        queues=[threads_queue],
        concurrency=1,
        extra_args=["--threads", str(THREADS), "--without-mingle"],
    ) as proc:
        yield proc.wait_ready()


@pytest.fixture
def app(test_vhost_url: str) -> Iterator[App]:
    client = App("threads-client", settings=Settings(broker_url=test_vhost_url))
    yield client
    client.close(timeout=10)


def _active(url: str, worker: WorkerProcess) -> list[dict]:
    replies = call(url, "active", destination=[worker.name], expect=1)
    return list(replies[0][1][worker.name]) if replies else []


def test_one_child_runs_a_task_in_each_thread_at_once(
    test_vhost_url: str, threads_queue: str, threads_worker: WorkerProcess, app: App
):
    started = time.monotonic()
    results = [app.send_task(f"{TASKS}.where", (1.0,), queue=threads_queue) for _ in range(THREADS)]

    def all_running() -> list[dict]:
        active = _active(test_vhost_url, threads_worker)
        return active if len(active) == THREADS else []

    seen = wait_for(all_running, timeout_s=20, message="every thread's task in inspect active")
    assert len({task["worker_pid"] for task in seen}) == 1  # one child runs them all
    ran = [r.get(timeout=30) for r in results]
    assert time.monotonic() - started < 3.5  # one after another would take 4 s
    assert len({pid for pid, _ in ran}) == 1
    assert len({thread for _, thread in ran}) == THREADS


def _vhost(url: str) -> str:
    return unquote(urlsplit(url).path[1:]) or "/"


def _child_connections(session_broker, url: str, worker: WorkerProcess) -> list[str]:
    # The broker's pids of the worker's children's connections (named ``<hostname>.child-<pid>``).
    out = session_broker.rabbitmqctl(
        "list_connections", "-p", _vhost(url), "-q", "--no-table-headers", "pid", "client_properties"
    )
    return [line.split("\t", 1)[0] for line in out.splitlines() if f"{worker.name}.child-" in line]


def _consumers(session_broker, url: str, queue: str) -> list[tuple[str, int]]:
    # (channel pid, prefetch) of each consumer of ``queue``.
    out = session_broker.rabbitmqctl(
        "list_consumers", "-p", _vhost(url), "-q", "--no-table-headers", "queue_name", "channel_pid",
        "prefetch_count",
    )  # fmt: skip
    rows = [line.split("\t") for line in out.splitlines()]
    return [(row[1], int(row[2])) for row in rows if len(row) == 3 and row[0] == queue]


def test_a_childs_threads_share_one_connection_and_one_consumer_with_prefetch_threads(
    session_broker, test_vhost_url: str, threads_queue: str, threads_worker: WorkerProcess, app: App
):
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to list connections and consumers)")
    assert app.send_task(f"{TASKS}.quick", queue=threads_queue).get(timeout=30) == "done"
    consumers = wait_for(
        lambda: _consumers(session_broker, test_vhost_url, threads_queue),
        timeout_s=20, message="the child's consumer",
    )  # fmt: skip
    assert consumers == [(consumers[0][0], THREADS)]  # one consumer, as many unacked as threads
    assert len(_child_connections(session_broker, test_vhost_url, threads_worker)) == 1
    assert threads_worker.consumers_per_queue == 1


def test_the_prefetch_of_the_start_up_line_and_of_inspect_stats_is_what_the_broker_applies(
    session_broker, test_vhost_url: str, threads_queue: str, threads_worker: WorkerProcess, app: App
):
    # One source (worker/config.py:prefetch_for): children x threads x multiplier, per queue.
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to read the consumers' prefetch)")
    assert app.send_task(f"{TASKS}.quick", queue=threads_queue).get(timeout=30) == "done"
    banner = threads_worker.first("worker_ready")["prefetch"]
    replies = call(test_vhost_url, "stats", destination=[threads_worker.name], expect=1)
    stats = replies[0][1][threads_worker.name]["prefetch_count"]
    applied = sum(prefetch for _, prefetch in _consumers(session_broker, test_vhost_url, threads_queue))
    assert banner == stats == applied == 1 * THREADS * 1
    # Each child's own start-up line says its share, once (not once per thread, as it did).
    events = [e.get("event") for e in threads_worker.events()]
    first = events[: events.index("feed_connection_lost")] if "feed_connection_lost" in events else events
    started = [e for e in threads_worker.events()[: len(first)] if e.get("event") == "feed_child_consuming"]
    assert [(e["prefetch"], e["threads"]) for e in started] == [(banner, THREADS)], started


def test_a_connection_closed_under_running_threads_loses_no_task(
    session_broker, test_vhost_url: str, threads_queue: str, threads_worker: WorkerProcess, app: App
):
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close a connection from its side)")
    lost_before = threads_worker.count("feed_connection_lost")
    results = [app.send_task(f"{TASKS}.where", (0.2,), queue=threads_queue) for _ in range(12 * THREADS)]
    wait_for(
        lambda: len(_active(test_vhost_url, threads_worker)) == THREADS,
        timeout_s=20, message="every thread busy",
    )  # fmt: skip
    (pid,) = _child_connections(session_broker, test_vhost_url, threads_worker)
    session_broker.rabbitmqctl("close_connection", pid, "threads test: forced disconnect")
    ran = [r.get(timeout=60) for r in results]  # each task answered: none lost with the connection
    assert len(ran) == 12 * THREADS
    # One line for the lost connection, not one per thread that met the loss.
    lost = [e for e in threads_worker.events() if e.get("event") == "feed_connection_lost"]
    assert len(lost) == lost_before + 1, lost
    wait_for(
        lambda: len(_child_connections(session_broker, test_vhost_url, threads_worker)) == 1,
        timeout_s=20, message="one connection again",
    )  # fmt: skip
    # And it consumes again: more tasks run, on one consumer.
    assert app.send_task(f"{TASKS}.quick", queue=threads_queue).get(timeout=30) == "done"
    assert len(_consumers(session_broker, test_vhost_url, threads_queue)) == 1


def test_the_soft_time_limit_reaches_a_task_in_a_thread(
    threads_queue: str, threads_worker: WorkerProcess, app: App
):
    assert app.send_task(f"{TASKS}.spin_caught", queue=threads_queue).get(timeout=30) == "soft limit caught"
    started = time.monotonic()
    with pytest.raises(TaskError) as info:
        app.send_task(f"{TASKS}.spin", queue=threads_queue).get(timeout=30)
    assert info.value.exc_type == "SoftTimeLimitExceeded"
    assert "soft time limit (0.3 s) exceeded" in str(info.value)
    assert time.monotonic() - started < 3  # not the 5 s the body would spin
    # Tasks that end within their limit are never reached by a stray one, in any thread.
    quick = [app.send_task(f"{TASKS}.quick", queue=threads_queue) for _ in range(200)]
    assert [r.get(timeout=60) for r in quick] == ["done"] * 200


def test_a_hard_time_limit_ends_the_child_and_its_other_threads_tasks_run_again(
    test_vhost_url: str, threads_queue: str, threads_worker: WorkerProcess, app: App
):
    long = app.send_task(f"{TASKS}.where", (2.0,), queue=threads_queue)
    wait_for(
        lambda: any(t["id"] == long.id for t in _active(test_vhost_url, threads_worker)),
        timeout_s=20, message="the long task running",
    )  # fmt: skip
    with pytest.raises(TaskError) as info:
        app.send_task(f"{TASKS}.hard_limited", queue=threads_queue).get(timeout=30)
    assert info.value.exc_type == "TimeLimitExceeded"
    # Its neighbour went back to the queue with the child's connection, and runs in the new child.
    pid, _ = long.get(timeout=60)
    assert pid != threads_worker.pid
    assert threads_worker.count("task_time_limit_exceeded") >= 1


def test_inspect_reserved_lists_what_the_threads_hold_behind_their_tasks(test_vhost_url: str, app: App):
    # Two threads, multiplier 2: two tasks run, the two sent after them wait in the child's
    # connection, where only the child can see them: inspect reserved asks it.
    queue = unique_queue("held")
    args = ["--threads", "2", "--prefetch-multiplier", "2", "--without-mingle"]
    try:
        with WorkerProcess(
            test_vhost_url, app=f"{TASKS}:app", queues=[queue], concurrency=1, extra_args=args
        ) as proc:
            worker = proc.wait_ready()
            running = [app.send_task(f"{TASKS}.where", (3.0,), queue=queue) for _ in range(2)]
            wait_for(lambda: len(_active(test_vhost_url, worker)) == 2, timeout_s=20, message="two running")
            waiting = [app.send_task(f"{TASKS}.where", (0.0,), queue=queue) for _ in range(2)]

            def reserved() -> list[dict]:
                replies = call(test_vhost_url, "reserved", destination=[worker.name], expect=1)
                found = list(replies[0][1][worker.name]) if replies else []
                return found if len(found) == 2 else []

            held = wait_for(reserved, timeout_s=10, message="the two waiting tasks in inspect reserved")
            assert sorted(task["id"] for task in held) == sorted(r.id for r in waiting)
            assert all(task["name"] == f"{TASKS}.where" and task["args"] == [0.0] for task in held), held
            assert all(task["time_start"] is None and task["hostname"] == worker.name for task in held), held
            assert {task["id"] for task in _active(test_vhost_url, worker)} == {r.id for r in running}
            assert len({pid for pid, _ in (r.get(timeout=30) for r in running + waiting)}) == 1
            replies = call(test_vhost_url, "reserved", destination=[worker.name], expect=1)
            assert replies and list(replies[0][1][worker.name]) == []  # all ran: nothing held
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
