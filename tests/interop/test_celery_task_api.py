"""Celery's task API idioms from a real Celery client and CLI, sent alike to a Celery worker and ours.

Both workers define the same task names (tests/interop/celery_app.py for Celery's,
tests/integration/task_api_tasks.py for ours): class-based tasks registered with
``app.register_task``, retries with new arguments, a task returning its request's limits and
properties. Each test sends the same call to both and compares what came back; the ``inspect``
tests compare ``registered``, ``conf`` and ``report`` replies the same way.
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

from tests.interop.conftest import celery_node_name, celery_worker
from tests.support.amqp import delete_queues
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop


@dataclass(frozen=True)
class Pair:
    """Our worker and a Celery worker, each on a queue of its own, with the same task names."""

    url: str
    ours: str  # queue
    ours_node: str
    celery: str  # queue
    celery_node: str


@pytest.fixture(scope="module")
def pair(test_vhost_url: str) -> Iterator[Pair]:
    ours, theirs = unique_queue("taskapi-ours"), unique_queue("taskapi-celery")
    name = f"taskapi-{uuid.uuid4().hex[:6]}@test"
    worker = WorkerProcess(
        test_vhost_url, app="tests.integration.task_api_tasks:app", queues=[ours], name=name
    )
    with worker, celery_worker(test_vhost_url, theirs):
        worker.wait_ready()
        yield Pair(test_vhost_url, ours, name, theirs, celery_node_name(theirs))
    delete_queues(test_vhost_url, ours, f"{ours}.dead", theirs)


def both(client: Any, pair: Pair, name: str, *args: Any, **options: Any) -> tuple[Any, Any]:
    """Send the same call to our worker and to Celery's; their results (ours first)."""
    sent = [client.send_task(name, *args, queue=queue, **options) for queue in (pair.ours, pair.celery)]
    ours, theirs = (result.get(timeout=30) for result in sent)
    return ours, theirs


