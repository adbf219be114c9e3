from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.interop


@pytest.fixture
def celery_client(test_vhost_url: str):
    from celery import Celery

    app = Celery("interop-client", broker=test_vhost_url, backend="rpc://")
    app.conf.update(accept_content=["json", "msgpack"], result_accept_content=["json", "msgpack"])
    yield app
    close_celery_client(app)


def close_celery_client(app: Any) -> None:
    """Close a Celery client app and its result backend's sockets, which ``app.close()`` leaves
    open: the rpc backend's consumer connection, the Redis backend's pub/sub and pool."""
    backend = app.backend
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and getattr(consumer, "_connection", None) is not None:
        consumer._connection.close()
    if consumer is not None and getattr(consumer, "_pubsub", None) is not None:
        # Its handles unsubscribe when collected, maybe after a private Redis stopped: none is
        # needed any more.
        consumer.subscribed_to.clear()
        consumer.stop()
    redis_client = backend.__dict__.get("client")  # a cached property: only if it was opened
    if redis_client is not None:
        redis_client.connection_pool.disconnect()
    app.close()


def connected_sockets(port: int) -> int:
    """How many of this process's TCP sockets are connected to ``port`` on loopback (Linux /proc).

    A socket left open is closed when collected, with a ``ResourceWarning`` that the suite turns into
    a failure of whichever test the collection lands in."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[9] in inodes and fields[3] == "01":  # ESTABLISHED
                    count += 1
    return count


@pytest.fixture
def start_celery_worker(test_vhost_url: str) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``celery worker`` (solo pool) on a queue and wait until it says it is ready."""
    with ExitStack() as stack:

        def start(
            queue: str, pool: str = "solo", *, social: bool = False, concurrency: int = 1
        ) -> subprocess.Popen[bytes]:
            """``social``: with Mingle, gossip and heartbeats (off by default: they slow start-up)."""
            worker = celery_worker(test_vhost_url, queue, pool, social=social, concurrency=concurrency)
            return stack.enter_context(worker).proc

        yield start


@dataclass(frozen=True)
class CeleryWorker:
    proc: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text()


@contextmanager
def celery_worker(
    url: str, queue: str, pool: str = "solo", *, social: bool = False, concurrency: int = 1
) -> Iterator[CeleryWorker]:
    """A ``celery worker`` of ``tests/interop/celery_app.py`` on ``queue``, ready; stopped on exit.

    For a fixture of a wider scope than ``start_celery_worker``'s (a module's own vhost).
    """
    log = Path(tempfile.mkstemp(prefix="celery-worker-", suffix=".log")[1])
    with log.open("w") as out:
        proc = _popen_celery_worker(queue, out, url, pool, social=social, concurrency=concurrency)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"celery worker exited:\n{log.read_text()[-3000:]}")
            return "ready." in log.read_text()

        wait_for(ready, timeout_s=60, message=f"celery worker not ready:\n{log.read_text()[-3000:]}")
        yield CeleryWorker(proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        text = log.read_text()
        log.unlink(missing_ok=True)
    assert "PRECONDITION_FAILED" not in text, text[-3000:]


def celery_node_name(queue: str) -> str:
    """The node name ``start_celery_worker`` gives the Celery worker of ``queue``."""
    return f"celery-{queue}@{socket.gethostname()}"


def _popen_celery_worker(
    queue: str, out: IO[str], url: str, pool: str, *, social: bool = False, concurrency: int = 1
) -> subprocess.Popen[bytes]:
    # The child keeps its own copy of the log file descriptor; ours is closed by the caller.
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.interop.celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            f"celery-{queue}@%h",
            *([] if social else ["--without-mingle", "--without-gossip", "--without-heartbeat"]),
            "-l",
            "info",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "INTEROP_BROKER_URL": url},
    )
