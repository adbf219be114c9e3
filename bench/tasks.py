"""Tasks the benchmarks run."""

from __future__ import annotations

import time

from broker_svc import App

app = App("bench")


@app.task(name="bench.tasks.noop")
def noop() -> None:
    return None


@app.task(name="bench.tasks.timed")
def timed(seconds: float) -> list[float]:
    """Sleep; return when the body started and ended (wall clock)."""
    started = time.time()
    time.sleep(seconds)
    return [started, time.time()]


@app.task(name="bench.tasks.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="bench.tasks.xsum")
def xsum(numbers: list[int]) -> int:
    return sum(numbers)