def celery(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "celery", "-b", url, "--no-color", *args, "--timeout", "5"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def celery_json(url: str, node: str, *args: str) -> Any:
    """``celery inspect <args> -d node --json``: that node's reply (exit status 0 checked)."""
    out = celery(url, "inspect", *args, "-d", node, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.splitlines()[0])[node]


# -- class-based tasks, autoretry, retry arguments ---------------------------------------------------


def test_a_class_based_task_runs_on_both(celery_client, pair: Pair):
    assert both(celery_client, pair, "taskapi.add", (2, 3)) == (5, 5)


def test_autoretry_for_on_a_class_based_task_retries_on_both(celery_client, pair: Pair):
    assert both(celery_client, pair, "taskapi.flaky", (2,)) == (2, 2)
    for queue in (pair.ours, pair.celery):
        with pytest.raises(ConnectionError, match="attempt 3"):
            celery_client.send_task("taskapi.flaky", (5,), queue=queue).get(timeout=30)


@pytest.mark.parametrize(
    ("task", "args", "kwargs", "expected"),
    [
        ("taskapi.grow", (1,), {}, [10, 0, [10], {}]),  # kwargs={"foo": 10} takes args[0]'s place
        ("taskapi.grow", (), {"foo": 2, "bar": 5}, [20, 0, [], {"foo": 20}]),  # replaces the kwargs
        ("taskapi.shrink", (), {"foo": 3, "bar": 4}, [2, 4, [2], {"bar": 4}]),  # args keep bar
        ("taskapi.shrink", (3, 4), {}, [2, 0, [2], {}]),
    ],
)
def test_retry_with_new_arguments_runs_the_next_attempt_as_celerys_does(
    celery_client, pair: Pair, task: str, args: tuple[Any, ...], kwargs: dict[str, Any], expected: list[Any]
):
    assert both(celery_client, pair, task, args, kwargs) == (expected, expected)


# -- the request ---------------------------------------------------------------------------------------


def test_request_time_limits_and_properties_are_as_a_celery_worker_shows_them(celery_client, pair: Pair):
    options = {"time_limit": 9, "soft_time_limit": 8, "priority": 3, "headers": {"tenant": "acme"}}
    sent = [
        celery_client.send_task("taskapi.request_fields", queue=queue, **options)
        for queue in (pair.ours, pair.celery)
    ]
    ours, theirs = (result.get(timeout=30) for result in sent)
    assert (
        (ours["time_limit"], ours["soft_time_limit"])
        == (theirs["time_limit"], theirs["soft_time_limit"])
        == (9, 8)
    )
    mine, celerys = ours["properties"], theirs["properties"]
    assert set(mine) == set(celerys), (mine, celerys)
    # Each message's own id is in its correlation_id and headers; the rest is the same.
    for properties, result in ((mine, sent[0]), (celerys, sent[1])):
        assert properties.pop("correlation_id") == result.id
        headers = properties["application_headers"]
        assert headers.pop("id") == headers.pop("root_id") == result.id
    assert mine == celerys


def test_request_time_limits_are_none_when_the_message_carries_none_on_both(celery_client, pair: Pair):
    ours, theirs = both(celery_client, pair, "taskapi.request_fields")
    assert (ours["time_limit"], ours["soft_time_limit"]) == (theirs["time_limit"], theirs["soft_time_limit"])
    assert ours["time_limit"] is None


# -- celery inspect registered, conf, report -------------------------------------------------------------


def test_celery_inspect_registered_shows_task_info_items_as_from_a_celery_worker(pair: Pair):
    for args in ((), ("rate_limit",), ("rate_limit", "max_retries")):
        ours = celery_json(pair.url, pair.ours_node, "registered", *args)
        theirs = celery_json(pair.url, pair.celery_node, "registered", *args)
        shared = [entry for entry in theirs if entry.split(" ")[0] in ("taskapi.add", "taskapi.flaky")]
        assert shared and set(shared) <= set(ours), (args, ours, theirs)
    assert "taskapi.add [rate_limit=50/s max_retries=7]" in ours, ours
    printed = celery(pair.url, "inspect", "registered", "rate_limit", "-d", pair.ours_node)
    assert "* taskapi.add [rate_limit=50/s]" in printed.stdout, printed.stdout + printed.stderr


def test_celery_inspect_conf_answers_celerys_keys(pair: Pair):
    ours = celery_json(pair.url, pair.ours_node, "conf")
    theirs = celery_json(pair.url, pair.celery_node, "conf")
    # The same app settings, both listed; what only a Celery worker has is left out here.
    assert set(theirs) - {"deprecated_settings", "worker_disable_prefetch"} <= set(ours), (ours, theirs)
    assert ours["worker_hijack_root_logger"] is True  # what our worker does, whatever the app says
    assert theirs["worker_hijack_root_logger"] is False  # what Celery's does: as the app says
    assert ours["task_serializer"] == theirs["task_serializer"] == "json"
    # With defaults: every key we answer is one of Celery's.
    full = celery_json(pair.url, pair.ours_node, "conf", "true")
    celerys = celery_json(pair.url, pair.celery_node, "conf", "true")
    assert len(full) > len(ours)
    assert set(full) <= set(celerys), sorted(set(full) - set(celerys))


def test_celery_inspect_report_prints_our_workers_report(pair: Pair):
    reports = {}
    for node in (pair.ours_node, pair.celery_node):
        out = celery(pair.url, "inspect", "report", "-d", node)
        assert out.returncode == 0 and f"->  {node}: OK" in out.stdout, out.stdout + out.stderr
        reports[node] = celery_json(pair.url, node, "report")["ok"]
    ours, theirs = reports[pair.ours_node], reports[pair.celery_node]
    assert ours.startswith("\nsoftware -> clockwork:"), ours
    assert theirs.startswith("\nsoftware -> celery:"), theirs
    for line in ("platform -> system:", "loader   -> ", "settings -> transport:amqp results:rpc://"):
        assert line in ours and line in theirs, (line, ours, theirs)
