"""Start real worker processes for tests and wait on what they log (never a bare sleep)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.process_tree import signal_tree
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
# Options every test worker gets first, to run a suite in another shape, e.g.
# CLOCKWORK_TEST_WORKER_ARGS="--threads 4" pytest tests/reliability (a test's own come after).
DESIGN_ARGS = os.environ.get("CLOCKWORK_TEST_WORKER_ARGS", "").split()
# How the reliability report tags its records: each pool child consumes for itself, with one
# thread or several.
DESIGN = "children-consume"


def _threads(args: Sequence[str]) -> int:
    # The last ``--threads N`` (or ``--threads=N``) wins, as in the worker's parser.
    threads = 1
    for index, arg in enumerate(args):
        if arg == "--threads" and index + 1 < len(args):
            threads = int(args[index + 1])
        elif arg.startswith("--threads="):
            threads = int(arg.partition("=")[2])
    return threads


# Tasks each child runs at once (``--threads``): the tests that size their work or bound their
# duplicates by the children scale by it. A run with threads is a design of its own in the report.
DESIGN_THREADS = _threads(DESIGN_ARGS)
if DESIGN_THREADS > 1:
    DESIGN = "threads"
# Workers keep their revoked-set state files here (per node name), not in the user's home; a
# worker restarted under the same name finds its file again.
STATE_DIR = tempfile.mkdtemp(prefix="clockwork-test-state-")


class WorkerProcess:
    """``python -m worker`` in a subprocess, logging JSON lines to a file the test can read."""

    def __init__(
        self,
        url: str,
        *,
        app: str = "tests.integration.e2e_tasks:app",
        queues: Sequence[str] = ("celery",),
        concurrency: int = 2,
        name: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name or f"w{uuid.uuid4().hex[:6]}@test"
        self.queues = list(queues)
        self.concurrency = concurrency
        self.args = [*DESIGN_ARGS, *extra_args]  # the worker's options beside -A, -c, -n, -Q, -b, -l
        # At debug: tests wait on start-up facts a user does not need at info (the chord joiner
        # subscribed, each child consuming, the dedup gate active); a -l in extra_args wins.
        self._log = Path(tempfile.mkstemp(prefix="clockwork-worker-", suffix=".log")[1])
        self._logfile = self._log.open("w")
        cmd = [
            sys.executable, "-m", "worker", "-A", app, "-c", str(concurrency), "-n", self.name,
            "-Q", ",".join(queues), "-b", url, "-l", "debug", *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._logfile,
            stderr=subprocess.STDOUT,
            # The app's own client (tasks sending tasks) talks to the same broker and vhost.
            env={
                **os.environ,
                "CLOCKWORK_BROKER_URL": url,
                "CLOCKWORK_STATE_DIR": STATE_DIR,
                **(env or {}),
                "PYTHONUNBUFFERED": "1",
            },
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def consumers_per_queue(self) -> int:
        """The consumers the broker lists on each task queue once the worker consumes.

        One per child (a fixed pool: not with ``--autoscale``), whatever ``--threads`` says: a
        child's threads share one consumer.
        """
        return self.concurrency

    def signal_tree(self, sig: int) -> list[int]:
        """Send ``sig`` to the worker and every process under it (a frozen machine freezes them all)."""
        return signal_tree(self.proc.pid, sig)

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far."""
        out = []
        for line in self._log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def count(self, event: str) -> int:
        return sum(1 for e in self.events() if e.get("event") == event)

    def first(self, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The first log line of ``event``, waiting for it."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events() if e.get("event") == event), None)

        message = f"{event} not logged:\n{self.log_text()[-4000:]}"
        record = wait_for(found, timeout_s=timeout_s, message=message)
        assert record is not None
        return record

    def log_text(self) -> str:
        return self._log.read_text()

    def wait_ready(self, timeout_s: float = 60.0) -> WorkerProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            return self.count("worker_ready") > 0

        wait_for(ready, timeout_s=timeout_s, message=f"worker not ready:\n{self.log_text()[-4000:]}")
        return self

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self) -> None:
        try:
            self.terminate(timeout_s=30)
        except subprocess.TimeoutExpired:
            self.kill()
        finally:
            self._logfile.close()
            self._log.unlink(missing_ok=True)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unique_queue(prefix: str = "q") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds
