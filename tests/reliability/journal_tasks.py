"""Tasks the chaos tests run in real workers; each journals its execution before anything else."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from broker_svc import App, Task
from tests.reliability.journal import record_execution
from tests.support.process_tree import descendants, worker_main_pid

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


@app.task(bind=True, name="journal.kill_worker")
def kill_worker(self: Task) -> None:
    """A poison task that SIGKILLs the whole worker: its main process and every process under it.

    As a machine or container dies: the child holds the delivery, so killing the main process
    alone would let this run end and be acked.
    """
    _journal(self)
    main, me = worker_main_pid(), os.getpid()
    for pid in [main, *descendants(main)]:  # listed before the first kill, which reparents the rest
        if pid != me:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)  # last, or the processes after it in the list would survive
