"""Tasks the chaos tests run in real workers; each journals its execution before anything else."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from broker_svc import App, Task
from tests.reliability.journal import record_execution

app = App("journal")


def _journal(task: Task) -> None:
    record_execution(task.request.id, task.request.delivery_info)


@app.task(bind=True, name="journal.noop")
def noop(self: Task) -> None:
    _journal(self)


@app.task(bind=True, name="journal.sleep")
def sleep(self: Task, seconds: float) -> None:
    _journal(self)
    time.sleep(seconds)


@app.task(bind=True, name="journal.record_then_sleep")
def record_then_sleep(self: Task, seconds: float) -> None:
    """The side effect first, then a pause before the ack: a kill here forces a duplicate."""
    _journal(self)
    time.sleep(seconds)


@app.task(bind=True, name="journal.kill_child")
def kill_child(self: Task) -> None:
    """A poison task that kills the child process running it."""
    _journal(self)
    os.kill(os.getpid(), signal.SIGKILL)


def _worker_pid() -> int:
    # Children fork from the pool's forkserver, whose parent is the worker's main process.
    stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


@app.task(bind=True, name="journal.kill_worker")
def kill_worker(self: Task) -> None:
    """A poison task that SIGKILLs the whole worker: its main process, not just the forkserver."""
    _journal(self)
    os.kill(_worker_pid(), signal.SIGKILL)
