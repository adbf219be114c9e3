"""The real ``celery`` CLI (status, inspect, control) against our worker, as an operator runs it.

``inspect ping|registered|active|stats`` are covered in tests/integration/test_mailbox.py. Here the
worker holds one running task, one reserved behind it and one with an ETA, so every listing has
something in it. The CLI prints each reply as it arrives (a reply that is not a one-entry map
crashes it; an ``{"error": ...}`` reply is printed as ERROR with exit status 0), and with ``--json``
prints the flattened replies instead: both forms are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from broker_svc import App, Settings
from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

SLEEP = "tests.integration.e2e_tasks.sleep_s"
ADD = "tests.integration.e2e_tasks.add"


def celery(url: str, *args: str, timeout_s: float = 5.0) -> subprocess.CompletedProcess[str]:
    """Run ``celery -b <url> --no-color <args> --timeout <timeout_s>`` with Celery's default app."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-b", url, "--no-color", *args, "--timeout", str(timeout_s)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@dataclass
class Node:
    url: str
    name: str
    queue: str
    worker: WorkerProcess
    running: str  # task id: executing (a long sleep)
    waiting: str  # task id: prefetched behind it, not started
    later: str  # task id: ETA ten minutes from now (parked in the broker)

    def cli(self, *args: str) -> str:
        """Run a CLI command aimed at this node; check it exited 0 and printed this node's OK line."""
        out = celery(self.url, *args, "-d", self.name)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert f"->  {self.name}: OK" in out.stdout, text  # ERROR here means an {"error": ...} reply
        if args[0] != "control":  # `celery control` prints no node count
            assert "1 node online." in out.stdout, text
        return out.stdout

    def cli_json(self, *args: str) -> Any:
        """Run a CLI command with ``--json``; return this node's reply value (exit 0 checked)."""
        out = celery(self.url, *args, "-d", self.name, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        replies = json.loads(out.stdout.splitlines()[0])
        assert list(replies) == [self.name], replies
        value = replies[self.name]
        assert not (isinstance(value, dict) and "error" in value), value
        return value


@pytest.fixture(scope="module")
def node(test_vhost_url: str) -> Iterator[Node]:
    queue = unique_queue("cli")
    name = f"cli-{uuid.uuid4().hex[:6]}@test"
    # One consuming child, prefetch 2: the first task runs, the second waits behind it, held by the
    # child's connection, "reserved".
    worker = WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=name,
                           extra_args=["--prefetch-multiplier", "2", "--shutdown-timeout", "1"])  # fmt: skip
    app = App("cli-client", settings=Settings(broker_url=test_vhost_url))
    try:
        worker.wait_ready()
        running = app.send_task(SLEEP, (60, "busy"), queue=queue).id
        waiting = app.send_task(ADD, (1, 2), queue=queue).id
        later = app.send_task(ADD, (3, 4), queue=queue, countdown=600).id
        yield Node(test_vhost_url, name, queue, worker, running, waiting, later)
    finally:
        app.close(timeout=10)
        worker.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.fixture(scope="module")
def busy_node(node: Node) -> Node:
    """The node once its first task is executing."""
    try:
        wait_for(lambda: node.running in celery(node.url, "inspect", "active", "-d", node.name).stdout,
                 timeout_s=20, interval_s=0.2, message="the sleep task never became active")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- worker log ---\n{node.worker.log_text()[-4000:]}") from None
    return node


def test_celery_status_shows_our_node_online(busy_node: Node):
    busy_node.cli("status")


def test_celery_inspect_query_task_finds_the_running_task(busy_node: Node):
    out = busy_node.cli("inspect", "query_task", busy_node.running, busy_node.waiting)
    assert busy_node.running in out
    found = busy_node.cli_json("inspect", "query_task", busy_node.running)
    state, info = found[busy_node.running]
    assert state == "active" and info["id"] == busy_node.running and info["name"] == SLEEP, found
    found = busy_node.cli_json("inspect", "query_task", busy_node.waiting)
    state, info = found[busy_node.waiting]
    assert state == "reserved" and info["name"] == ADD and info["args"] == [1, 2], found


def test_celery_inspect_reserved_lists_the_task_waiting_behind_it(busy_node: Node):
    assert busy_node.waiting in busy_node.cli("inspect", "reserved")
    reserved = busy_node.cli_json("inspect", "reserved")
    assert [(task["id"], task["name"]) for task in reserved] == [(busy_node.waiting, ADD)], reserved
    [task] = reserved
    assert task["args"] == [1, 2] and task["time_start"] is None and task["worker_pid"], task
    assert task["delivery_info"]["routing_key"] == busy_node.queue, task


def test_celery_inspect_scheduled_lists_the_eta_task_our_client_parked(busy_node: Node):
    # Our client sent it straight to a delay queue with a park record; the node is the only live
    # worker on its queue, so it lists it (worker/remote/scheduled.py), as Celery's worker would.
    assert busy_node.later in busy_node.cli("inspect", "scheduled")
    scheduled = busy_node.cli_json("inspect", "scheduled")
    [entry] = [e for e in scheduled if e["request"]["id"] == busy_node.later]
    assert set(entry) == {"eta", "priority", "request"}, entry
    request = entry["request"]
    assert request["name"] == ADD and request["args"] == [3, 4] and request["hostname"] == busy_node.name


def test_celery_inspect_active_queues_lists_the_queue(busy_node: Node):
    assert busy_node.queue in busy_node.cli("inspect", "active_queues")
    queues = busy_node.cli_json("inspect", "active_queues")
    assert [(q["name"], q["routing_key"], q["durable"]) for q in queues] == [
        (busy_node.queue, busy_node.queue, True)
    ], queues


def test_celery_inspect_conf_prints_a_settings_map(busy_node: Node):
    busy_node.cli("inspect", "conf")
    conf = busy_node.cli_json("inspect", "conf")
    assert isinstance(conf, dict) and conf, conf


def test_celery_control_revoke_flags_the_task_and_inspect_revoked_lists_it(busy_node: Node):
    task_id = f"never-sent-{uuid.uuid4()}"
    out = busy_node.cli("control", "revoke", task_id)
    assert f"tasks {{'{task_id}'}} flagged as revoked" in out, out
    assert task_id in busy_node.cli_json("inspect", "revoked")
    assert task_id in busy_node.cli("inspect", "revoked")
