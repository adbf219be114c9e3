"""Runtime changes through ``ctl control`` and ``app.control``: queues, rate limits, time limits."""

from __future__ import annotations

import json
import subprocess

from broker_svc import App
from tests.support.amqp import channel, delete_queues, queue_depth
from tests.support.cli import run_ctl
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

ADD = "tests.integration.e2e_tasks.add"


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return run_ctl(*args)[0]


def _queues(url: str, node: str) -> list[str]:
    proc = ctl("inspect", "active-queues", "-b", url, "-d", node, "--json", "--timeout", "5")
    assert proc.returncode == 0, proc.stderr
    return [q["name"] for q in json.loads(proc.stdout)[node]]


def test_queues_are_added_and_cancelled_at_runtime_with_ctl(test_vhost_url: str, queue: str, client: App):
    extra = unique_queue("extra")
    try:
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready()
            base = ("-b", test_vhost_url, "-d", worker.name, "--timeout", "5", "--json")
            proc = ctl("control", "add-consumer", extra, *base)
            assert proc.returncode == 0, proc.stderr
            assert json.loads(proc.stdout) == {worker.name: {"ok": f"add consumer {extra}"}}
            assert _queues(test_vhost_url, worker.name) == [queue, extra]
            assert client.send_task(ADD, args=(2, 2), queue=extra).get(timeout=30) == 4

            proc = ctl("control", "cancel-consumer", extra, *base)
            assert json.loads(proc.stdout) == {worker.name: {"ok": f"no longer consuming from {extra}"}}
            assert _queues(test_vhost_url, worker.name) == [queue]
            late = client.send_task(ADD, args=(3, 3), queue=extra)
            client.flush()
            # Nobody consumes the extra queue now: the task waits there.
            wait_for(lambda: queue_depth(test_vhost_url, extra) == 1, timeout_s=5, message="task not queued")
            with channel(test_vhost_url) as ch:
                assert ch.queue_declare(extra, passive=True).method.consumer_count == 0
            assert not late.ready()
    finally:
        delete_queues(test_vhost_url, extra, f"{extra}.dead")


def test_rate_and_time_limits_change_through_ctl_and_app_control(
    test_vhost_url: str, queue: str, client: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        base = ("-b", test_vhost_url, "-d", worker.name, "--timeout", "5", "--json")
        proc = ctl("control", "rate-limit", ADD, "5/s", *base)
        assert json.loads(proc.stdout) == {worker.name: {"ok": "new rate limit set successfully"}}
        proc = ctl("control", "rate-limit", ADD, "none", *base)
        assert json.loads(proc.stdout) == {worker.name: {"ok": "rate limit disabled successfully"}}
        proc = ctl("control", "time-limit", ADD, "1", "2", *base)
        assert json.loads(proc.stdout) == {worker.name: {"ok": "time limits set successfully"}}
        proc = ctl("control", "rate-limit", ADD, "5/s", "extra", *base)
        assert proc.returncode == 2 and "at most 2 argument" in proc.stderr

        replies = client.control.broadcast(
            "rate_limit",
            arguments={"task_name": ADD, "rate_limit": "2/m"},
            destination=[worker.name],
            reply=True,
        )
        assert replies == [{worker.name: {"ok": "new rate limit set successfully"}}]
