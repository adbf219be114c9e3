"""The canvas tasks on an app whose result backend is the test run's Redis (``CLOCKWORK_TEST_REDIS_URL``),
plus tasks that retry and report STARTED, under names the Celery app registers too."""

from __future__ import annotations

import os
from pathlib import Path

from tests.integration.canvas_tasks import app

app.conf.update(result_backend=os.environ["CLOCKWORK_TEST_REDIS_URL"], result_extended=True)


@app.task(name="redis.retry_until", bind=True, track_started=True, max_retries=None)
def retry_until(self, path: str) -> int:
    """Retries every half second until ``path`` exists; returns how many times it retried."""
    if not Path(path).exists():
        raise self.retry(countdown=0.5, exc=FileNotFoundError(path))
    return int(self.request.retries)
