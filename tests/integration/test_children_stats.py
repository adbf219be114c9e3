"""``--dedupe-window``, inspect ``stats`` ``total`` and the metrics, counted by the children.

The dedupe window is the worker's, shared by its children: a copy of a task id reaching another
child than the one that ran (or runs) it is a duplicate. ``stats`` and the metrics count the
children's tasks as the worker's consumer counts its own, so the same test holds for both designs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings
from broker_svc.errors import TaskRevokedError
from tests.support.amqp import delete_queues, queue_depth
from tests.support.metrics import free_port, scrape
from tests.support.process_tree import descendants
from tests.support.waiting import poll, wait_for
from tests.support.workers import WorkerProcess, unique_queue

TASKS = "tests.integration.stats_tasks"
WINDOW_S = 6.0  # long enough for the redelivery test's late copy on a loaded machine


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def app(test_vhost_url: str) -> Iterator[App]:
    client = App("stats-client", settings=Settings(broker_url=test_vhost_url))
    yield client
    client.close(timeout=10)


# -- --dedupe-window, shared by the children ------------------------------------------------------


@pytest.fixture(scope="module")
def dedupe_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("dedupe")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module")
def deduping(test_vhost_url: str, dedupe_queue: str) -> Iterator[WorkerProcess]:
    args = ["--dedupe-window", str(WINDOW_S), "--without-mingle", "--statedb", "none"]
    with WorkerProcess(
        test_vhost_url, app=f"{TASKS}:app", queues=[dedupe_queue], concurrency=2, extra_args=args
    ) as proc:
        yield proc.wait_ready()


def _skipped(worker: WorkerProcess, ids: set[str]) -> list[str]:
    """The ids of the duplicates the worker logged it skipped, one per skip."""
    return [
        e["task_id"]
        for e in worker.events()
        if e.get("event") == "task_duplicate_skipped" and e.get("task_id") in ids
    ]


def test_an_id_published_twice_runs_once_whichever_child_gets_each_copy(
    dedupe_queue: str, deduping: WorkerProcess, app: App, tmp_path: Path
):
    path, ids = tmp_path / "runs", [f"twice-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    results = []
    for task_id in ids:  # back to back: the copies of one id reach the two children at once
        for _ in range(2):
            args = (str(path), task_id, 0.05)
            results.append(app.send_task(f"{TASKS}.record", args, queue=dedupe_queue, task_id=task_id))
    pids = {r.get(timeout=60) for r in results[::2]}
    wait_for(lambda: len(_skipped(deduping, set(ids))) >= len(ids), timeout_s=30, message="a skip per id")
    assert sorted(_lines(path)) == sorted(ids)  # each ran once
    assert sorted(_skipped(deduping, set(ids))) == sorted(ids)  # and its copy was skipped, once
    assert len(pids) == 2  # both children took tasks: the window is the worker's, not a child's


def test_the_worker_is_its_main_process_a_forkserver_and_its_children_only(deduping: WorkerProcess):
    # No resource tracker (worker/pool/spawn.py): an interpreter of 7 MiB with nothing to track.
    def commands() -> list[str] | None:
        tree = [_command(pid) for pid in descendants(deduping.pid)]
        return tree if len(tree) == 3 else None

    tree = wait_for(commands, timeout_s=10, message="3 processes under the worker")
    assert tree is not None
    assert sum("forkserver" in command for command in tree) == 3  # the server and the children it forked
    assert not [command for command in tree if "resource_tracker" in command]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"


def test_a_copy_redelivered_to_the_other_child_while_the_first_runs_it_is_skipped(
    test_vhost_url: str, dedupe_queue: str, deduping: WorkerProcess, app: App, tmp_path: Path
):
    path, release = tmp_path / "runs", tmp_path / "release"
    task_id = f"cut-{uuid.uuid4().hex[:8]}"
    connects = deduping.log_text().count('"event": "feed_child_consuming"')
    app.send_task(f"{TASKS}.cut_connection", (str(path), str(release)), queue=dedupe_queue, task_id=task_id)
    # The child running it lost its connection: the broker gave the delivery to the other child.
    wait_for(lambda: _skipped(deduping, {task_id}), timeout_s=30, message="the redelivery skipped")
    release.touch()
    wait_for(lambda: queue_depth(test_vhost_url, dedupe_queue) == 0, timeout_s=30, message="settled")
    wait_for(
        lambda: deduping.log_text().count('"event": "feed_child_consuming"') > connects,
        timeout_s=30,
        message="the first child connected again",
    )
    assert len(_lines(path)) == 1
    # The run finished though its ack was lost: a copy within the window is a duplicate too.
    app.send_task(f"{TASKS}.cut_connection", (str(path), str(release)), queue=dedupe_queue, task_id=task_id)
    wait_for(lambda: len(_skipped(deduping, {task_id})) == 2, timeout_s=30, message="the late copy skipped")
    assert len(_lines(path)) == 1


def test_a_task_whose_child_died_running_it_runs_again(
    dedupe_queue: str, deduping: WorkerProcess, app: App, tmp_path: Path
):
    path = tmp_path / "runs"
    result = app.send_task(f"{TASKS}.die_first", (str(path),), queue=dedupe_queue)
    pid = result.get(timeout=60)  # the dead child's claim did not hold the redelivery back
    assert [line.split()[0] for line in _lines(path)] == ["died", "ran"]
    assert f"ran {pid}" in _lines(path)
    assert not _skipped(deduping, {result.id})


def test_an_id_runs_again_once_its_window_is_over(
    dedupe_queue: str, deduping: WorkerProcess, app: App, tmp_path: Path
):
    path, task_id = tmp_path / "runs", f"again-{uuid.uuid4().hex[:8]}"

    def send() -> Any:
        return app.send_task(f"{TASKS}.record", (str(path), task_id), queue=dedupe_queue, task_id=task_id)

    send().get(timeout=30)
    finished = time.monotonic()
    send()  # within the window: skipped
    wait_for(
        lambda: _skipped(deduping, {task_id}), timeout_s=WINDOW_S / 2, message="skipped within the window"
    )
    assert len(_lines(path)) == 1
    wait_for(
        lambda: time.monotonic() - finished > WINDOW_S + 0.2,
        timeout_s=WINDOW_S + 1,
        message="the window over",
    )
    send().get(timeout=30)
    assert _lines(path) == [task_id, task_id]
    assert len(_skipped(deduping, {task_id})) == 1


def test_the_threads_of_one_child_share_the_window_too(test_vhost_url: str, app: App, tmp_path: Path):
    queue, path = unique_queue("dedupe-threads"), tmp_path / "runs"
    args = ["--threads", "2", "--dedupe-window", str(WINDOW_S), "--without-mingle"]
    try:
        with WorkerProcess(
            test_vhost_url,
            app=f"{TASKS}:app",
            queues=[queue],
            concurrency=1,
            extra_args=[*args, "--statedb", "none"],
        ) as worker:
            worker.wait_ready()
            ids = [f"threads-{uuid.uuid4().hex[:8]}" for _ in range(10)]
            results = []
            for task_id in ids:  # one child, two threads: the copies of an id run at once
                for _ in range(2):
                    args_ = (str(path), task_id, 0.1)
                    results.append(app.send_task(f"{TASKS}.record", args_, queue=queue, task_id=task_id))
            for result in results[::2]:
                result.get(timeout=60)
            wait_for(
                lambda: len(_skipped(worker, set(ids))) >= len(ids), timeout_s=30, message="a skip per id"
            )
            assert sorted(_lines(path)) == sorted(ids)
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


# -- inspect stats total and the metrics, in both consuming designs --------------------------------

COUNT = 100


def _value(samples: dict[Any, float], metric: str, **labels: str) -> float:
    return float(sum(v for (n, ls), v in samples.items() if n == metric and set(labels.items()) <= set(ls)))


def _total(app: App, worker: WorkerProcess) -> dict[str, int]:
    replies = app.control.inspect(destination=[worker.name], timeout=5).stats()
    assert isinstance(replies, dict) and worker.name in replies, replies
    total: dict[str, int] = replies[worker.name]["total"]
    return total


@pytest.fixture
def counted(test_vhost_url: str) -> Iterator[tuple[WorkerProcess, int, str]]:
    queue, port = unique_queue("counted"), free_port()
    args = [
        "--metrics-port",
        str(port),
        "--metrics-address",
        "127.0.0.1",
        "--without-mingle",
        "--statedb",
        "none",
    ]
    with WorkerProcess(
        test_vhost_url, app=f"{TASKS}:app", queues=[queue], concurrency=2, extra_args=args
    ) as worker:
        yield worker.wait_ready(), port, queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_stats_total_and_the_metrics_count_every_task_the_worker_ran(
    counted: tuple[WorkerProcess, int, str], app: App, tmp_path: Path
):
    worker, port, queue = counted
    host = worker.name.rpartition("@")[2]
    record, path = f"{TASKS}.record", str(tmp_path / "runs")
    results = app.send_many(app.signature(record, (path, str(i)), queue=queue) for i in range(COUNT))
    failing = app.send_task(f"{TASKS}.fail", ("on purpose",), queue=queue)
    retried = app.send_task(f"{TASKS}.retry_once", queue=queue)
    expired = app.send_task(record, (path, "expired"), queue=queue, expires=-60)
    app.send_task("no.such.task", queue=queue)
    pids = {r.get(timeout=120) for r in results}
    assert len(pids) == 2  # both children ran tasks
    with pytest.raises(ValueError, match="on purpose"):
        failing.get(timeout=30)
    assert retried.get(timeout=30) == "retried"
    with pytest.raises(TaskRevokedError):
        expired.get(timeout=30)
    # The retry ran twice; the expired and the unregistered task never ran. Each run is counted
    # before its result goes out, and stats asks consuming children for what they have not
    # reported yet: exact at once, not a second later.
    expected = {record: COUNT, f"{TASKS}.fail": 1, f"{TASKS}.retry_once": 2}
    assert _total(app, worker) == expected

    def labels(name: str) -> dict[str, str]:
        return {"name": name, "hostname": host, "queue_name": queue}

    samples: dict[Any, float] = {}

    def scraped_all() -> bool:
        samples.update(scrape(port))
        return _value(samples, "celery_task_succeeded_total", **labels(record)) >= COUNT

    poll(scraped_all, timeout_s=20, interval_s=0.2)
    want = {
        ("celery_task_received_total", record): COUNT,
        ("celery_task_started_total", record): COUNT,
        ("celery_task_succeeded_total", record): COUNT,
        ("celery_task_runtime_count", record): COUNT,
        ("celery_task_received_total", f"{TASKS}.fail"): 1,
        ("celery_task_failed_total", f"{TASKS}.fail"): 1,
        ("celery_task_runtime_count", f"{TASKS}.fail"): 1,
        ("celery_task_received_total", f"{TASKS}.retry_once"): 2,
        ("celery_task_retried_total", f"{TASKS}.retry_once"): 1,
        ("celery_task_succeeded_total", f"{TASKS}.retry_once"): 1,
        ("celery_task_revoked_total", record): 1,
        ("celery_task_failed_total", record): 0,
    }
    got = {key: _value(samples, key[0], **labels(key[1])) for key in want}
    assert got == want
    assert _value(samples, "celery_task_failed_total", exception="ValueError", **labels(f"{TASKS}.fail")) == 1
    assert _value(samples, "clockwork_dead_letters_total", queue_name=queue, reason="NotRegistered") == 1
    assert _total(app, worker) == expected  # and no more came in since
