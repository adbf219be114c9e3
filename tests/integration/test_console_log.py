"""On a terminal the worker's log is for people: a failed task's traceback is printed as Python prints it."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys

from broker_svc import App, Settings
from broker_svc.errors import TaskError
from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, STATE_DIR, WorkerProcess, unique_queue

APP = "tests.integration.e2e_tasks:app"
BOOM = "tests.integration.e2e_tasks.boom"


class _Terminal:
    """What a worker with a pseudo-terminal as its stdout and stderr wrote there."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.text = ""

    def read(self) -> str:
        while select.select([self._fd], [], [], 0)[0]:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # the worker closed its side
                break
            if not chunk:
                break
            self.text += chunk.decode(errors="replace")
        return self.text


def test_a_failed_tasks_traceback_is_many_lines_on_a_terminal(test_vhost_url: str):
    queue = unique_queue("console")
    controller, terminal_fd = pty.openpty()
    cmd = [sys.executable, "-m", "worker", "-A", APP, "-c", "1", "-Q", queue, "-b", test_vhost_url,
           "--statedb", "none", "--without-mingle"]  # fmt: skip
    env = {**os.environ, "CLOCKWORK_STATE_DIR": STATE_DIR, "NO_COLOR": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=terminal_fd, stderr=terminal_fd, env=env)
    os.close(terminal_fd)
    terminal = _Terminal(controller)
    client = App("console-client", settings=Settings(broker_url=test_vhost_url, default_queue=queue))
    try:
        wait_for(lambda: "worker_ready" in terminal.read() or proc.poll() is not None, timeout_s=60,
                 message="the worker did not start")  # fmt: skip
        assert proc.poll() is None, terminal.read()
        result = client.send_task(BOOM, ("on purpose",))
        try:
            result.get(timeout=30)
        except TaskError:
            pass
        wait_for(lambda: "ValueError: on purpose" in terminal.read(), timeout_s=30, message="no traceback")
        text = terminal.read()
        failed = text.index("task_failed")
        below = text[failed:].splitlines()
        assert below[1].lstrip().startswith("Traceback (most recent call last):"), text[failed:]
        assert any(line.strip() == "raise ValueError(message)" for line in below), text[failed:]
        assert "\\n" not in text[failed : failed + text[failed:].index("ValueError: on purpose")]
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=60)
        os.close(controller)
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_a_failed_tasks_traceback_stays_one_json_field_off_a_terminal(test_vhost_url: str):
    queue = unique_queue("jsonlog")
    client = App("json-client", settings=Settings(broker_url=test_vhost_url, default_queue=queue))
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        try:
            client.send_task(BOOM, ("on purpose",)).get(timeout=30)
        except TaskError:
            pass
        failed = worker.first("task_failed")
        assert "Traceback (most recent call last):" in failed["traceback"]
        assert "ValueError: on purpose" in failed["traceback"]
        assert not [line for line in worker.log_text().splitlines() if line.startswith("Traceback")]
    client.close()
    delete_queues(test_vhost_url, queue, f"{queue}.dead")
