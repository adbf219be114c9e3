"""examples/fastapi_app.py served for real by uvicorn, called over HTTP, its tasks run by a worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.amqp import delete_queues
from tests.support.process_tree import signal_tree
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(test_vhost_url: str) -> Iterator[str]:
    queue = unique_queue("fastapi")
    env = {"CLOCKWORK_BROKER_URL": test_vhost_url, "CLOCKWORK_DEFAULT_QUEUE": queue}
    log = Path(tempfile.mkstemp(prefix="clockwork-uvicorn-", suffix=".log")[1])
    with WorkerProcess(
        test_vhost_url, app="examples.tasks:app", queues=[queue], concurrency=1, env=env
    ) as worker:
        worker.wait_ready()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "examples.fastapi_app:api",
                    "--port",
                    "0",
                    "--no-access-log",
                ],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                found = wait_for(
                    lambda: re.search(r"Uvicorn running on (http://\S+)", log.read_text()),
                    timeout_s=30,
                    message=f"uvicorn up: {log}",
                )
                assert found is not None
                yield found.group(1)
            finally:
                signal_tree(proc.pid, 15)
                proc.wait(timeout=20)
    assert "Application shutdown complete" in log.read_text()  # the lifespan closed the AsyncApp
    delete_queues(test_vhost_url, queue)


def test_an_endpoint_awaits_a_tasks_result_and_another_fires_and_forgets(server: str):
    with httpx.Client(base_url=server, timeout=20) as http:
        answer = http.get("/add", params={"x": 2, "y": 3})
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"] == 5
        sent = http.post("/words", json={"text": "a b a"})
        assert sent.status_code == 202, sent.text
        task_id = sent.json()["task_id"]
        wait_for(
            lambda: http.get(f"/result/{task_id}").json()["state"] == "SUCCESS",
            timeout_s=20,
            message="the fire-and-forget task ran",
        )
