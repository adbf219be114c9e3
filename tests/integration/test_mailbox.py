"""The worker's mailbox answers pidbox requests: from raw AMQP, and from the real `celery inspect`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from broker_svc import Settings
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess


@pytest.fixture
def node(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as proc:
        yield proc.wait_ready()


def test_ping_gets_a_pong_with_the_ticket_and_a_clock_past_ours(test_vhost_url: str, node: WorkerProcess):
    replies = call(test_vhost_url, "ping", clock=5000)
    assert len(replies) == 1
    headers, body = replies[0]
    assert body == {node.name: {"ok": "pong"}}
    assert headers["ticket"] and headers["clock"] > 5000


def test_destination_selects_the_node(test_vhost_url: str, node: WorkerProcess):
    assert call(test_vhost_url, "ping", destination=["someone-else@host"]) == []
    assert len(call(test_vhost_url, "clock", destination=[node.name])) == 1


def test_unknown_commands_and_bad_arguments_get_error_replies(test_vhost_url: str, node: WorkerProcess):
    [(_, body)] = call(test_vhost_url, "no_such_command")
    assert "error" in body[node.name]
    [(_, body)] = call(test_vhost_url, "ping", arguments={"bogus": 1})
    assert "error" in body[node.name]


def test_garbage_on_the_control_exchange_never_stops_the_node(test_vhost_url: str, node: WorkerProcess):
    garbage_inputs = [
        (b"\xff\xfe", "application/json"),
        (b"[1,2]", "application/json"),
        (b"\x80\x04", "application/x-python-serialize"),
        (b"x" * (16 * 1024 * 1024 + 1), "application/json"),  # over the node's limit
    ]
    for garbage, ctype in garbage_inputs:
        assert call(test_vhost_url, "ping", body=garbage, content_type=ctype) == []
    assert call(test_vhost_url, "ping")[0][1] == {node.name: {"ok": "pong"}}
    assert node.proc.poll() is None
    wait_for(lambda: node.count("control_request_refused") >= 4, timeout_s=5, message="garbage not logged")


@pytest.mark.interop
def test_celery_inspect_ping_and_registered_see_our_worker(test_vhost_url: str, node: WorkerProcess):
    env = {**os.environ, "INTEROP_BROKER_URL": test_vhost_url}
    base = [sys.executable, "-m", "celery", "-A", "tests.interop.celery_app"]
    ping = subprocess.run([*base, "inspect", "ping", "--timeout", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert node.name in ping.stdout and "pong" in ping.stdout
    registered = subprocess.run([*base, "inspect", "registered", "-d", node.name, "--timeout", "3"], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert registered.returncode == 0, registered.stdout + registered.stderr
    assert "tests.integration.e2e_tasks.add" in registered.stdout
    assert Settings(broker_url=test_vhost_url).virtual_host  # the run used the session's vhost


@pytest.mark.interop
def test_celery_inspect_active_and_stats_read_our_worker(
    test_vhost_url: str, queue: str, node: WorkerProcess
):
    from broker_svc import App

    app = App("inspect-client", settings=Settings(broker_url=test_vhost_url))
    try:
        running = app.send_task(
            "tests.integration.e2e_tasks.sleep_s", (15, "slow"), queue=queue, task_id="act-1"
        )
        [(_, body)] = wait_for(
            lambda: [r for r in call(test_vhost_url, "active") if r[1][node.name]],
            timeout_s=20,
            message="the task never showed up as active",
        )
        [info] = body[node.name]
        assert info["id"] == "act-1" and info["name"] == "tests.integration.e2e_tasks.sleep_s"
        assert info["args"] == [15, "slow"] and info["worker_pid"] > 0 and info["time_start"] > 0
        env = {**os.environ, "INTEROP_BROKER_URL": test_vhost_url}
        base = [sys.executable, "-m", "celery", "-A", "tests.interop.celery_app"]
        for command, expected in (("active", "act-1"), ("stats", '"max-concurrency": 1')):
            out = subprocess.run([*base, "inspect", command, "--timeout", "3"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr
            assert expected in out.stdout, out.stdout
        assert running.get(timeout=60) == "slow"
        # Consuming children report their counts at most once a second.
        wait_for(
            lambda: (
                call(test_vhost_url, "stats")[0][1][node.name]["total"]
                == {"tests.integration.e2e_tasks.sleep_s": 1}
            ),
            timeout_s=10,
            message="stats total",
        )
        [(_, stats)] = call(test_vhost_url, "stats")
        assert isinstance(stats[node.name]["clock"], str)
    finally:
        app.close()
