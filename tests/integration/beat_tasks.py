"""The app the scheduler tests run: its ``beat_schedule`` comes from ``BEAT_TEST_SCHEDULE`` (JSON).

Each entry is Celery's map, with ``schedule`` in seconds. ``beat.tick`` appends what it ran to a
journal file: its id, the entry and scheduled instant the scheduler put in its header, when it
started and ended; the tests check the fires from there.
"""

from __future__ import annotations

import json
import os
import time

from broker_svc import App, Task
from tests.support.beats import record_run

app = App("beat-tests")
app.conf.beat_schedule = json.loads(os.environ.get("BEAT_TEST_SCHEDULE", "{}"))
app.conf.timezone = os.environ.get("BEAT_TEST_TIMEZONE", "UTC")


@app.task(bind=True, name="beat.tick")
def tick(self: Task, journal: str, seconds: float = 0.0) -> str:
    started = time.time()
    if seconds:
        time.sleep(seconds)
    record_run(journal, self.request, started=started)
    return str(self.request.id)


@app.task(bind=True, name="beat.declared", queue=os.environ.get("BEAT_TEST_DECLARED_QUEUE", "beat-declared"))
def declared(self: Task, journal: str) -> str:
    """A task whose queue is its declaration's, fired by an entry that names none."""
    record_run(journal, self.request, started=time.time())
    return str(self.request.id)
