"""The real Flower (from PyPI) monitors our workers as it monitors Celery's (WIRE.md §8).

Each scenario starts Flower, then two workers on their own queues, runs tasks through both, and
checks what Flower shows: its inspect-fed ``/api/workers`` and worker pages, its event-fed workers
table and ``/api/tasks``, and the ``/workers`` page as headless Chromium renders it. The ``celery``
scenario runs two real Celery workers and is the reference: whatever fails only for ``clockwork``
is ours to fix.

Set ``CLOCKWORK_DOCS_SCREENSHOTS=1`` to also write the Clockwork screenshot to
``docs/img/flower-workers.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings, TaskRevokedError
from tests.interop.browser import dump_dom, screenshot, summarize_png
from tests.interop.flower import FlowerProcess
from tests.support.amqp import delete_queues
from tests.support.waiting import poll, wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

DOCS_SCREENSHOT = ROOT / "docs" / "img" / "flower-workers.png"

# Per scenario: the task each worker runs, its arguments, and the result.
TASKS = {
    "celery": ("interop.mul", (6, 7), 42),
    "clockwork": ("tests.integration.e2e_tasks.add", (2, 3), 5),
}
TASKS_PER_NODE = 2
# Flower casts `enable_events` every 5 s and the first cast comes 5 s after it starts; task events
# sent before a worker gets it are never sent at all.
EVENTS_ENABLED_WITHIN_S = 15.0


@dataclass
class Cluster:
    kind: str
    flower: FlowerProcess
    nodes: dict[str, str]  # node name -> its queue
    task_name: str
    tasks: dict[str, str] = field(default_factory=dict)  # task id -> node that ran it
    probe_seen: bool = False  # a task event reached Flower before the real tasks were sent
    logs: dict[str, Callable[[], str]] = field(default_factory=dict)  # node name -> its log reader

    def diagnostics(self) -> str:
        parts = [f"--- flower ---\n{self.flower.log_text()[-3000:]}"]
        parts += [f"--- {node} ---\n{read()[-3000:]}" for node, read in self.logs.items()]
        return "\n".join(parts)


class _CeleryWorker:
    """A real Celery worker as deployed: worker heartbeats on, task events off until enabled."""

    def __init__(self, url: str, queue: str, name: str) -> None:
        self.name = name
        self._log = Path(tempfile.mkstemp(prefix="celery-worker-", suffix=".log")[1])
        self._out = self._log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.interop.celery_app", "worker", "-P", "solo",
             "-c", "1", "-Q", queue, "-n", name, "--without-mingle", "--without-gossip", "-l", "info"],
            cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
            env={**os.environ, "INTEROP_BROKER_URL": url},
        )  # fmt: skip

    def log_text(self) -> str:
        return self._log.read_text()

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"celery worker exited:\n{self.log_text()[-3000:]}")
            return "ready." in self.log_text()

        wait_for(ready, timeout_s=60, message=f"celery worker not ready:\n{self.log_text()[-3000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._out.close()
        self._log.unlink(missing_ok=True)


@pytest.fixture(scope="module", params=["celery", "clockwork"])
def cluster(request: pytest.FixtureRequest, test_vhost_url: str) -> Iterator[Cluster]:
    kind: str = request.param
    task_name, args, expected = TASKS[kind]
    tag = uuid.uuid4().hex[:6]
    queues = [unique_queue(f"flower-{kind}") for _ in range(2)]
    nodes = {f"{kind}-{i + 1}-{tag}@flower": queue for i, queue in enumerate(queues)}
    with ExitStack() as stack:
        stack.callback(delete_queues, test_vhost_url, *queues, *(f"{q}.dead" for q in queues))
        # Everything starts at once: Flower asks for a `heartbeat` when its event consumer starts, so
        # it need not be up first to learn about workers that are already running.
        flower = stack.enter_context(FlowerProcess(test_vhost_url))
        cluster = Cluster(kind, flower, nodes, task_name)
        workers: list[Any] = []
        for node, queue in nodes.items():
            if kind == "celery":
                celery_worker = _CeleryWorker(test_vhost_url, queue, node)
                stack.callback(celery_worker.close)
                workers.append(celery_worker)
                cluster.logs[node] = celery_worker.log_text
            else:
                ours = stack.enter_context(
                    WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=node)
                )
                workers.append(ours)
                cluster.logs[node] = ours.log_text
        flower.wait_ready()
        for worker in workers:
            worker.wait_ready()

        client = App("flower-client", settings=Settings(broker_url=test_vhost_url))
        stack.callback(client.close, timeout=10)
        probes: list[str] = []

        def a_probe_reached_flower() -> bool:
            seen = set(flower.api_tasks())
            if any(probe in seen for probe in probes):
                return True
            probes.extend(client.send_task(task_name, args, queue=q).id for q in queues)
            return False

        cluster.probe_seen = bool(
            poll(a_probe_reached_flower, timeout_s=EVENTS_ENABLED_WITHIN_S, interval_s=0.3)
        )
        for node, queue in nodes.items():
            for _ in range(TASKS_PER_NODE):
                result = client.send_task(task_name, args, queue=queue)
                assert result.get(timeout=30) == expected, cluster.diagnostics()
                cluster.tasks[result.id] = node
        yield cluster


def test_api_workers_lists_both_nodes_with_their_inspect_replies(cluster: Cluster):
    def both_listed() -> dict[str, dict[str, Any]]:
        workers = cluster.flower.api_workers(refresh=True)
        return workers if all("stats" in workers.get(node, {}) for node in cluster.nodes) else {}

    workers = wait_for(
        both_listed,
        timeout_s=10,
        interval_s=0.5,
        message=f"/api/workers lacks {list(cluster.nodes)}\n{cluster.diagnostics()}",
    )
    for node, queue in cluster.nodes.items():
        info = workers[node]
        assert isinstance(info["stats"]["total"], dict) and isinstance(info["stats"]["broker"], dict), info
        assert info["stats"]["total"].get(cluster.task_name, 0) >= TASKS_PER_NODE, info["stats"]
        assert any(entry.split(" ")[0] == cluster.task_name for entry in info.get("registered", [])), info
        assert [q["name"] for q in info.get("active_queues", [])] == [queue], info.get("active_queues")
        assert isinstance(info.get("conf"), dict), info.get("conf")


def test_flowers_worker_page_renders_each_node(cluster: Cluster):
    # The page is a 404 unless `stats` answered, and renders stats, active_queues, registered and conf.
    for node, queue in cluster.nodes.items():
        html = cluster.flower.get_text(f"/worker/{node}")
        assert node in html and queue in html and cluster.task_name in html


def test_the_events_feed_shows_both_nodes_online_with_their_succeeded_tasks(cluster: Cluster):
    def all_counted() -> dict[str, dict[str, Any]] | None:
        rows = cluster.flower.event_workers()
        done = all(rows.get(node, {}).get("task-succeeded", 0) >= TASKS_PER_NODE for node in cluster.nodes)
        return rows if done else None

    assert cluster.probe_seen, f"no task event reached Flower within {EVENTS_ENABLED_WITHIN_S:g} s"
    rows = poll(all_counted, timeout_s=10, interval_s=0.5) or cluster.flower.event_workers()
    for node in cluster.nodes:
        assert node in rows, f"{node} not in Flower's workers table: {sorted(rows)}\n{cluster.diagnostics()}"
        row = rows[node]
        assert row["status"] is True, f"{node} is offline (no recent worker-heartbeat): {row}"
        assert row["freq"] > 0 and row["pid"] > 0 and row["sw_ident"], row
        assert row.get("task-succeeded", 0) >= TASKS_PER_NODE, row


def test_api_tasks_lists_the_tasks_as_succeeded_on_the_node_that_ran_them(cluster: Cluster):
    def all_succeeded() -> dict[str, dict[str, Any]] | None:
        tasks = cluster.flower.api_tasks()
        done = all(tasks.get(task_id, {}).get("state") == "SUCCESS" for task_id in cluster.tasks)
        return tasks if done else None

    tasks = poll(all_succeeded, timeout_s=10, interval_s=0.5) or cluster.flower.api_tasks()
    for task_id, node in cluster.tasks.items():
        assert task_id in tasks, f"task {task_id} unknown to Flower ({len(tasks)} tasks known)"
        task = tasks[task_id]
        assert (task["state"], task["worker"], task["name"]) == ("SUCCESS", node, cluster.task_name), task
        assert task["runtime"] is not None and task["received"] and task["succeeded"], task


def test_headless_chromium_renders_the_workers_page_with_both_nodes(cluster: Cluster, tmp_path: Path):
    url = f"{cluster.flower.base_url}/workers"
    dom = dump_dom(url)
    # The table is drawn by the page's script from `/workers?json=1`: one row per node, with its badge.
    rows = {node: re.search(rf"<tr[^>]*>(?:(?!</tr>).)*{re.escape(node)}(?:(?!</tr>).)*</tr>", dom, re.S)
            for node in cluster.nodes}  # fmt: skip
    missing = [node for node, row in rows.items() if row is None]
    assert not missing, f"the rendered /workers page lacks {missing}:\n{dom[-4000:]}"
    offline = [node for node, row in rows.items() if row is not None and ">Online<" not in row.group(0)]
    assert not offline, f"the rendered /workers page shows {offline} offline"
    online = re.search(r'id="workers-online"[^>]*>\s*(\d+)\s*<', dom)
    assert online is not None and int(online.group(1)) >= len(cluster.nodes), dom[-4000:]
    png = screenshot(url, tmp_path / f"flower-workers-{cluster.kind}.png", width=1280, height=720)
    summary = summarize_png(png)
    assert (summary.width, summary.height) == (1280, 720)
    assert png.stat().st_size > 20_000 and summary.distinct_pixels > 200, summary  # not a blank page
    if cluster.kind == "clockwork" and os.environ.get("CLOCKWORK_DOCS_SCREENSHOTS") == "1":
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, DOCS_SCREENSHOT)


def test_flowers_terminate_kills_a_running_task(cluster: Cluster, test_vhost_url: str):
    if cluster.kind == "celery":
        pytest.skip("the Celery workers here run the solo pool, which cannot terminate a task")
    queue = next(iter(cluster.nodes.values()))
    client = App("flower-terminate", settings=Settings(broker_url=test_vhost_url))
    try:
        long = client.send_task("tests.integration.e2e_tasks.sleep_s", (60,), queue=queue)
        wait_for(
            lambda: cluster.flower.api_tasks().get(long.id, {}).get("state") == "STARTED",
            timeout_s=30, message=f"the long task did not start\n{cluster.diagnostics()}",
        )  # fmt: skip
        # Flower's Terminate button: its API turns "terminate=true" into the 1 it sends.
        request = urllib.request.Request(
            f"{cluster.flower.base_url}/api/task/revoke/{long.id}?terminate=true&signal=SIGKILL",
            data=b"", method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert json.loads(reply.read())["message"] == f"Revoked '{long.id}'"
        with pytest.raises(TaskRevokedError, match="terminated"):
            long.get(timeout=30)
    finally:
        client.close()
