"""The canvas tasks on an app whose result backend is the test run's Redis (``CLOCKWORK_TEST_REDIS_URL``),
plus a task that retries and one that blocks (``task_track_started``: STARTED is stored too)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.integration.canvas_tasks import app

app.conf.update(
    result_backend=os.environ["CLOCKWORK_TEST_REDIS_URL"], result_extended=True, task_track_started=True
)


@app.task(name="redis.block_until")
def block_until(path: str) -> str:
    """Runs until ``path`` exists (at most 30 s), so a test can see it STARTED."""
    deadline = time.monotonic() + 30
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return "unblocked"


@app.task(name="redis.retry_until", bind=True, max_retries=None)
def retry_until(self, path: str) -> int:
    """Retries every half second until ``path`` exists; returns how many times it retried."""
    if not Path(path).exists():
        raise self.retry(countdown=0.5, exc=FileNotFoundError(path))
    return int(self.request.retries)
