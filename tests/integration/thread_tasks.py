"""Tasks for the ``--threads`` tests: which thread runs, and bodies the soft limit can reach."""

from __future__ import annotations

import os
import threading
import time

from broker_svc import App, Settings, SoftTimeLimitExceeded

app = App("threads", settings=Settings.from_env())


@app.task
def where(seconds: float) -> list[object]:
    """Sleep, then say which process and thread ran this."""
    time.sleep(seconds)
    return [os.getpid(), threading.current_thread().name]


@app.task(soft_time_limit=0.3)
def spin_caught() -> str:
    # Python bytecode all along: the soft limit lands within the loop.
    deadline = time.monotonic() + 5
    try:
        while time.monotonic() < deadline:
            pass
    except SoftTimeLimitExceeded:
        return "soft limit caught"
    return "not interrupted"


@app.task(soft_time_limit=0.3)
def spin() -> str:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pass
    return "not interrupted"


@app.task(soft_time_limit=0.5)
def quick() -> str:
    # Ends well within its soft limit: nothing may reach it (or a later task) afterwards.
    return "done"


@app.task(time_limit=0.5)
def hard_limited() -> str:
    time.sleep(5)
    return "not killed"
