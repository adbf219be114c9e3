"""The app the scheduler tests run: its ``beat_schedule`` comes from ``BEAT_TEST_SCHEDULE`` (JSON).

Each entry is Celery's map, with ``schedule`` in seconds. ``beat.tick`` appends what it ran to a
journal file: its id, the entry and scheduled instant the scheduler put in its header, when it
started and ended; the tests check the fires from there.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time

from broker_svc import App, Task

app = App("beat-tests")
app.conf.beat_schedule = json.loads(os.environ.get("BEAT_TEST_SCHEDULE", "{}"))
app.conf.timezone = os.environ.get("BEAT_TEST_TIMEZONE", "UTC")


@app.task(bind=True, name="beat.tick")
def tick(self: Task, journal: str, seconds: float = 0.0) -> str:
    headers = self.request.headers or {}
    scheduled = headers.get("clockwork_beat_scheduled")
    started = time.time()
    if seconds:
        time.sleep(seconds)
    line = {
        "id": self.request.id,
        "entry": headers.get("clockwork_beat_entry"),
        "scheduled": dt.datetime.fromisoformat(scheduled).timestamp() if scheduled else None,
        "run_now": headers.get("clockwork_beat_run_now"),
        "start": started,
        "end": time.time(),
        "pid": os.getpid(),
    }
    with open(journal, "a") as out:  # one write per line, O_APPEND: lines never interleave
        out.write(json.dumps(line) + "\n")
    return str(self.request.id)
