"""Tasks for the process-pool tests (imported by the pool's children, so keep it small)."""

from __future__ import annotations

import os
import time
from typing import Any

from broker_svc import App
from broker_svc.errors import SoftTimeLimitExceeded
from worker.child.run import current_request, send_update

app = App("pooltests")


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def boom() -> None:
    raise ValueError("boom")


@app.task
def sleep_s(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task
def die() -> None:
    os._exit(3)


@app.task
def soft_limited(seconds: float) -> str:
    try:
        time.sleep(seconds)
    except SoftTimeLimitExceeded:
        return "caught"
    return "not caught"


@app.task
def returns_unencodable() -> Any:
    return object()


@app.task
def progress() -> str:
    send_update({"state": "PROGRESS", "meta": {"done": 1}})
    send_update({"state": "PROGRESS", "meta": {"done": 2}})
    return "finished"


@app.task
def pid() -> int:
    return os.getpid()


@app.task
def report_then_sleep(seconds: float) -> float:
    send_update({"sleeping": seconds})
    time.sleep(seconds)
    return seconds


@app.task
def request_info() -> dict[str, Any]:
    return current_request()


_ballast: list[bytes] = []


@app.task
def grow_memory(mib: int) -> int:
    """Keep ``mib`` MiB allocated in this child (for --max-memory-per-child)."""
    _ballast.append(os.urandom(1024) * (mib * 1024))
    return os.getpid()
