"""Celery's task API idioms on our client and worker: class-based tasks, retry with new arguments,
``request.time_limit``/``properties``, and ``inspect registered``/``conf``/``report`` (with ``ctl``).

One worker for the module, loading tests/integration/task_api_tasks.py, with default time limits of
its own (which a task's request does not show, as in Celery: it shows what the message carries).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App
from tests.integration import task_api_tasks as tasks
from tests.support.amqp import delete_queues
from tests.support.workers import ROOT, WorkerProcess, unique_queue

CTL = str(Path(sys.executable).parent / "ctl")


@pytest.fixture(scope="module")
def node(test_vhost_url: str) -> Iterator[WorkerProcess]:
    queue, routed = unique_queue("taskapi"), unique_queue("taskapi-routed")
    worker = WorkerProcess(
        test_vhost_url, app="tests.integration.task_api_tasks:app", queues=[queue, routed], concurrency=1,
        name=f"taskapi-{uuid.uuid4().hex[:6]}@test",
        extra_args=["--time-limit", "60", "--soft-time-limit", "50"],
    )  # fmt: skip
    with worker:
        worker.wait_ready()
        yield worker
    delete_queues(test_vhost_url, queue, f"{queue}.dead", routed, f"{routed}.dead")


@pytest.fixture(scope="module")
def app(test_vhost_url: str, node: WorkerProcess) -> Iterator[App]:
    """The tasks module's own app, as the client: ``Add().delay()`` sends through it."""
    tasks.app.conf.update(broker_url=test_vhost_url, task_default_queue=node.queues[0])
    yield tasks.app
    tasks.app.close()


def ctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    command = [CTL, "-b", url, *args, "--timeout", "5"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


# -- class-based tasks --------------------------------------------------------------------------------


def test_a_class_based_task_is_registered_and_runs_on_the_worker(app: App):
    assert isinstance(app.tasks["taskapi.add"], tasks.Add)
    assert tasks.Add().delay(2, 3).get(timeout=30) == 5
    assert tasks.Add().apply_async((4, 5)).get(timeout=30) == 9
    assert app.send_task("taskapi.add", (1, 1)).get(timeout=30) == 2


def test_a_class_based_tasks_queue_attribute_routes_its_sends(app: App, node: WorkerProcess):
    routed = node.queues[1]
    tasks.Routed.queue = routed
    try:
        assert tasks.Routed().delay().get(timeout=30) == routed
    finally:
        tasks.Routed.queue = None


def test_a_class_without_a_name_is_named_after_its_module_and_class(app: App):
    name = "tests.integration.task_api_tasks.Unnamed"
    assert isinstance(app.tasks[name], tasks.Unnamed)
    assert tasks.Unnamed().delay().get(timeout=30) == name


def test_a_class_based_task_checks_its_arguments_when_sent(app: App):
    with pytest.raises(TypeError, match="taskapi.add"):
        tasks.Add().delay(1)


def test_autoretry_for_on_a_class_retries_until_the_task_succeeds_or_runs_out(app: App):
    assert tasks.Flaky().delay(2).get(timeout=30) == 2
    with pytest.raises(ConnectionError, match="attempt 3"):
        tasks.Flaky().delay(5).get(timeout=30)  # max_retries = 3


def test_retry_backoff_on_a_class_sends_each_retry_later(app: App):
    # Two retries, each with an ETA (the backoff's countdown), then the third run succeeds.
    assert tasks.Backoff().delay().get(timeout=30) == [2, True]


def test_register_task_refuses_what_it_cannot_run(app: App):
    other = App("other", broker="amqp://guest:guest@127.0.0.1:5672/", set_as_current=False)
    try:

        class First(other.Task):  # type: ignore[misc,name-defined]
            name = "taskapi.same"

        class Second(other.Task):  # type: ignore[misc,name-defined]
            name = "taskapi.same"

        assert other.register_task(First()) is other.register_task(First())  # again: the first one
        with pytest.raises(ValueError, match="already registered"):
            other.register_task(Second())

        class Fast(other.Task):  # type: ignore[misc,name-defined]
            name = "taskapi.fast"
            rate_limit = "lots"

        with pytest.raises(ValueError, match="taskapi.fast"):
            other.register_task(Fast())
        with pytest.raises(TypeError, match="unknown task option"):
            other.register_task(Fast, autoretry=True)
        with pytest.raises(TypeError, match="Task instance"):
            other.register_task(len)  # type: ignore[arg-type]
        assert set(other.tasks) & {"taskapi.fast"} == set()
    finally:
        other.close()


# -- the request -----------------------------------------------------------------------------------


def test_request_time_limits_are_the_messages_not_the_workers_defaults(app: App):
    assert tasks.Limited().delay().get(timeout=30) == [30, 20]  # declared on the class, sent along
    sent = tasks.request_fields.apply_async(time_limit=9, soft_time_limit=8).get(timeout=30)
    assert (sent["time_limit"], sent["soft_time_limit"]) == (9, 8)
    # The worker holds this run to its --time-limit 60, but the message carries none (as Celery).
    none = tasks.request_fields.delay().get(timeout=30)
    assert (none["time_limit"], none["soft_time_limit"]) == (None, None)


def test_request_properties_are_the_messages_amqp_properties(app: App):
    result = tasks.request_fields.apply_async(priority=3, headers={"tenant": "acme"})
    properties: dict[str, Any] = result.get(timeout=30)["properties"]
    assert set(properties) == {
        "content_type", "content_encoding", "application_headers", "delivery_mode", "priority",
        "correlation_id", "reply_to",
    }  # fmt: skip
    assert properties["content_type"] == "application/json"  # the app's task_serializer
    assert properties["delivery_mode"] == 2
    assert properties["priority"] == 3
    assert properties["correlation_id"] == result.id
    assert properties["reply_to"] == app.reply_queue
    headers = properties["application_headers"]
    assert headers["id"] == result.id
    assert (headers["task"], headers["tenant"]) == ("taskapi.request_fields", "acme")


# -- retry with new arguments --------------------------------------------------------------------------


def test_retry_with_kwargs_alone_takes_the_place_of_a_positional_argument(app: App):
    # Not foo=1 and foo=10 both ("got multiple values for argument 'foo'").
    assert tasks.grow.delay(1).get(timeout=30) == [10, 0, [10], {}]


def test_retry_with_kwargs_alone_replaces_the_calls_keywords(app: App):
    assert tasks.grow.apply_async(kwargs={"foo": 2, "bar": 5}).get(timeout=30) == [20, 0, [], {"foo": 20}]


def test_retry_with_args_alone_keeps_the_keywords_they_do_not_fill(app: App):
    result = tasks.shrink.apply_async(kwargs={"foo": 3, "bar": 4})
    assert result.get(timeout=30) == [2, 4, [2], {"bar": 4}]


# -- inspect registered, conf, report ----------------------------------------------------------------


def test_inspect_registered_shows_rate_limits_by_default_and_asked_items(app: App, node: WorkerProcess):
    inspect = app.control.inspect(destination=[node.name], timeout=5)
    listed = inspect.registered()[node.name]
    assert "taskapi.add [rate_limit=50/s]" in listed, listed
    assert "taskapi.grow" in listed, listed
    asked = inspect.registered("rate_limit", "max_retries", "_hidden", "no_such_attribute")[node.name]
    assert "taskapi.add [rate_limit=50/s max_retries=7]" in asked, asked
    assert "taskapi.grow [max_retries=3]" in asked, asked


def test_registered_shows_a_rate_limit_register_task_gave_and_the_rate_limit_command_changed(
    app: App, node: WorkerProcess
):
    inspect = app.control.inspect(destination=[node.name], timeout=5)
    assert "taskapi.slowed [rate_limit=100/m]" in inspect.registered()[node.name]
    arguments = {"task_name": "taskapi.slowed", "rate_limit": "5/s"}
    [reply] = (
        app.control.broadcast("rate_limit", arguments, destination=[node.name], reply=True, timeout=5) or []
    )
    assert reply[node.name] == {"ok": "new rate limit set successfully"}
    assert "taskapi.slowed [rate_limit=5/s]" in inspect.registered()[node.name]


def test_ctl_inspect_registered_takes_task_info_items(test_vhost_url: str, node: WorkerProcess):
    proc = ctl(test_vhost_url, "inspect", "registered", "rate_limit", "-d", node.name, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = json.loads(proc.stdout)[node.name]
    assert "taskapi.add [rate_limit=50/s]" in listed, listed
    assert "taskapi.flaky" in listed, listed
    table = ctl(test_vhost_url, "inspect", "registered", "rate_limit", "-d", node.name)
    assert "taskapi.add [rate_limit=50/s]" in table.stdout, table.stdout + table.stderr


def test_inspect_conf_answers_celerys_settings_with_what_the_worker_does(app: App, node: WorkerProcess):
    inspect = app.control.inspect(destination=[node.name], timeout=5)
    conf = inspect.conf()[node.name]
    # Set by the app: shown with what the worker does (it replaces the root logger's handlers).
    assert conf["worker_hijack_root_logger"] is True
    assert conf["task_serializer"] == "json"
    assert conf["broker_connection_retry_on_startup"] is True
    # Not set, but not Celery's default: shown.
    assert conf["task_acks_late"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["task_time_limit"] == 60
    assert "***" in conf["broker_url"] and "guest:guest" not in conf["broker_url"]
    # Celery's default, not set by the app: left out unless asked for.
    assert "enable_utc" not in conf and "worker_pool" not in conf
    full = inspect.conf(with_defaults=True)[node.name]
    assert full["enable_utc"] is True and full["worker_pool"] == "prefork"
    assert conf.items() <= full.items()


def test_ctl_inspect_conf_with_defaults(test_vhost_url: str, node: WorkerProcess):
    proc = ctl(test_vhost_url, "inspect", "conf", "--with-defaults", "-d", node.name, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)[node.name]["event_serializer"] == "json"


def test_inspect_report_is_a_text_of_versions_platform_and_settings(app: App, node: WorkerProcess):
    text = app.control.inspect(destination=[node.name], timeout=5).report()[node.name]["ok"]
    assert text.startswith("\nsoftware -> clockwork:"), text
    assert "platform -> system:" in text, text
    assert "loader   -> tests.integration.task_api_tasks:app" in text, text
    assert "settings -> transport:amqp results:rpc://" in text, text
    assert "task_serializer: 'json'" in text, text
    assert "guest:guest" not in text, text


def test_ctl_inspect_report_prints_the_report_under_the_node(test_vhost_url: str, node: WorkerProcess):
    proc = ctl(test_vhost_url, "inspect", "report", "-d", node.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [node.name, "OK"], proc.stdout
    assert any(line.strip().startswith("software -> clockwork:") for line in lines[1:]), proc.stdout
    assert any(line.strip().startswith("worker_hijack_root_logger: True") for line in lines), proc.stdout
