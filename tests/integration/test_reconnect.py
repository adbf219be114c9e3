"""After the broker drops its connection, a worker announces itself again and re-runs Mingle."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest

from tests.support.events import EventTap
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess


def test_a_reconnected_worker_says_online_again_mingles_and_answers(
    test_vhost_url: str, queue: str, session_broker, client
):
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from the broker side)")
    vhost = unquote(urlsplit(test_vhost_url).path[1:]) or "/"
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        assert worker.count("mingle_done") == 1
        session_broker.rabbitmqctl("close_all_connections", "-p", vhost, "reconnect test")
        wait_for(lambda: worker.count("mingle_done") >= 2, timeout_s=60, message="a second Mingle")
        assert worker.count("worker_reconnected") >= 1
        with EventTap(test_vhost_url) as tap:
            tap.wait(lambda ev: bool(tap.of("worker-heartbeat", hostname=worker.name)), message="heartbeats")
        reply = call(test_vhost_url, "ping", destination=[worker.name], expect=1)
        assert reply[0][1] == {worker.name: {"ok": "pong"}}
        result = client.send_task("tests.integration.e2e_tasks.add", args=(1, 4), queue=queue)
        assert result.get(timeout=60) == 5
