"""Consuming children join a copy the broker sends back to the run still going, never run it twice.

The broker closes the connection of the child running a task (as ``consumer_timeout`` or a network
fault would); it requeues that task at once. The copy reaches another child of the same worker while
the first run goes on (-c 2: joined, parked until the run's outcome is out), or the same child once
it is back (-c 1: its outcome went out after the reconnect, the copy is acked unrun). Either way the
task runs once and its caller gets its result. R4 in RELIABILITY.md measures the same with
consumer_timeout on a private node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import App, Settings
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import DESIGN_THREADS, WorkerProcess, unique_queue

TASKS = "tests.integration.semantics_tasks"


@pytest.fixture(scope="module")
def vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from the broker side)")
    with session_broker.own_vhost("clockwork-redeliver") as url:
        yield url


def _close_child_connections(session_broker: SessionBroker, url: str, worker: WorkerProcess) -> int:
    """Close, from the broker's side, every connection of the worker's children; how many."""
    ctl = session_broker.rabbitmqctl
    assert ctl is not None
    vhost = unquote(urlsplit(url).path[1:]) or "/"
    out = ctl("list_connections", "-p", vhost, "-q", "--no-table-headers", "pid", "client_properties")
    pids = [line.split("\t", 1)[0] for line in out.splitlines() if f"{worker.name}.child-" in line]
    for pid in pids:
        ctl("close_connection", pid, "redelivery test")
    return len(pids)


def _runs(notes: Path, task_id: str) -> list[dict[str, object]]:
    if not notes.exists():
        return []
    entries = [json.loads(line) for line in notes.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if entry["id"] == task_id]


@pytest.mark.parametrize("concurrency", [2, 1], ids=["joined-by-another-child", "acked-by-the-same-child"])
def test_a_copy_sent_back_while_its_task_runs_is_not_run_again(
    session_broker: SessionBroker, vhost_url: str, tmp_path: Path, concurrency: int
):
    queue, notes, flag = unique_queue("redeliver"), tmp_path / "runs.jsonl", tmp_path / "closed"
    app = App("redeliver-client", settings=Settings(broker_url=vhost_url))
    args = ["--broker-heartbeat", "1", "--without-mingle"]
    try:
        with WorkerProcess(
            vhost_url, app=f"{TASKS}:app", queues=[queue], concurrency=concurrency, extra_args=args
        ) as worker:
            worker.wait_ready()
            # The task runs until the test has closed its connection, however long rabbitmqctl takes.
            result = app.send_task(f"{TASKS}.recorded_until", args=(str(notes), str(flag), 60.0), queue=queue)
            wait_for(lambda: _runs(notes, result.id), timeout_s=30, message="the task started")
            assert _close_child_connections(session_broker, vhost_url, worker) == concurrency
            closed = time.time()
            if concurrency > 1:
                # The copy reaches the other child while the run goes on, and is joined to it there
                # once that child is connected again (its connection was closed too).
                wait_for(lambda: _joined_after_reconnect(worker), timeout_s=30,
                         message="the other child joined the copy to the run")  # fmt: skip
            flag.touch()
            started, ended = result.get(timeout=90)
            assert started < closed <= ended  # the connection was closed under the running task
            # One thread connects again itself to send the outcome. Under --threads a sibling thread
            # has connected the shared connection again by then: the outcome goes out on it, and the
            # delivery's ack is dropped (its tag means nothing on the new connection).
            outcome_sent = "task_outcome_sent_after_reconnect"
            worker.first(outcome_sent if DESIGN_THREADS == 1 else "task_settle_dropped_channel_gone")
            # The copy is settled without a second run: parked, then acked once the outcome is out.
            worker.first("task_settled_by_redelivery" if concurrency > 1 else "task_redelivery_done_acked")
            wait_for(lambda: queue_depth(vhost_url, queue) == 0, timeout_s=30, message="the queue empties")
            assert len(_runs(notes, result.id)) == 1
            assert worker.count("task_redelivery_runs") == 0
            # The worker goes on: a task sent now runs.
            later = app.send_task(f"{TASKS}.recorded", args=(str(notes), 0.0), queue=queue)
            later.get(timeout=30)
            assert len(_runs(notes, later.id)) == 1
    finally:
        app.close(timeout=10)


def _joined_after_reconnect(worker: WorkerProcess) -> bool:
    # The idle child's third "consuming" is its reconnect (the running one reconnects after its
    # run): a copy joined after it is held until the run's outcome is out.
    events = [event.get("event") for event in worker.events()]
    consuming = [i for i, event in enumerate(events) if event == "feed_child_consuming"]
    return len(consuming) >= 3 and "task_redelivery_joined_run" in events[consuming[2] :]
