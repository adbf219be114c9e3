"""Tasks the end-to-end tests run in real workers."""

from __future__ import annotations

import os
import time

from broker_svc import App

app = App("e2e")


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def boom(message: str) -> None:
    raise ValueError(message)


@app.task
def sleep_s(seconds: float, tag: str = "") -> str:
    time.sleep(seconds)
    return tag


@app.task(name="e2e.echo")
def echo(value: object) -> object:
    return value


@app.task
def noop() -> None:
    return None


@app.task
def kill_child() -> None:
    os._exit(9)


@app.task
def started_at() -> float:
    """When the task body ran (wall clock), for ETA tests."""
    return time.time()


@app.task
def record(path: str, tag: str) -> str:
    """Append ``tag`` to the file at ``path``: proof that the body ran."""
    with open(path, "a") as out:
        out.write(tag + "\n")
    return tag


@app.task
def sleep_then_record(path: str, tag: str, seconds: float) -> str:
    """Sleep, then append ``tag`` (a task killed while it sleeps records nothing)."""
    time.sleep(seconds)
    with open(path, "a") as out:
        out.write(tag + "\n")
    return tag


@app.task(rate_limit="10/s")
def limited() -> float:
    """When the body ran (wall clock), for rate-limit tests."""
    return time.time()


@app.task
def timed(seconds: float) -> list[float]:
    """Sleep, and say when the body started and ended (wall clock), for fairness tests."""
    started = time.time()
    time.sleep(seconds)
    return [started, time.time()]
