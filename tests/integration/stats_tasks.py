"""Tasks of the dedupe and stats tests of consuming children (``test_children_stats.py``)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from urllib.parse import urlsplit

from broker_svc import App, Settings, Task

app = App("stats", settings=Settings.from_env())


def _append(path: str, line: str) -> None:
    with open(path, "a") as out:
        out.write(line + "\n")


@app.task
def record(path: str, tag: str, seconds: float = 0.0) -> int:
    """Append ``tag`` to ``path`` (a line per run), after ``seconds``; the pid of the child that ran it."""
    time.sleep(seconds)
    _append(path, tag)
    return os.getpid()


@app.task
def die_first(path: str) -> int:
    """End this child in the middle of the task the first time; succeed the next."""
    if not os.path.exists(path):
        _append(path, f"died {os.getpid()}")
        os._exit(1)
    _append(path, f"ran {os.getpid()}")
    return os.getpid()


@app.task(ignore_result=True)
def cut_connection(path: str, release: str) -> None:
    """Record the run, cut this child's broker connection, and hold until ``release`` exists (30 s at most).

    The broker gives the delivery back as the connection closes, to the worker's other child,
    while this run goes on.
    """
    _append(path, f"ran {os.getpid()}")
    port = urlsplit(os.environ["CLOCKWORK_BROKER_URL"]).port or 5672
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=os.dup(int(name)))
            with sock:
                peer = sock.getpeername()
                if isinstance(peer, tuple) and peer[1] == port:
                    sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 30
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task
def fail(message: str) -> None:
    raise ValueError(message)


@app.task(bind=True, max_retries=1)
def retry_once(self: Task) -> str:
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return "retried"
